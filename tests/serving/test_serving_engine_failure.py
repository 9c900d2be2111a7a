"""The engine failing mid-batch behind the HTTP server (in-process app, the real tiny engine): every
request in flight ends with an error (an SSE error event, or a 500), every KV block is free, the
metrics count the failure, and the next request is served as before."""

from __future__ import annotations

import json
import logging
import re
import threading

import pytest
from starlette.testclient import TestClient

from kiln import LLM, RuntimeConfig
from kiln.config import ResponseCacheConfig, ServeConfig
from kiln.serving.http.app import create_app
from waiting import wait_until

MODEL = "tiny"
BODY = {"model": MODEL, "max_tokens": 200, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def app_client(tiny_llama_artifact):
    llm = LLM(tiny_llama_artifact, RuntimeConfig(kv_cache_memory=16 << 20, threads=1))
    app = create_app(llm, ServeConfig(response_cache=ResponseCacheConfig(enabled=False)), MODEL)
    with TestClient(app, base_url="http://127.0.0.1") as client:   # a loopback Host (the default allow-list)
        wait_until(lambda: client.get("/ready").status_code == 200)
        yield client, llm


def _fail_when_running(llm, n: int) -> None:
    """The engine raises once, on the first step that runs n sequences."""
    engine, fired = llm.core.engine, threading.Event()
    real = engine.execute

    def execute(batch):
        if not fired.is_set() and llm.core.scheduler.num_running >= n:
            fired.set()
            raise RuntimeError("injected engine fault")
        return real(batch)
    engine.execute = execute


def _metrics(client) -> dict[str, float]:
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _stream(client, prompt: str) -> list[dict]:
    with client.stream("POST", "/v1/completions", json={**BODY, "prompt": prompt, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_engine_failure_ends_every_request_and_the_server_recovers(app_client, caplog):
    caplog.set_level(logging.ERROR, logger="kiln.serving")
    client, llm = app_client
    before = client.post("/v1/completions", json={**BODY, "prompt": "again", "max_tokens": 8}).json()
    _fail_when_running(llm, 3)
    results: dict[str, object] = {}
    jobs = [threading.Thread(target=lambda p=p: results.update({p: _stream(client, p)})) for p in ("aa", "bbb")]
    jobs.append(threading.Thread(target=lambda: results.update(
        whole=client.post("/v1/completions", json={**BODY, "prompt": "cccc"}))))
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(60)

    messages = []
    for prompt in ("aa", "bbb"):              # streamed: chunks, then an error event, no finish
        events = results[prompt]
        messages.append(events[-1]["error"]["message"])
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
    whole = results["whole"]
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "engine_error"
    messages.append(whole.json()["error"]["message"])
    # the client reads an incident id, never the engine's own text; the log has the text by that id
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for message in messages:
        assert "injected engine fault" not in message
        incident = re.search(r"incident ([0-9a-f]{12})", message).group(1)
        assert re.search(f"incident {incident}: .*injected engine fault", logged)
    wait_until(lambda: _metrics(client)["kiln_kv_blocks_used"] == 0)
    m = _metrics(client)
    assert m["kiln_engine_failures_total"] == 1 and m['kiln_requests_finished_total{finish_reason="error"}'] == 3
    assert m["kiln_requests_running"] == 0 and m["kiln_requests_waiting"] == 0
    after = client.post("/v1/completions", json={**BODY, "prompt": "again", "max_tokens": 8}).json()
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    assert client.get("/ready").status_code == 200
