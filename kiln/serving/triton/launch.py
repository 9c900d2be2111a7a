"""Start the tritonserver that nvidia-pytriton's wheel carries, on a rendered repository.

    python -m kiln.serving.triton.launch model_repository [--host 0.0.0.0] [--http-port 8000]
    kiln triton-repo ARTIFACT --out model_repository --print-command

The wheel ships the python backend without its stub; the stub for this Python is copied with
the backend into a private backends folder (site-packages stays untouched). The copies lose
their RPATH, so LD_LIBRARY_PATH names the wheel's bundled libraries, and the interpreter's
LIBDIR first, so the stub loads the libpython of this very interpreter.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shlex
import shutil
import socket
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

INSTALL_HINT = "install the Triton extra: pip install 'kiln[triton]' (nvidia-pytriton)"
PYTHON_VERSION = f"{sys.version_info[0]}.{sys.version_info[1]}"


@dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002

    @classmethod
    def free(cls) -> "Ports":
        """Three free loopback ports (Triton has no 'port 0'): bound together, so all differ."""
        socks = [socket.socket() for _ in range(3)]
        try:
            for s in socks:
                s.bind(("127.0.0.1", 0))
            return cls(*(s.getsockname()[1] for s in socks))
        finally:
            for s in socks:
                s.close()


@dataclass(frozen=True)
class TritonInstall:
    root: Path                       # .../site-packages/pytriton/tritonserver

    @classmethod
    def find(cls) -> "TritonInstall":
        spec = importlib.util.find_spec("pytriton")   # located, not imported: pytriton is heavy
        if spec is None or spec.origin is None:
            raise FileNotFoundError(f"tritonserver not found; {INSTALL_HINT}")
        root = Path(spec.origin).parent / "tritonserver"
        if not (root / "bin" / "tritonserver").is_file():
            raise FileNotFoundError(f"{root} has no bin/tritonserver; reinstall: {INSTALL_HINT}")
        return cls(root)

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def libs(self) -> Path:
        return self.root.parent.parent / "nvidia_pytriton.libs"

    @property
    def stub(self) -> Path:
        stub = self.root / "python_backend_stubs" / PYTHON_VERSION / "triton_python_backend_stub"
        if not stub.is_file():
            raise FileNotFoundError(f"nvidia-pytriton has no python backend stub for Python {PYTHON_VERSION}")
        return stub


def default_backends_dir(install: TritonInstall) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    key = hashlib.sha256(str(install.root).encode()).hexdigest()[:8]
    return cache / "kiln" / "triton" / f"backends-py{PYTHON_VERSION}-{key}"


def prepare_backends(install: TritonInstall, dest: Path | None = None) -> Path:
    """The python backend plus the stub for this Python, copied where Triton looks for it."""
    dest = Path(dest or default_backends_dir(install))
    python_dir = dest / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    backend = install.root / "backends" / "python"
    for src in (backend / "libtriton_python.so", backend / "triton_python_backend_utils.py", install.stub):
        _copy_if_changed(src, python_dir / src.name)
    return dest


def _copy_if_changed(src: Path, dst: Path) -> None:
    if dst.exists() and dst.stat().st_size == src.stat().st_size and dst.stat().st_mtime >= src.stat().st_mtime:
        return
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}")   # rename: a running server never sees half a file
    shutil.copy2(src, tmp)
    tmp.replace(dst)


def _env_prefixes(install: TritonInstall) -> dict[str, list[str]]:
    """PATH: this interpreter's bin first, so a stub without EXECUTION_ENV_PATH finds this venv.
    LD_LIBRARY_PATH: this interpreter's libpython, then the wheel's bundled libraries."""
    return {"PATH": [str(Path(sys.executable).parent)],
            "LD_LIBRARY_PATH": [sysconfig.get_config_var("LIBDIR"), str(install.libs)]}


def server_env(install: TritonInstall, base: dict | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    for name, prefix in _env_prefixes(install).items():
        env[name] = os.pathsep.join(filter(None, [*prefix, env.get(name)]))
    return env


def server_command(install: TritonInstall, repo: Path, backends: Path, ports: Ports = Ports(),
                   host: str = "127.0.0.1", exit_timeout: int = 5) -> list[str]:
    return [str(install.binary), f"--model-repository={Path(repo).resolve()}",
            f"--backend-directory={Path(backends).resolve()}",
            f"--http-address={host}", f"--http-port={ports.http}",
            f"--grpc-address={host}", f"--grpc-port={ports.grpc}",
            f"--metrics-address={host}", f"--metrics-port={ports.metrics}",
            # config.pbtxt is complete: skip a stub launch per model at load time
            "--disable-auto-complete-config",
            # CPU only: no GPU metrics and no pinned (CUDA host) memory pool
            "--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0",
            f"--exit-timeout-secs={exit_timeout}"]


def command_text(repo: Path, ports: Ports = Ports(), host: str = "127.0.0.1", backends: Path | None = None) -> str:
    """The launch as one shell line (prepares the backends folder it names)."""
    install = TritonInstall.find()
    backends = prepare_backends(install, backends)
    assigns = [f'{name}={shlex.quote(os.pathsep.join(prefix))}"${{{name}:+:${name}}}"'
               for name, prefix in _env_prefixes(install).items()]
    return " ".join(["env", *assigns, shlex.join(server_command(install, repo, backends, ports, host))])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("repository", type=Path, help="a folder rendered by kiln triton-repo")
    parser.add_argument("--host", default="127.0.0.1", help="address for all three endpoints")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--backend-dir", type=Path, default=None, help="where the python backend is prepared")
    parser.add_argument("--print-command", action="store_true", help="print the command instead of running it")
    args = parser.parse_args(argv)
    ports = Ports(args.http_port, args.grpc_port, args.metrics_port)
    if args.print_command:
        print(command_text(args.repository, ports, args.host, args.backend_dir))
        return
    install = TritonInstall.find()
    command = server_command(install, args.repository, prepare_backends(install, args.backend_dir), ports, args.host)
    os.execve(command[0], command, server_env(install))   # the server takes this process's place


if __name__ == "__main__":
    main()
