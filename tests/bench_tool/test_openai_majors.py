"""kiln bench's openai target runs on the official client's current major release (the venv's, 3.x on
httpx2) and on the previous one (2.x on httpx), which scripts/setup.sh installs into .venv/openai2.
The load generator's openai tests are run again in a process whose `openai` is 2.x."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OPENAI2 = ROOT / ".venv" / "openai2"
LOADGEN_TESTS = Path(__file__).with_name("test_loadgen.py")


def on_openai2(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(OPENAI2), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_the_venv_runs_the_current_major_release():
    import openai

    assert int(openai.__version__.split(".")[0]) >= 3


@pytest.mark.skipif(not OPENAI2.is_dir(), reason="scripts/setup.sh installs openai 2.x into .venv/openai2")
def test_the_openai_target_works_on_the_previous_major_release():
    version = on_openai2("-c", "import openai; print(openai.__version__)")
    assert version.stdout.startswith("2."), version.stdout + version.stderr
    run = on_openai2("-m", "pytest", "-q", "-p", "no:cacheprovider", str(LOADGEN_TESTS), "-k", "openai")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-500:]
