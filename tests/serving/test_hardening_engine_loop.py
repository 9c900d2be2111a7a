"""The engine loop cannot die silently behind the HTTP server (in-process app, the real tiny
engine, faults injected into the engine's execute()): a BaseException in a step, an error inside
the step-failure handler, and a step that never returns (the watchdog, --step-timeout). Each ends
the requests in flight with an error at once (an SSE error event, or a 500), frees their KV
blocks, and turns the server not-ready for good: /ready and /health answer 503 with the reason,
new requests get 503. And a request's timeout fires even while the loop is stuck."""

from __future__ import annotations

import json
import threading
import time

import pytest
from starlette.testclient import TestClient

from kiln import LLM, RuntimeConfig
from kiln.config import ResponseCacheConfig, ServeConfig
from kiln.serving.http.app import create_app
from waiting import wait_until

MODEL = "tiny"
BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True}


class Panic(BaseException):
    """What a native extension's panic looks like from Python (pyo3's PanicException)."""


def _serve(artifact, config: ServeConfig):
    llm = LLM(artifact, RuntimeConfig(kv_cache_memory=16 << 20, threads=1))
    client = TestClient(create_app(llm, config, MODEL), base_url="http://localhost")
    client.__enter__()
    wait_until(lambda: client.get("/ready").status_code == 200)
    return client, llm


@pytest.fixture
def serve(tiny_llama_artifact):
    """serve(config) -> (client, llm); `release` unblocks a stuck step before the app stops."""
    started, release = [], threading.Event()

    def start(config: ServeConfig):
        started.append(_serve(tiny_llama_artifact, config))
        return started[-1]
    yield start, release
    release.set()
    for client, _ in started:
        client.__exit__(None, None, None)


def _on_step(llm, action, after: int = 2) -> None:
    """From the `after`-th execute() on (counted from now), run `action` (raises or blocks) first."""
    engine, calls = llm.core.engine, [0]
    real = engine.execute

    def execute(batch):
        calls[0] += 1
        if calls[0] >= after:
            action()
        return real(batch)
    engine.execute = execute


def _in_thread(fn, timeout=20.0):
    """fn() on a thread, bounded: (result, seconds); the old code hangs here, so the test fails."""
    out, t0 = {}, time.monotonic()
    job = threading.Thread(target=lambda: out.update(result=fn()), daemon=True)
    job.start()
    job.join(timeout)
    assert "result" in out, f"no answer within {timeout} s"
    return out["result"], time.monotonic() - t0


def _stream(client) -> list[dict]:
    with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def _metric(client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _assert_not_ready(client, reason: str) -> None:
    for path in ("/ready", "/health"):
        r = client.get(path)
        assert r.status_code == 503, (path, r.status_code, r.text)
        assert r.json()["status"] == "faulted" and reason in r.json()["reason"]
    r = client.post("/v1/completions", json={**BODY, "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_fault"


def _engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kiln-engine")]


def test_a_base_exception_in_a_step_errors_the_stream_and_turns_the_server_not_ready(serve):
    start, _ = serve
    client, llm = start(ServeConfig(response_cache=ResponseCacheConfig(enabled=False)))

    def panic():
        raise Panic("native panic in the engine")
    _on_step(llm, panic)
    events, seconds = _in_thread(lambda: _stream(client))
    assert seconds < 10
    message = events[-1]["error"]["message"]        # an incident id; the panic's text stays in the log
    assert "incident" in message and "native panic" not in message
    _assert_not_ready(client, "native panic in the engine")
    wait_until(lambda: llm.client._thread is None and not _engine_threads())
    assert _metric(client, "kiln_kv_blocks_used") == 0
    assert _metric(client, "kiln_engine_failures_total") == 1


def test_an_error_inside_the_failure_handler_answers_500_and_turns_the_server_not_ready(serve):
    start, _ = serve
    client, llm = start(ServeConfig(response_cache=ResponseCacheConfig(enabled=False)))

    def fault():
        raise RuntimeError("injected engine fault")

    def abort(request_id):
        raise RuntimeError("abort failed in the clean-up")
    _on_step(llm, fault)
    llm.core.abort = abort
    response, seconds = _in_thread(lambda: client.post("/v1/completions", json=BODY))
    assert seconds < 10
    assert response.status_code == 500 and response.json()["error"]["code"] == "engine_error"
    _assert_not_ready(client, "abort failed in the clean-up")
    wait_until(lambda: llm.client._thread is None and not _engine_threads())
    del llm.core.abort                                # so that the app can stop cleanly


def test_the_watchdog_errors_a_stuck_step_and_turns_the_server_not_ready(serve):
    start, release = serve
    client, llm = start(ServeConfig(response_cache=ResponseCacheConfig(enabled=False), step_timeout=0.5))
    _on_step(llm, lambda: release.wait(60))
    events, seconds = _in_thread(lambda: _stream(client))
    assert seconds < 5, f"the stream waited {seconds:.1f} s"
    assert "incident" in events[-1]["error"]["message"]
    _assert_not_ready(client, "--step-timeout")     # the watchdog's reason is the operator's to read
    assert llm.client._thread.is_alive()              # still stuck in the step: nothing spins
    release.set()
    wait_until(lambda: llm.client._thread is None and not _engine_threads())
    assert _metric(client, "kiln_kv_blocks_used") == 0
    assert client.get("/ready").status_code == 503    # not restarted: the process is to be replaced


def test_a_request_timeout_fires_while_the_loop_is_stuck(serve):
    start, release = serve
    client, llm = start(ServeConfig(response_cache=ResponseCacheConfig(enabled=False), step_timeout=None,
                                    request_timeout=1.0))
    _on_step(llm, lambda: release.wait(60))
    response, seconds = _in_thread(lambda: client.post("/v1/completions", json=BODY))
    assert seconds < 6, f"the request took {seconds:.1f} s"
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] == "timeout"
    events, seconds = _in_thread(lambda: _stream(client))
    assert seconds < 6 and events[-1]["choices"][0]["finish_reason"] == "timeout"
    assert client.get("/ready").status_code == 200    # a slow engine is not a fault without the watchdog
    release.set()
    wait_until(lambda: llm.client._thread is None and _metric(client, "kiln_kv_blocks_used") == 0)
