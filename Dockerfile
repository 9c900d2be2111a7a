# kiln's CPU server: `kiln serve` on an engine artifact mounted (or copied) at /models/artifact.
# Build from the repository root:  docker build -t kiln:cpu .
#   KILN_EXTRAS=scale adds Ray Serve (kiln serve --replicas / --ray-address).
#   BASE=<image> builds on another Debian-like image with CPython 3.11 (scripts/build_image.sh makes
#   one from Debian's packages with mmdebstrap); the default is python:3.11-slim.
# Run:  docker run -p 8000:8000 -v "$PWD/artifacts/smollm2:/models/artifact:ro" kiln:cpu
# Build the artifact on the CPU class the container runs on: its choices (backend, kernels) follow
# the build machine's CPU (docs/deployment.md).
ARG BASE=python:3.11-slim

# The builder: g++ compiles kiln's op libraries (kiln/kernels, the ort and OpenVINO op libraries)
# while the package is installed (setup.py); the image takes the finished virtual environment.
FROM ${BASE} AS builder
ARG KILN_EXTRAS=""
# Where pip finds packages, when not PyPI alone: scripts/build_image.sh passes this machine's pip
# configuration (mirrors, wheel folders, a CA bundle), its local folders mounted into the build.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
# DL3008 (pin apt versions) does not apply: the compiler only builds, and is not in the image.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/kiln/src
# The runtime's dependencies at the versions the test suite ran on (requirements/image.lock: the
# subset of requirements/dev.lock kiln's install needs, with hashes), then kiln itself on top.
COPY requirements/image.lock requirements/image.lock
RUN python3 -m venv /opt/kiln/venv \
    && /opt/kiln/venv/bin/pip install --require-hashes --no-deps -r requirements/image.lock
COPY pyproject.toml setup.py README.md ./
COPY kiln ./kiln
# --no-build-isolation: setup.py builds the OpenVINO op library against the openvino wheel the lock
# installed. An extra (KILN_EXTRAS) brings its own dependencies from pyproject.toml's ranges. Then
# both op libraries must load from the installed package (-I: not the source tree in this folder).
RUN /opt/kiln/venv/bin/pip install --no-build-isolation ".${KILN_EXTRAS:+[$KILN_EXTRAS]}" \
    && /opt/kiln/venv/bin/python -I -c "from kiln.engines.ort import native as o; from kiln.engines.openvino import native as v; o.require(); v.require()" \
    && find /opt/kiln/venv -name __pycache__ -prune -exec rm -rf {} +

FROM ${BASE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/kiln/venv/bin:$PATH
COPY --from=builder /opt/kiln/venv /opt/kiln/venv
RUN useradd --system --uid 10001 --home-dir /opt/kiln --shell /usr/sbin/nologin kiln

USER 10001
WORKDIR /opt/kiln
VOLUME ["/models"]
EXPOSE 8000

# /ready answers 200 once the engine has loaded and run its warm-up request.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=2).status != 200)"]

ENTRYPOINT ["kiln"]
CMD ["serve", "/models/artifact", "--host", "0.0.0.0", "--port", "8000"]
