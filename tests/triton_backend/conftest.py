"""A real tritonserver on loopback serving a rendered kiln repository (helpers: triton_client.py).

Each server: free ports (bound to port 0 first), start-up bounded by polling readiness and failing
fast with the log if the process exits, SIGTERM then SIGKILL of its whole session on teardown.
"""

from __future__ import annotations

import pytest

from kiln.serving.triton.launch import Ports, TritonInstall
from kiln.serving.triton.repo import RepoOptions, render_repository

from triton_client import MODEL, QUEUE_OF_ONE, Stream
from triton_server import TritonServer


@pytest.fixture(scope="session")
def triton_install():
    try:
        return TritonInstall.find()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def serve(artifact, tmp_path_factory, *models: RepoOptions) -> TritonServer:
    """Render a repository with the artifact's models and start a server on it (a context manager)."""
    root = tmp_path_factory.mktemp("triton")
    for options in models:
        render_repository(artifact, root / "repo", options)
    return TritonServer(root / "repo", Ports.free(), root / "tritonserver.log", backends=root / "backends")


@pytest.fixture(scope="module")
def tiny_server(triton_install, tiny_llama_artifact, tmp_path_factory):
    """The model under test, plus one that runs a single sequence and queues at most one more."""
    runtime = dict(kv_cache_memory="32MiB", threads=1)
    models = (RepoOptions(name=MODEL, runtime=runtime),
              RepoOptions(name=QUEUE_OF_ONE, max_queue=1, runtime={**runtime, "max_num_seqs": 1}))
    with serve(tiny_llama_artifact, tmp_path_factory, *models) as server:
        yield server


@pytest.fixture(scope="module")
def smollm2_server(triton_install, smollm2_int4_artifact, tmp_path_factory):
    options = RepoOptions(name=MODEL, runtime=dict(kv_cache_memory="256MiB"))
    with serve(smollm2_int4_artifact, tmp_path_factory, options) as server:
        yield server


@pytest.fixture
def open_stream():
    """Opens gRPC streams to a server; any still open at teardown are cancelled and closed, so
    a failed test cannot hold the server's shutdown (it waits for open streams)."""
    opened = []

    def open_(server) -> Stream:
        opened.append(Stream(server.grpc_url))
        return opened[-1]

    yield open_
    for stream in opened:
        stream.close(cancel=True)
