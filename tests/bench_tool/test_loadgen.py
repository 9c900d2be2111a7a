"""Arrival processes and the client's bookkeeping against a fake target (no model), then the shared
load generator over HTTP (raw httpx SSE and the openai client) against a tiny in-process server:
hang-ups close the server's streams, give-ups abandon whole replies, 429s are waited out."""

from __future__ import annotations

import asyncio
import time

import pytest
from fake_openai_server import FakeOpenAI, Running

from kiln.bench.loadgen import POLITE, Level, Limits, RetryAfter, run_level, run_load
from kiln.bench.records import Chunk, Outcome, RequestRecord
from kiln.bench.target_http import HttpTarget
from kiln.bench.target_openai import OpenAITarget
from kiln.bench.text import Prompt
from kiln.bench.workloads import Workload, request_specs


class FakeTarget:
    """Streams one chunk per token every `gap` seconds; records how many requests are in flight."""

    name = "fake"

    def __init__(self, gap=0.001, fail_every=0, hang=False):
        self.gap, self.fail_every, self.hang = gap, fail_every, hang
        self.in_flight = self.peak = self.closed = self.calls = 0

    async def stream(self, prompt, spec):
        self.calls += 1
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if self.fail_every and spec.index % self.fail_every == 0:
                raise RuntimeError("HTTP 503")
            if self.hang:
                await asyncio.sleep(3600)
            for _ in range(spec.max_tokens):
                await asyncio.sleep(self.gap)
                yield Chunk(text="x", num_tokens=1)
            yield Chunk(usage_tokens=spec.max_tokens)
        finally:
            self.in_flight -= 1
            self.closed += 1


def run(target, level, workload="chat", **limits):
    specs = request_specs(workload, 0, 2048, max_tokens_cap=4)
    lim = Limits(**{"duration": 0.3, "timeout": 5.0, **limits})
    return asyncio.run(run_level(target, specs, lambda s: Prompt(None, "hi"), level, lim, seed=0))


def test_closed_loop_keeps_the_concurrency_and_the_request_cap():
    target = FakeTarget()
    result = run(target, Level(concurrency=3), max_requests=12, duration=30.0)
    assert len(result.records) == 12 == target.calls
    assert target.peak == 3 and target.in_flight == 0
    assert [r.index for r in result.records] == list(range(12))
    assert all(r.outcome is Outcome.OK and r.ttft is not None for r in result.records)
    assert all(r.output_tokens <= 4 and len(r.chunk_times) == r.output_tokens for r in result.records)


def test_closed_loop_stops_issuing_at_the_duration():
    result = run(FakeTarget(gap=0.01), Level(concurrency=2), duration=0.3)
    assert 2 <= len(result.records) < 60
    assert max(r.start for r in result.records) < 0.3 <= result.wall_s


def test_open_loop_follows_the_seeded_arrivals():
    result = run(FakeTarget(), Level(rate=50.0), duration=0.5)
    again = run(FakeTarget(), Level(rate=50.0), duration=0.5)
    assert 10 < len(result.records) == len(again.records) < 50


def test_failures_and_timeouts_are_outcomes():
    result = run(FakeTarget(fail_every=2), Level(concurrency=1), max_requests=4, duration=30.0)
    assert [r.outcome for r in result.records] == [Outcome.ERROR, Outcome.OK] * 2
    assert result.records[0].error == "RuntimeError: HTTP 503"
    hung = FakeTarget(hang=True)
    result = run(hung, Level(concurrency=2), max_requests=2, timeout=0.2, duration=30.0)
    assert [r.outcome for r in result.records] == [Outcome.TIMEOUT] * 2
    assert hung.closed == 2                        # the streams were closed, so the requests abort


def test_cancelling_clients_close_their_stream_after_k_chunks():
    target = FakeTarget()
    records = run(target, Level(concurrency=1), workload="cancel", max_requests=40, duration=30.0).records
    cancelled = [r for r in records if r.outcome is Outcome.CANCELLED]
    assert cancelled and target.closed == 40 and target.in_flight == 0
    assert all(len(r.chunk_times) <= 8 and r.e2e is None for r in cancelled)


@pytest.mark.parametrize("bad", [dict(), dict(concurrency=1, rate=1.0), dict(concurrency=0)])
def test_a_level_is_a_positive_concurrency_or_rate(bad):
    with pytest.raises(ValueError):
        Level(**bad)


# -- over HTTP, against an in-process server ---------------------------------------------------------

SENDERS = {"httpx": lambda url: HttpTarget(url, model="fake"), "openai": lambda url: OpenAITarget(url, "fake")}


@pytest.fixture
def serve():
    running: list[Running] = []

    def start(**kw) -> FakeOpenAI:
        running.append(Running(FakeOpenAI(**kw)))
        return running[-1]
    yield start
    for server in running:
        server.stop()


def alike(**fields):
    """Requests that are all the same: 8 reply tokens unless `fields` say otherwise."""
    w = Workload("alike", "every request the same", lambda rng, ctx, seed: {"prompt_tokens": 4, "max_tokens": 8,
                                                                              **fields})
    return request_specs(w, 0, 1024)


def drive(server, sender, specs, clients, requests, backoff=RetryAfter(cap=0.0)):
    return run_load(lambda: SENDERS[sender](server.url), specs, lambda spec: Prompt(None, "hi"),
                    Level(concurrency=clients), Limits(duration=30.0, timeout=10.0, max_requests=requests), backoff)


def eventually(check, within=5.0) -> bool:
    deadline = time.monotonic() + within
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    return check()


@pytest.mark.parametrize("sender", SENDERS)
def test_a_stream_is_recorded_as_the_server_sent_it(serve, sender):
    server = serve()
    for r in drive(server, sender, alike(), clients=2, requests=4).records:
        assert (r.outcome, r.status, r.finish_reason, r.completion_tokens, r.output_tokens, r.max_tokens) == (
            Outcome.OK, 200, "length", 8, 8, 8), r
        assert r.text == "".join(f"w{i} " for i in range(8)) and len(r.chunk_times) == 8 and r.ttft > 0
    assert server.fake.finished == 4 and server.fake.hung_up == 0


@pytest.mark.parametrize("sender", SENDERS)
@pytest.mark.parametrize("after", [0, 3])
def test_hang_ups_close_the_stream_on_the_server(serve, sender, after):
    server = serve()
    run = drive(server, sender, alike(max_tokens=50, cancel_after=after), clients=2, requests=4)
    assert all(r.cancelled and r.status == 200 and len(r.chunk_times) == after for r in run.records), run.records
    assert eventually(lambda: server.fake.hung_up == 4), server.fake.hung_up
    assert server.fake.finished == 0


@pytest.mark.parametrize("sender", SENDERS)
def test_429s_are_recorded_and_waited_out(serve, sender):
    server = serve(refuse_every=2, retry_after="1")
    run = drive(server, sender, alike(), clients=1, requests=4, backoff=RetryAfter(cap=0.5))
    assert [r.status for r in run.records] == [200, 429, 200, 429] and run.statuses[429] == 2
    refused = run.records[1]
    assert refused.outcome is Outcome.ERROR and refused.retry_after == 1.0 and "HTTP 429" in refused.error
    after_reply, after_refusal = (run.records[i + 1].start - run.records[i].end for i in (0, 1))
    assert after_refusal >= 0.5 > after_reply          # Retry-After 1 s, capped at 0.5 s; none after a reply
    assert "429 answered in" in run.summary()


@pytest.mark.parametrize("sender", SENDERS)
def test_a_client_that_gives_up_abandons_a_whole_reply(serve, sender):
    server = serve(whole_delay=0.5)
    gave_up = drive(server, sender, alike(stream=False, give_up_after=0.05), clients=2, requests=2).records
    assert all(r.cancelled and r.status == 0 and r.end - r.start < 0.4 for r in gave_up), gave_up
    (whole,) = drive(server, sender, alike(stream=False, endpoint="completions"), clients=1, requests=1).records
    assert (whole.outcome, whole.status, whole.finish_reason, whole.completion_tokens) == (Outcome.OK, 200, "length", 8)
    assert whole.ttft is None and whole.chunk_times == [] and whole.text.startswith("w0 w1 ")


def test_retry_after_is_honoured_within_its_floor_and_cap():
    refusal = (lambda seconds: RequestRecord(0, 1, 0.0, status=429, retry_after=seconds))
    assert RetryAfter(cap=2.0)(refusal(1.5)) == 1.5 and RetryAfter(cap=2.0)(refusal(30.0)) == 2.0
    assert RetryAfter(cap=2.0, default=0.7)(refusal(None)) == 0.7
    assert POLITE(refusal(0.0)) == POLITE(refusal(5.0)) == 1.0         # kiln bench: 1 s, whatever it says
    assert RetryAfter(cap=2.0)(RequestRecord(0, 1, 0.0, status=200)) == 0.0


def test_the_http_target_calibrates_on_a_server_that_refuses_stream_options_without_a_stream(serve):
    """vLLM answers 400 to stream_options in a request that does not stream (the calibration's)."""
    target = HttpTarget(serve().url, model="fake")
    target.context_len = 1024                        # what discover() reads from /v1/models

    async def calibrate():
        try:
            return await target.calibrate()
        finally:
            await target.close()
    assert asyncio.run(calibrate()).chars_per_token > 0
