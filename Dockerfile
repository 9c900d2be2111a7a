# kiln's CPU server: `kiln serve` on an engine artifact mounted (or copied) at /models/artifact.
# Build from the repository root:  docker build -t kiln:cpu .
#   KILN_EXTRAS=scale adds Ray Serve (kiln serve --replicas / --ray-address).
# Run:  docker run -p 8000:8000 -v "$PWD/artifacts/smollm2:/models/artifact:ro" kiln:cpu
FROM python:3.11-slim

ARG KILN_EXTRAS=""
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/kiln/venv/bin:$PATH

# The runtime install (scripts/setup.sh installs the same package with its dev extras); the
# versions are pinned by pyproject.toml itself (onnxruntime, openvino, numpy<2, ray).
# DL3013 (pin pip versions) does not apply: "." is this repository's own source.
WORKDIR /opt/kiln/src
COPY pyproject.toml setup.py README.md ./
COPY kiln ./kiln
# hadolint ignore=DL3013
RUN python -m venv /opt/kiln/venv \
    && pip install --no-cache-dir ".${KILN_EXTRAS:+[$KILN_EXTRAS]}" \
    && useradd --system --uid 10001 --home-dir /opt/kiln --shell /usr/sbin/nologin kiln

USER 10001
WORKDIR /opt/kiln
VOLUME ["/models"]
EXPOSE 8000

# /ready answers 200 once the engine has loaded and run its warm-up request.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=2).status != 200)"]

ENTRYPOINT ["kiln"]
CMD ["serve", "/models/artifact", "--host", "0.0.0.0", "--port", "8000"]
