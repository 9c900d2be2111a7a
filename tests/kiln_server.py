"""`kiln serve` for real, for every test folder that needs one: a subprocess on a free loopback
port, polled until /ready, stopped with SIGTERM (then killed). Tests talk to it over HTTP only.
Imported by name (`from kiln_server import ServerProcess`), as tests/waiting.py is."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

KILN = Path(sys.executable).parent / "kiln"
START_TIMEOUT = 120.0      # seconds; a loaded 2-core machine imports onnxruntime slowly


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, artifact: Path, log_path: Path, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [str(KILN), "serve", str(artifact), "--port", str(self.port), *flags]
        # /metrics needs the key when the server has one (--public-endpoints does not name it)
        self.api_key = flags[flags.index("--api-key") + 1] if "--api-key" in flags else None
        self._log = open(log_path, "wb")
        env = {k: v for k, v in os.environ.items() if k != "KILN_API_KEY"}   # only --api-key counts here
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self) -> ServerProcess:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"kiln serve was not ready within {START_TIMEOUT} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        r = httpx.get(f"{self.url}/metrics", timeout=10, headers=headers)
        r.raise_for_status()
        return parse_metrics(r.text)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value}; buckets kept too."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
