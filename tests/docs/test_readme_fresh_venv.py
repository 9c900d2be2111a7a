"""The README's Install and Quick start, run as a new user runs them: in a fresh venv, with only the
extras those lines name, each command as written (the server's port aside, so the test never
collides with another server). It ends in the curl and openai calls answering.

The versions are the lock's (PIP_CONSTRAINT, names and versions from requirements/*.lock), so the
verdict does not move with what the registry serves that day; `bash scripts/lock.sh --upgrade`
moves them deliberately. The venv must hold no torch: the `build` extra has none."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from test_docs import ROOT, code_blocks, shell_lines
from test_readme import section

pytestmark = pytest.mark.slow
LOCKS = [ROOT / "requirements" / name for name in ("dev.lock", "models.lock")]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*==[^\s;\\]+)")
README_PORT = "8000"
READY_WITHIN_S = 180


def free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def lock_constraints(path: Path) -> Path:
    """The lock's pins without hashes: a constraints file pip applies to whatever a line installs."""
    pins = [m[1] for lock in LOCKS for line in lock.read_text().splitlines() if (m := PIN.match(line))]
    path.write_text("\n".join(pins) + "\n")
    return path


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """A fresh venv whose bin/ comes first on PATH, as after `source .venv/bin/activate`."""
    home = tmp_path_factory.mktemp("readme-user")
    venv = home / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "VIRTUAL_ENV": str(venv), "PIP_CONSTRAINT": str(lock_constraints(home / "constraints.txt"))}
    env.pop("PYTHONPATH", None)
    return home, venv, env


def run(line: str, env: dict, cwd: Path, timeout: float = 900) -> str:
    done = subprocess.run(line, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"`{line}` failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}"
    return done.stdout


def with_port(text: str, port: str) -> str:
    return text.replace(f"--port {README_PORT}", f"--port {port}").replace(f"127.0.0.1:{README_PORT}", f"127.0.0.1:{port}")


def wait_ready(proc: subprocess.Popen, port: str, log: Path) -> None:
    deadline = time.monotonic() + READY_WITHIN_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"kiln serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"kiln serve was not ready within {READY_WITHIN_S} s:\n{log.read_text()[-3000:]}")


def test_the_readme_install_and_quick_start_work_as_written(user):
    home, venv, env = user
    for line in shell_lines(section("Install").split("Or let the scripts")[0]):
        run(line, env, cwd=ROOT)
    assert subprocess.run([str(venv / "bin" / "python"), "-c", "import torch"], capture_output=True).returncode != 0, \
        "the build extra installed torch"

    quick, port = section("Quick start"), free_port()
    build_line, serve_line = [with_port(line, port) for line in shell_lines(quick) if line.startswith("kiln ")]
    run(build_line, env, cwd=home)
    log = home / "serve.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(serve_line, shell=True, cwd=home, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        wait_ready(server, port, log)
        curl = with_port(code_blocks(quick, ("bash",))[1], port)
        reply = json.loads(run(curl, env, cwd=home, timeout=120))
        assert "Tokyo" in reply["choices"][0]["message"]["content"]

        client = with_port(code_blocks(quick, ("python",))[0], port)
        install = re.search(r"#\s*(pip install \S+)", client)[1]          # what the snippet's comment says to run
        run(install, env, cwd=home)
        assert "Tokyo" in run(f"python - <<'EOF'\n{client}\nEOF", env, cwd=home, timeout=120)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
