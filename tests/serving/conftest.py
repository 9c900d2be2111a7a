"""The serving tests' servers: `kiln serve` for real (tests/kiln_server.py), started per test or per
module and stopped afterwards. Tests talk to them over HTTP only (the openai client, httpx)."""

from __future__ import annotations

import pytest

from kiln_server import ServerProcess
from serving_flags import TINY_FLAGS


def _servers(tmp_path_factory):
    """Yields start(artifact, *flags) -> a ready ServerProcess; stops them all afterwards."""
    started: list[ServerProcess] = []

    def start(artifact, *flags: str) -> ServerProcess:
        log = tmp_path_factory.mktemp("serve") / "server.log"
        server = ServerProcess(artifact, log, *flags)
        started.append(server)
        return server.wait_ready()

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def start_server(tmp_path_factory):
    """A server for one test, stopped when it ends."""
    yield from _servers(tmp_path_factory)


@pytest.fixture(scope="module")
def start_module_server(tmp_path_factory):
    """A server shared by a module's tests, stopped when the module ends."""
    yield from _servers(tmp_path_factory)


@pytest.fixture(scope="module")
def tiny_server(start_module_server, tiny_llama_artifact):
    return start_module_server(tiny_llama_artifact, *TINY_FLAGS)
