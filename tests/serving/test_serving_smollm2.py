"""kiln serve on the real SmolLM2 (int4): the openai client's chat, and a bounded load test."""

from __future__ import annotations

import random
import time

import openai
import pytest

from kiln.bench.loadgen import Level, LevelRun, Limits, RetryAfter, run_load
from kiln.bench.records import Outcome, RequestRecord
from kiln.bench.target_http import HttpTarget
from kiln.bench.text import Prompt
from kiln.bench.workloads import Workload, request_specs

pytestmark = pytest.mark.slow

LOAD_CLIENTS, LOAD_SECONDS, WARM_SECONDS = 32, 20.0, 5.0
HANG_UP_SHARE = 0.25        # of requests: the client disconnects after a few chunks (some before the first token)
BACK_OFF = RetryAfter(cap=2.0)      # a polite client: back off as Retry-After says (capped)
TOPICS = ["the sea", "a small robot", "bread", "mountains", "a lost key", "the moon", "rain", "chess"]


@pytest.fixture(scope="module")
def smol_server(start_module_server, smollm2_int4_artifact):
    # Admission bounds: under the load test some requests are refused (429) rather than queued.
    return start_module_server(smollm2_int4_artifact, "--kv-cache-memory", "256MiB", "--max-waiting", "24",
                        "--ttft-slo", "10", "--served-model-name", "smollm2")


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_answers(client, smol_server):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = client.chat.completions.create(model="smollm2", messages=question, max_tokens=30, temperature=0)
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"
    hits = sum(v for k, v in smol_server.metrics().items() if k.startswith("kiln_response_cache_hits_total"))
    stream = client.chat.completions.create(model="smollm2", messages=question, max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # exact: the same prompt and params, answered from the response cache (a replay, not a recomputation,
    # which would hit the prefix cache and compute with other shapes)
    assert sum(v for k, v in smol_server.metrics().items() if k.startswith("kiln_response_cache_hits_total")) == hits + 1
    assert text == out.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def _topical(rng: random.Random, ctx: int, seed: int) -> dict:
    return dict(prompt_tokens=0, max_tokens=rng.randint(8, 32),          # the prompt: _topic_prompt
                cancel_after=rng.randint(0, 3) if rng.random() < HANG_UP_SHARE else None)


TOPICAL = Workload("topical", "short to long prompts about a topic; a share of clients hang up", _topical)


def _topic_prompt(spec) -> Prompt:
    rng = random.Random(spec.text_offset)
    topic, size = rng.choice(TOPICS), rng.choice(["short", "short", "medium", "long"])
    if size == "short":
        return Prompt(None, f"Write one sentence about {topic}.")
    filler = " ".join(f"Fact {i}: {topic} is interesting because of reason number {i}." for i in range(
        4 if size == "medium" else 12))
    return Prompt(None, f"{filler}\nSummarise the facts above about {topic} in one sentence.")


def _run_topical(url: str, clients: int, seconds: float) -> LevelRun:
    """Streaming httpx clients (raw SSE) looping until the deadline; replies may stop at EOS."""
    target = (lambda: HttpTarget(url, model="smollm2", temperature=0.8, ignore_eos=False))
    return run_load(target, request_specs(TOPICAL, 0, 2048), _topic_prompt, Level(concurrency=clients),
                    Limits(duration=seconds, timeout=120.0), BACK_OFF)


def _completed(run: LevelRun) -> list[RequestRecord]:
    return [r for r in run.records if r.status == 200 and not r.cancelled]


def test_load(smol_server):
    # The RSS baseline is taken after a first, shorter run of the same load: ONNX Runtime's arenas
    # grow to the largest bucket shapes seen and keep that memory (measured with the engine
    # alone, no server: 0.4 -> 1.7 GiB over six mixed batches). That is not a leak; growth
    # beyond it would be.
    warm = _run_topical(smol_server.url, LOAD_CLIENTS, WARM_SECONDS)
    print(f"\nwarm-up: {warm.summary()}")
    rss_before = smol_server.rss_bytes()
    report = _run_topical(smol_server.url, LOAD_CLIENTS, LOAD_SECONDS)
    print(f"load: {report.summary()}")

    assert not [s for s in report.statuses if s >= 500], report.statuses
    assert set(report.statuses) <= {200, 429}, report.statuses
    done = _completed(report)
    assert len(done) >= 8
    for o in done:
        assert o.outcome is Outcome.OK and o.error is None, o       # ran to data: [DONE], no error event
        assert o.finish_reason in ("stop", "length"), o
        assert o.completion_tokens is not None and 1 <= o.completion_tokens <= o.max_tokens, o
        assert o.finish_reason != "length" or o.completion_tokens == o.max_tokens, o
    assert sum(o.cancelled for o in report.records) > 0

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = smol_server.metrics()
        if m["kiln_kv_blocks_used"] == m["kiln_requests_running"] == m["kiln_requests_waiting"] == 0:
            break
        time.sleep(0.2)
    assert m["kiln_kv_blocks_used"] == 0 and m["kiln_admission_waiting_requests"] == 0, m
    assert m["kiln_requests_in_progress"] == 0, m          # the server's own books are empty too
    assert m["kiln_requests_aborted_total"] >= sum(o.cancelled for o in report.records) * 0.9

    rss_after = smol_server.rss_bytes()
    print(f"RSS before {rss_before / 2**20:.0f} MiB, after {rss_after / 2**20:.0f} MiB")
    # Generous: the arena may still meet a new largest shape (a 30-sequence prefill peaks near 1.6
    # GiB with or without an arena). A per-request leak over hundreds of requests would exceed it.
    assert rss_after < max(2 * rss_before, rss_before + (768 << 20))
