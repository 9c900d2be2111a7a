"""The container image, built and run: scripts/build_image.sh makes a base from Debian's packages with
mmdebstrap, `podman build`s the Dockerfile on it (kiln's op libraries compiled in the builder stage,
the dependencies from requirements/image.lock), runs it with tiny-llama mounted read-only, and checks
/ready, a chat completion through the openai client, the image's HEALTHCHECK, a non-root server and
the read-only mount. Skipped, saying so, where podman or mmdebstrap is not installed (CI machines
may have no container runtime). Slow: the image build compiles the kernels (minutes on two cores)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "build_image.sh"

pytestmark = pytest.mark.slow


@pytest.mark.timeout(3600)
def test_the_image_builds_runs_and_answers_a_chat_request(request, tmp_path):
    missing = [tool for tool in ("podman", "mmdebstrap") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed: the image is built with podman on a base made "
                    "with mmdebstrap (Debian: apt-get install podman mmdebstrap)")
    # the container's user (uid 10001) reads the artifact: a copy anyone may read
    artifact = tmp_path / "artifact"
    shutil.copytree(request.getfixturevalue("tiny_llama_artifact"), artifact)
    for path in [tmp_path, *artifact.rglob("*"), artifact]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    run = subprocess.run(["bash", str(SCRIPT), str(artifact)], capture_output=True, text=True, timeout=3500,
                         env={**os.environ, "KILN_IMAGE": "kiln:test"})
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-5000:]
    out = run.stdout
    assert re.search(r"^build_image: ready: /ready answered 200", out, re.M), out
    assert re.search(r"^build_image: chat: artifact: '.*' \(\d+ tokens\)$", out, re.M), out
    assert "build_image: healthcheck: healthy" in out
    assert re.search(r"^build_image: user: uid 10001 \(\S+\), not root", out, re.M), out
    summary = dict(re.findall(r"(\w+)=(\d+)", out.splitlines()[-1]))
    assert int(summary["image_mb"]) > 100, out        # a Python runtime, onnxruntime and openvino at least
    print(out)
