"""Arrival processes and the client's bookkeeping against a fake target (no model)."""

from __future__ import annotations

import asyncio

import pytest

from kiln.bench.loadgen import Level, Limits, run_level
from kiln.bench.records import Chunk, Outcome
from kiln.bench.text import Prompt
from kiln.bench.workloads import request_specs


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
