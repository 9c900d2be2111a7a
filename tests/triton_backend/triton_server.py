"""A tritonserver child process with a bounded start and a clean stop (the Triton tests' harness).

    with TritonServer(repo, Ports.free(), log_path) as server:
        server.http_url, server.grpc_url, server.metrics_url

Start-up polls /v2/health/ready until a deadline and fails fast, with the log's tail, if the
process exits (a model that fails to load makes the whole server exit). The server runs in its
own session, so stopping it also ends the python-backend stubs it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from kiln.serving.triton.launch import Ports, TritonInstall, prepare_backends, server_command, server_env


class TritonServerError(RuntimeError):
    """tritonserver exited or did not become ready; the message holds the log's tail."""


class TritonServer:
    def __init__(self, repo: Path, ports: Ports, log_path: Path, backends: Path | None = None,
                 start_timeout: float = 120.0):
        self.repo, self.ports, self.log_path = Path(repo), ports, Path(log_path)
        self.backends, self.start_timeout = backends, start_timeout
        self.process: subprocess.Popen | None = None

    http_url = property(lambda self: f"127.0.0.1:{self.ports.http}")
    grpc_url = property(lambda self: f"127.0.0.1:{self.ports.grpc}")
    metrics_url = property(lambda self: f"http://127.0.0.1:{self.ports.metrics}/metrics")

    def __enter__(self) -> "TritonServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        install = TritonInstall.find()
        command = server_command(install, self.repo, prepare_backends(install, self.backends), self.ports)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, env=server_env(install), stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise TritonServerError(f"tritonserver exited with {self.process.returncode}:\n{self.log_errors()}")
            if self.is_ready():
                return
            time.sleep(0.1)
        raise TritonServerError(f"tritonserver not ready after {self.start_timeout:.0f} s:\n{self.log_tail()}")

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (the stubs finalize, a few seconds), then SIGKILL to the whole session."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        try:                            # anything of the session still there (a stuck stub)
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(5)

    def log_errors(self, max_lines: int = 12) -> str:
        """Triton's error lines (E...), where a model's load failure is, else the log's tail."""
        errors = [line for line in self.log_tail(1 << 20).splitlines()
                  if line.startswith("E") and "CudaDriverHelper" not in line]   # harmless on CPU
        return "\n".join(errors[-max_lines:]) or self.log_tail()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"
