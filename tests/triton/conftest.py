"""A real tritonserver on loopback serving a rendered kiln repository (helpers: triton_client.py).

Each server: free ports (bound to port 0 first), start-up bounded by polling readiness and failing
fast with the log if the process exits, SIGTERM then SIGKILL of its whole session on teardown.
"""

from __future__ import annotations

import pytest

from kiln.serving.triton.launch import Ports, TritonInstall
from kiln.serving.triton.repo import RepoOptions, render_repository
from kiln.serving.triton.server import TritonServer

from triton_client import MODEL


@pytest.fixture(scope="session")
def triton_install():
    try:
        return TritonInstall.find()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def serve(artifact, tmp_path_factory, **runtime):
    """Render a repository for the artifact and start a server on it (a context manager)."""
    root = tmp_path_factory.mktemp("triton")
    render_repository(artifact, root / "repo", RepoOptions(name=MODEL, runtime=runtime))
    return TritonServer(root / "repo", Ports.free(), root / "tritonserver.log", backends=root / "backends")


@pytest.fixture(scope="module")
def tiny_server(triton_install, tiny_llama_artifact, tmp_path_factory):
    with serve(tiny_llama_artifact, tmp_path_factory, kv_cache_memory="32MiB", threads=1) as server:
        yield server


@pytest.fixture(scope="module")
def smollm2_server(triton_install, smollm2_int8_artifact, tmp_path_factory):
    with serve(smollm2_int8_artifact, tmp_path_factory, kv_cache_memory="256MiB") as server:
        yield server
