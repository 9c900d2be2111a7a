"""`kiln serve` for the load generator to hit (tests/kiln_server.py), started once per module."""

from __future__ import annotations

import pytest
from kiln_server import ServerProcess

TINY_RUNTIME = ("--kv-cache-memory", "16MiB", "--threads", "1")


@pytest.fixture(scope="module")
def tiny_serve_url(tiny_llama_artifact, tmp_path_factory):
    server = ServerProcess(tiny_llama_artifact, tmp_path_factory.mktemp("serve") / "serve.log", *TINY_RUNTIME)
    try:
        yield server.wait_ready().url
    finally:
        server.stop()
