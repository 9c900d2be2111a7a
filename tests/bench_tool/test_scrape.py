"""The /metrics parser on sample Prometheus text, histogram deltas, and the TTFT cross-check."""

from __future__ import annotations

import asyncio
import math

import pytest

from kiln.bench.observe import MetricsObserver, ServerView, ttft_disagreement
from kiln.bench.scrape import BATCH_SIZE, RUNNING, TTFT, WAITING, parse_metrics


def sample(waiting=3, running=5, batch=(2, 6, 7, 7), batch_sum=40.0, ttft_count=4, ttft_sum=0.8) -> str:
    b1, b4, b8, binf = batch
    return f"""\
# HELP kiln_requests_waiting Requests in the engine's waiting queue.
# TYPE kiln_requests_waiting gauge
kiln_requests_waiting {waiting}
# HELP kiln_requests_running Requests in the running batch.
# TYPE kiln_requests_running gauge
kiln_requests_running {running}
# HELP kiln_requests_finished Engine requests by finish reason.
# TYPE kiln_requests_finished counter
kiln_requests_finished_total{{finish_reason="length"}} 10.0
kiln_requests_finished_total{{finish_reason="abort"}} 2.0
# HELP kiln_prompt_tokens Prompt tokens of engine requests.
# TYPE kiln_prompt_tokens counter
kiln_prompt_tokens_total 1234.0
# HELP kiln_batch_size Requests per engine step.
# TYPE kiln_batch_size histogram
kiln_batch_size_bucket{{le="1.0"}} {b1}
kiln_batch_size_bucket{{le="4.0"}} {b4}
kiln_batch_size_bucket{{le="8.0"}} {b8}
kiln_batch_size_bucket{{le="+Inf"}} {binf}
kiln_batch_size_count {binf}
kiln_batch_size_sum {batch_sum}
# HELP kiln_time_to_first_token_seconds Arrival to first token.
# TYPE kiln_time_to_first_token_seconds histogram
kiln_time_to_first_token_seconds_bucket{{le="0.1"}} 1
kiln_time_to_first_token_seconds_bucket{{le="+Inf"}} {ttft_count}
kiln_time_to_first_token_seconds_count {ttft_count}
kiln_time_to_first_token_seconds_sum {ttft_sum}
# HELP vllm:num_requests_swapped Some other server's gauge.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{{model_name="m"}} 1.0
"""


def test_parse_gauges_counters_and_histograms():
    snap = parse_metrics(sample())
    assert snap.value(WAITING) == 3 and snap.value(RUNNING) == 5
    assert snap.values["kiln_requests_finished"] == 12.0              # summed over labels
    assert snap.values["kiln_prompt_tokens"] == 1234.0
    assert snap.values["vllm:num_requests_swapped"] == 1.0
    batch = snap.histogram(BATCH_SIZE)
    assert batch.buckets == {1.0: 2, 4.0: 6, 8.0: 7, math.inf: 7}
    assert (batch.count, batch.sum, batch.mean) == (7, 40.0, 40 / 7)
    assert snap.histogram(TTFT).mean == pytest.approx(0.2)


def test_missing_metrics_are_none():
    snap = parse_metrics("# TYPE other gauge\nother 1\n")
    assert snap.value(WAITING) is None and snap.histogram(BATCH_SIZE) is None
    assert parse_metrics("").values == {}


def test_histogram_delta_and_bucket_quantiles():
    before = parse_metrics(sample(batch=(2, 6, 7, 7), batch_sum=40.0)).histogram(BATCH_SIZE)
    after = parse_metrics(sample(batch=(2, 16, 27, 28), batch_sum=160.0)).histogram(BATCH_SIZE)
    d = after.minus(before)                       # 0 at 1, 10 in (1, 4], 10 in (4, 8], 1 above 8
    assert d.buckets == {1.0: 0, 4.0: 10, 8.0: 20, math.inf: 21} and d.count == 21
    assert d.mean == pytest.approx(120 / 21)
    assert (d.quantile(0.25), d.quantile(0.5), d.quantile(0.95), d.quantile(1.0)) == (4.0, 8.0, 8.0, math.inf)
    dist = d.distribution()
    assert (dist.n, dist.p50, dist.max) == (21, 8.0, math.inf)


def test_metrics_observer_samples_gauges_and_differences_histograms():
    texts = iter([sample(waiting=0, running=1), None, sample(waiting=4, running=2),
                  sample(waiting=2, running=2, batch=(2, 16, 27, 28), batch_sum=160.0,
                         ttft_count=14, ttft_sum=2.8)])

    async def scrape():
        return next(texts)

    async def go():
        observer = MetricsObserver(scrape, interval=0.0)
        for _ in range(4):
            await observer.sample()
        return observer.view()

    view = asyncio.run(go())
    assert view.queue_depth.n == 3 and view.queue_depth.max == 4 and view.queue_depth.p50 == 2
    assert view.running.mean == pytest.approx(5 / 3)
    assert view.batch_size.n == 21 and view.batch_size.mean == pytest.approx(120 / 21)
    assert view.server_ttft_mean == pytest.approx(2.0 / 10)        # (2.8 - 0.8) / (14 - 4)


def test_a_server_without_metrics_has_no_view():
    async def scrape():
        return None

    assert MetricsObserver(scrape, 0.0).view() is None


def test_ttft_disagreement_warns_past_the_threshold():
    view = ServerView("/metrics", None, None, None, server_ttft_mean=0.100)
    assert ttft_disagreement(0.110, view, threshold=0.25) is None
    assert "apart" in ttft_disagreement(0.200, view, threshold=0.25)
    assert ttft_disagreement(0.200, view, threshold=1.5) is None
    # Tiny absolute gaps are HTTP overhead, not disagreement.
    assert ttft_disagreement(0.004, ServerView("/metrics", None, None, None, 0.001), 0.25) is None
    assert ttft_disagreement(0.2, ServerView("/metrics", None, None, None, None), 0.25) is None
