"""`kiln serve` on a free loopback port for the load generator to hit: started once per module,
polled on /ready within a bounded wait, stopped with SIGTERM (then killed) at the end."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

KILN = Path(sys.executable).parent / "kiln"
READY_WITHIN_S = 120.0       # a loaded 2-core machine imports onnxruntime slowly
TINY_RUNTIME = ("--kv-cache-memory", "16MiB", "--threads", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + READY_WITHIN_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kiln serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"kiln serve was not ready within {READY_WITHIN_S} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def tiny_serve_url(tiny_llama_artifact, tmp_path_factory):
    from kiln.cli import main

    if "serve" not in main.commands:
        pytest.skip("kiln serve does not exist yet")
    port, log = free_port(), tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(KILN), "serve", str(tiny_llama_artifact), "--port", str(port), *TINY_RUNTIME],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, log)
        yield url
    finally:
        stop(proc)
