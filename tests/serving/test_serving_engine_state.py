"""The engine core has one owner, the engine client's thread: the HTTP server, Triton's backend and
the bench observer learn about the engine only from the client's snapshot. Checked twice: in the
source (no front end reads an engine-core attribute), and at run time (a served app, the real tiny
engine, whose core notes every read from another thread)."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest
from starlette.testclient import TestClient

import kiln
from kiln import LLM, RuntimeConfig
from kiln.config import ResponseCacheConfig, ServeConfig
from kiln.serving.http.app import create_app
from waiting import wait_until

PACKAGE = Path(kiln.__file__).parent
# The engine core, and what it owns: a front end that names one of these reads the engine's state.
CORE_ATTRIBUTES = {"core", "scheduler", "kv", "runner", "speculator"}
MODEL = "tiny"
ENGINE_THREAD = "kiln-engine"


def front_ends() -> list[Path]:
    return sorted((PACKAGE / "serving").rglob("*.py")) + [PACKAGE / "bench" / "observe.py"]


def core_reads(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: .{node.attr}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in CORE_ATTRIBUTES]


def test_front_ends_never_read_the_engine_core():
    paths = front_ends()
    assert len(paths) > 10 and (PACKAGE / "serving" / "triton" / "backend.py") in paths
    reads = [read for path in paths for read in core_reads(path)]
    assert not reads, "front ends read the engine core (use the engine client's snapshot):\n" + "\n".join(reads)


class CoreGuard:
    """The engine core, passed through, noting every attribute read from a thread other than the
    engine client's once armed."""

    def __init__(self, core):
        object.__setattr__(self, "_core", core)
        object.__setattr__(self, "strangers", [])
        object.__setattr__(self, "threads", set())      # every thread that read it
        object.__setattr__(self, "armed", False)

    def __getattr__(self, name):
        thread = threading.current_thread().name
        self.threads.add(thread)
        if self.armed and thread != ENGINE_THREAD:
            self.strangers.append((thread, name))
        return getattr(self._core, name)

    def __setattr__(self, name, value):
        setattr(self._core, name, value)


@pytest.fixture
def served(tiny_llama_artifact):
    llm = LLM(tiny_llama_artifact, RuntimeConfig(kv_cache_memory=16 << 20, threads=1))
    guard = llm.core = CoreGuard(llm.core)
    # the client's first snapshot
    app = create_app(llm, ServeConfig(response_cache=ResponseCacheConfig(enabled=False)), MODEL)
    with TestClient(app, base_url="http://127.0.0.1") as client:   # a loopback Host (the default allow-list)
        wait_until(lambda: client.get("/ready").status_code == 200)
        object.__setattr__(guard, "armed", True)
        yield client, app.state.server, guard._core, guard
        object.__setattr__(guard, "armed", False)    # shutdown drains on the caller's thread


def _metrics(client) -> dict[str, float]:
    lines = client.get("/metrics").text.splitlines()
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in lines
                                                   if line and not line.startswith("#"))}


def test_serving_reads_the_engine_through_the_snapshot_only(served):
    client, server, core, guard = served
    prompt = list(range(1, 81))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    first = client.post("/v1/completions", json=body).json()
    wait_until(lambda: server.client.snapshot.num_running == 0 and server.client.snapshot.num_waiting == 0)
    # Admission's prefix probe reads the snapshot's view, and agrees with the pool itself.
    cached = server.generations.admission.cached_prefix(prompt)
    assert cached > 0 and cached == core.kv.cached_prefix_tokens(prompt)
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and list(r.iter_lines())
    m = _metrics(client)
    snapshot = server.client.snapshot
    assert m["kiln_kv_blocks_total"] == snapshot.kv_blocks_total == core.kv.num_blocks
    assert m["kiln_kv_blocks_used"] == snapshot.kv_blocks_used == 0
    assert m["kiln_prefix_cache_hits_total"] == snapshot.prefix_cache_hits == core.kv.prefix_hits > 0
    model = client.get("/v1/models").json()["data"][0]
    assert model["max_model_len"] == snapshot.max_model_len == core.scheduler.config.max_model_len
    assert client.get("/console/api/card").json()["kv"]["blocks"] == core.plan.num_blocks
    assert first["choices"][0]["text"] and client.get("/health").status_code == 200
    assert ENGINE_THREAD in guard.threads                # the guard is the core the client steps
    assert guard.strangers == [], "the engine core was read off the engine thread"
