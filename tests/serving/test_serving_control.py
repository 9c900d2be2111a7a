"""Admission control, timeouts, cancellation, the response cache and metrics, on the tiny model."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from kiln.serving import engine_metrics as em

from serving_flags import TINY_FLAGS

MODEL = "tiny-llama-none"
LONG = {"model": MODEL, "prompt": "a long one", "max_tokens": 900, "temperature": 0.8, "ignore_eos": True}


def _wait_for(predicate, timeout: float = 10.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    return predicate()


def _kv_free(server) -> bool:
    m = server.metrics()
    return m["kiln_kv_blocks_used"] == 0 and m["kiln_requests_running"] == 0 and m["kiln_requests_waiting"] == 0


# -- api key -------------------------------------------------------------------------------------

def test_api_key(start_server, tiny_llama_artifact):
    server = start_server(tiny_llama_artifact, *TINY_FLAGS, "--api-key", "sesame")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sesame", max_retries=0)
    assert good.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200       # probes stay open
    assert httpx.get(f"{server.url}/metrics").status_code == 401      # the rest needs the key
    assert httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer sesame"}).status_code == 200
    # SIGTERM: a graceful exit (uvicorn re-raises the signal once it has shut down)
    assert server.stop() in (0, -15)
    assert "stopped: the engine has shut down" in server.log() and "Traceback" not in server.log()


# -- admission control -----------------------------------------------------------------------------

async def _concurrent(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(client.post(f"{url}/v1/completions", json=b) for b in bodies))


@pytest.fixture(scope="module")
def one_seat_server(start_module_server, tiny_llama_artifact):
    """One running sequence at a time, one request waiting for its first token at most. No TTFT
    objective: it would refuse a request behind a 900-token reply at once (the seat wait)."""
    return start_module_server(tiny_llama_artifact, *TINY_FLAGS, "--max-waiting", "1", "--max-num-seqs", "1",
                               "--ttft-slo", "0")


def test_max_waiting_refuses_with_429(one_seat_server):
    server = one_seat_server
    bodies = [{**LONG, "max_tokens": 200, "prompt": "p" * (100 + i)} for i in range(8)]
    responses = asyncio.run(_concurrent(server.url, bodies))
    statuses = [r.status_code for r in responses]
    assert statuses.count(200) >= 1 and statuses.count(429) >= 1, statuses
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["type"] == "rate_limit_error"
    admitted = [r.json() for r in responses if r.status_code == 200]
    assert all(a["usage"]["completion_tokens"] == 200 for a in admitted)    # admitted ones complete
    m = server.metrics()
    assert m['kiln_requests_rejected_total{reason="max_waiting"}'] == statuses.count(429)


def test_ttft_slo_and_token_bound_refuse(start_server, tiny_llama_artifact):
    # --ttft-refuse-factor 1: refused at the objective itself (by default only past 5 x it)
    server = start_server(tiny_llama_artifact, *TINY_FLAGS, "--ttft-slo", "0.02", "--ttft-refuse-factor", "1",
                          "--max-waiting-tokens", "600")
    # The tiny model prefills ~3,000 tokens/s here (measured at warm-up): 500 tokens predict ~0.17 s
    # and are refused however idle the server is, 10 tokens (~3 ms) are not. Safe for rates 500-25,000.
    assert 500 < server.metrics()["kiln_prefill_tokens_per_second"] < 25_000
    r = httpx.post(f"{server.url}/v1/completions", json={**LONG, "prompt": "x" * 700, "max_tokens": 2})
    assert r.status_code == 429 and r.json()["error"]["code"] == "max_waiting_tokens"
    r = httpx.post(f"{server.url}/v1/completions", json={**LONG, "prompt": "x" * 500, "max_tokens": 2})
    assert r.status_code == 429 and r.json()["error"]["code"] == "ttft_slo"
    assert httpx.post(f"{server.url}/v1/completions", json={**LONG, "max_tokens": 2}).status_code == 200


# -- timeout -----------------------------------------------------------------------------------------

def test_request_timeout_finishes_with_timeout(start_server, tiny_llama_artifact):
    server = start_server(tiny_llama_artifact, *TINY_FLAGS, "--request-timeout", "0.1")
    t0 = time.monotonic()
    out = httpx.post(f"{server.url}/v1/completions", json={**LONG, "prompt": "x" * 100}, timeout=30).json()
    assert out["choices"][0]["finish_reason"] == "timeout"
    assert out["usage"]["completion_tokens"] < 900 and time.monotonic() - t0 < 5
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}, timeout=30) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "timeout"
    assert _wait_for(lambda: _kv_free(server))
    assert server.metrics()['kiln_requests_finished_total{finish_reason="timeout"}'] == 2


# -- cancellation --------------------------------------------------------------------------------

def test_disconnect_mid_stream_frees_blocks(tiny_server):
    before = tiny_server.metrics().get("kiln_requests_aborted_total", 0)
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", timeout=30,
                      json={**LONG, "prompt": "z" * 100, "stream": True}) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert tiny_server.metrics()["kiln_kv_blocks_used"] > 0        # it holds blocks while streaming
    # The connection is closed: within one engine step the request is aborted and its blocks free.
    assert _wait_for(lambda: _kv_free(tiny_server), timeout=5)
    assert tiny_server.metrics()["kiln_requests_aborted_total"] == before + 1


def test_disconnect_before_first_token_aborts(one_seat_server):
    """A request still queued behind another (no token yet) is aborted when its client leaves."""
    server = one_seat_server
    before = server.metrics()
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                      json={**LONG, "prompt": "first", "stream": True}) as first:
        lines = first.iter_lines()
        while not next(lines).startswith("data: {"):       # it holds the only seat now
            pass
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json={**LONG, "prompt": "second"},
                       timeout=httpx.Timeout(5, read=0.1))
        aborted = lambda: server.metrics()["kiln_requests_aborted_total"] == before["kiln_requests_aborted_total"] + 1  # noqa: E731
        assert _wait_for(aborted, timeout=5)
    assert _wait_for(lambda: _kv_free(server), timeout=5)
    landed = sum(v for k, v in before.items() if k.startswith("kiln_requests_finished_total")) + 2
    assert _wait_for(lambda: _engine_requests(server) == landed, timeout=5)
    ttft = "kiln_time_to_first_token_seconds_count"
    assert server.metrics()[ttft] == before[ttft] + 1       # only the first ever got a token


# -- response cache --------------------------------------------------------------------------------

def _hits(server) -> float:
    m = server.metrics()
    return sum(v for k, v in m.items() if k.startswith("kiln_response_cache_hits_total"))


def _engine_requests(server) -> float:
    m = server.metrics()
    return sum(v for k, v in m.items() if k.startswith("kiln_requests_finished_total"))


def test_response_cache_hit(tiny_server):
    body = {"model": MODEL, "prompt": "cache me", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    hits, engine = _hits(tiny_server), _engine_requests(tiny_server)
    first = httpx.post(f"{tiny_server.url}/v1/completions", json=body).json()
    second = httpx.post(f"{tiny_server.url}/v1/completions", json=body).json()
    assert second["choices"][0]["text"] == first["choices"][0]["text"]      # exact: a replay of the first
    assert second["usage"] == first["usage"] and second["id"] != first["id"]
    assert _hits(tiny_server) == hits + 1 and _engine_requests(tiny_server) == engine + 1
    # A seeded sampled request is deterministic too; a different seed is another entry.
    seeded = {**body, "temperature": 0.9, "seed": 7}
    a = httpx.post(f"{tiny_server.url}/v1/completions", json=seeded).json()["choices"][0]["text"]
    b = httpx.post(f"{tiny_server.url}/v1/completions", json=seeded).json()["choices"][0]["text"]
    httpx.post(f"{tiny_server.url}/v1/completions", json={**seeded, "seed": 8})
    assert a == b and _hits(tiny_server) == hits + 2


async def _mixed_identical(url: str, body: dict, n: int) -> list[str]:
    async def whole(client):
        r = await client.post(f"{url}/v1/completions", json=body)
        return r.json()["choices"][0]["text"]

    async def streamed(client):
        parts = []
        async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    parts.append(json.loads(line[6:])["choices"][0]["text"])
        return "".join(parts)

    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*((whole if i % 2 else streamed)(client) for i in range(n)))


def test_single_flight(tiny_server):
    body = {"model": MODEL, "prompt": "together", "max_tokens": 600, "temperature": 0, "ignore_eos": True}
    hits, engine = _hits(tiny_server), _engine_requests(tiny_server)
    texts = asyncio.run(_mixed_identical(tiny_server.url, body, 6))
    assert len(set(texts)) == 1 and len(texts[0]) > 0           # exact: one computation, shared
    assert _engine_requests(tiny_server) == engine + 1          # computed once ...
    assert _hits(tiny_server) == hits + 5                       # ... five answered from it
    assert tiny_server.metrics().get('kiln_response_cache_hits_total{kind="in_flight"}', 0) >= 1


def test_no_response_cache(start_server, tiny_llama_artifact):
    server = start_server(tiny_llama_artifact, *TINY_FLAGS, "--no-response-cache")
    body = {"model": MODEL, "prompt": "again", "max_tokens": 8, "temperature": 0}
    engine = _engine_requests(server)                           # the warm-up's
    texts = [httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(2)]
    # exact: greedy, computed twice the same way (a lone 5-token prompt: no cached block to hit)
    assert texts[0] == texts[1]
    assert _hits(server) == 0 and _engine_requests(server) == engine + 2


# -- metrics ---------------------------------------------------------------------------------------

def test_metrics_move(tiny_server):
    before = tiny_server.metrics()
    body = {"model": MODEL, "prompt": "metrics", "max_tokens": 10, "temperature": 1.0, "ignore_eos": True}
    httpx.post(f"{tiny_server.url}/v1/completions", json=body)
    after = tiny_server.metrics()
    for name in ("kiln_time_to_first_token_seconds_count", "kiln_e2e_request_latency_seconds_count",
                 "kiln_request_queue_time_seconds_count", "kiln_request_prefill_time_seconds_count",
                 "kiln_request_decode_time_seconds_count"):
        assert after[name] == before.get(name, 0) + 1, name
    assert after["kiln_inter_token_latency_seconds_count"] == before.get("kiln_inter_token_latency_seconds_count", 0) + 9
    assert after["kiln_generation_tokens_total"] == before.get("kiln_generation_tokens_total", 0) + 10
    assert after["kiln_prompt_tokens_total"] == before.get("kiln_prompt_tokens_total", 0) + len("metrics")
    assert after["kiln_batch_size_count"] > before["kiln_batch_size_count"]
    assert after["kiln_prefix_cache_queries_total"] > before["kiln_prefix_cache_queries_total"]
    assert after["kiln_kv_blocks_total"] > 0 and after["kiln_kv_bytes_total"] > 0
    for name in ("kiln_preemptions_total", "kiln_kv_evictions_total", "kiln_kv_allocation_failures_total",
                 "kiln_prefix_cache_hits_total", "kiln_kv_bytes_used", "kiln_requests_aborted_total",
                 "kiln_requests_in_progress", "kiln_response_cache_entries", "kiln_admission_waiting_tokens"):
        assert name in after
    # The engine's metrics carry the names Triton's metrics port uses (tests/triton_backend checks those).
    names = [m.name for m in (*em.GAUGES, *em.COUNTERS)] + [f"{em.BATCH_SIZE.name}_count"]
    assert not [name for name in names if name not in after]
    assert any(k.startswith(em.FINISHED.name + "{") for k in after)
