"""The dashboard's numbers (kiln.serving.console.stats/history) from the server's own registry: no
server, no browser."""

from __future__ import annotations

import math

import pytest

from kiln.serving.console.history import StatsHistory
from kiln.serving.console.stats import Scrape, histogram_quantile, point, scrape
from kiln.serving.http.metrics import ServerMetrics

INF = math.inf


def test_histogram_quantile_interpolates_inside_the_bucket_like_promql():
    buckets = [(0.1, 0.0), (0.2, 10.0), (0.4, 20.0), (INF, 20.0)]
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.15)
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.2)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.3)


def test_histogram_quantile_edges():
    assert histogram_quantile(0.5, []) is None
    assert histogram_quantile(0.5, [(0.1, 0.0), (INF, 0.0)]) is None                  # no observations
    assert histogram_quantile(0.99, [(0.1, 1.0), (1.0, 1.0), (INF, 5.0)]) == 1.0      # +Inf: its lower bound
    assert histogram_quantile(0.5, [(0.1, 4.0), (INF, 4.0)]) == pytest.approx(0.05)   # first bucket from 0


def test_point_rates_means_and_window_ratios():
    window = Scrape(0.0, {"kiln_prefix_cache_queries_total": 100, "kiln_prefix_cache_hits_total": 10})
    prev = Scrape(9.0, {"kiln_steps_total": 50, "kiln_scheduled_sequences_total": 100,
                        'kiln_requests_rejected_total{reason="ttft_slo"}': 1,
                        'kiln_requests_rejected_total{reason="invalid"}': 3})
    new = Scrape(10.0, {"kiln_steps_total": 60, "kiln_scheduled_sequences_total": 180,
                        "kiln_prefix_cache_queries_total": 300, "kiln_prefix_cache_hits_total": 110,
                        'kiln_requests_rejected_total{reason="ttft_slo"}': 3,
                        'kiln_requests_rejected_total{reason="max_waiting"}': 1,
                        'kiln_requests_rejected_total{reason="invalid"}': 9,
                        "kiln_requests_running": 8, "kiln_kv_blocks_used": 40, "kiln_kv_blocks_total": 100})
    p = point(new, prev, window)
    assert p["batch"] == 8.0                     # 80 sequences over 10 steps
    assert p["tokens_per_s"] == 80.0             # over the one second since prev
    assert p["prefix_hit_rate"] == 0.5           # 100 hits of 200 queries in the window
    assert p["rejected_429"] == 3                # ttft_slo +2, max_waiting +1; the 400s are not 429s
    assert (p["running"], p["waiting"], p["kv_used"], p["kv_total"]) == (8, 0, 40, 100)
    assert p["ttft"] == {"p50": None, "p90": None, "p99": None}


def test_an_idle_period_has_no_batch_and_no_hit_rate():
    s = Scrape(1.0, {"kiln_steps_total": 5, "kiln_prefix_cache_queries_total": 7})
    p = point(s, Scrape(0.0, dict(s.values)), Scrape(0.0, dict(s.values)))
    assert p["batch"] == 0 and p["prefix_hit_rate"] is None and p["tokens_per_s"] == 0


def test_history_percentiles_from_the_real_registry():
    metrics = ServerMetrics()
    history = StatsHistory(metrics.registry, points=3, window=2)
    for _ in range(10):
        metrics.ttft.observe(0.5)               # before the first scrape: not in any window
    assert history.take(now=0.0) is None         # the first scrape has no past
    for _ in range(10):
        metrics.ttft.observe(0.03)               # bucket (0.025, 0.05]
    p = history.take(now=1.0)
    assert p["ttft"]["p50"] == pytest.approx(0.025 + 0.025 * 5 / 10)
    assert p["itl"]["p50"] is None
    metrics.ttft.observe(3.0)                    # bucket (2.5, 5]
    p = history.take(now=2.0)
    assert p["ttft"]["p99"] == pytest.approx(2.5 + 2.5 * (0.99 * 11 - 10) / 1)   # window: both periods
    history.take(now=3.0)
    p = history.take(now=4.0)                    # the window (two periods) holds no observation now
    assert p["ttft"]["p50"] is None


def test_history_keeps_the_newest_points_and_says_what_a_viewer_missed():
    history = StatsHistory(ServerMetrics().registry, points=3)
    history.take(now=0.0)
    for t in range(1, 6):
        history.take(now=float(t))
    assert [p["t"] for p in history.points] == [3.0, 4.0, 5.0]
    assert history.since(0) == (list(history.points), 5)
    assert history.since(4) == ([history.points[-1]], 5)
    assert history.since(5) == ([], 5)


def test_scrape_reads_buckets_and_labelled_samples():
    metrics = ServerMetrics()
    metrics.rejected.labels("ttft_slo").inc(2)
    metrics.itl.observe(0.003)
    s = scrape(metrics.registry, now=7.0)
    assert s.t == 7.0 and s.values['kiln_requests_rejected_total{reason="ttft_slo"}'] == 2
    assert s.buckets["kiln_inter_token_latency_seconds"][-1] == (INF, 1.0)
    assert dict(s.buckets["kiln_inter_token_latency_seconds"])[0.0025] == 0.0
