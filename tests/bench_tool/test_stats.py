"""Percentiles, rates and goodput on made-up timings, with exact expectations."""

from __future__ import annotations

import pytest

from kiln.bench.records import Outcome, RequestRecord
from kiln.bench.stats import SLO, Distribution, level_stats, percentile


def record(index, start, chunks, end, tokens=None, outcome=Outcome.OK, error=None) -> RequestRecord:
    return RequestRecord(index, prompt_tokens=10, start=start, chunk_times=list(chunks), end=end,
                         output_tokens=len(chunks) if tokens is None else tokens, outcome=outcome, error=error)


def test_percentile_interpolates_between_closest_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile(list(range(1, 101)), 95) == pytest.approx(95.05)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_distribution_of_values():
    d = Distribution.of([0.1, 0.2, 0.3, 0.4, 1.0])
    assert (d.n, d.p50, d.max) == (5, 0.3, 1.0)
    assert d.mean == pytest.approx(0.4)
    assert d.p95 == pytest.approx(0.88)          # 0.4 + 0.8 * (1.0 - 0.4)
    assert Distribution.of([]) == Distribution(0, None, None, None, None, None)


def test_request_record_latencies():
    r = record(0, start=1.0, chunks=[1.5, 1.7, 2.0], end=2.5, tokens=5)
    assert r.ttft == 0.5
    assert r.itls == pytest.approx([0.2, 0.3])
    assert r.mean_itl == pytest.approx(0.25)
    assert r.e2e == 1.5
    assert r.tpot == pytest.approx((2.5 - 1.5) / 4)     # after the first token, over the other 4
    cut = record(1, start=0.0, chunks=[0.1], end=0.2, outcome=Outcome.CANCELLED)
    assert cut.e2e is None and cut.tpot is None and cut.ttft == 0.1


def sweep() -> list[RequestRecord]:
    return [
        record(0, 0.0, [0.1, 0.2, 0.3], 0.3),                    # ttft 0.1, itl 0.1, e2e 0.3
        record(1, 0.0, [0.4, 0.5], 0.5),                         # ttft 0.4: misses a 0.3 s TTFT SLO
        record(2, 1.0, [1.2, 1.5, 1.8], 1.8),                    # itl 0.3: misses a 0.2 s ITL SLO
        record(3, 2.0, [2.1], 2.2, outcome=Outcome.CANCELLED),   # hung up after one chunk: served
        record(4, 2.0, [], 3.0, tokens=0, outcome=Outcome.TIMEOUT),
        record(5, 3.0, [], 3.1, tokens=0, outcome=Outcome.ERROR, error="TargetError: HTTP 429"),
    ]


def test_level_stats_counts_rates_and_latencies():
    s = level_stats(sweep(), wall_s=4.0)
    assert s.num_requests == 6
    assert s.outcomes == {"ok": 3, "cancelled": 1, "timeout": 1, "error": 1}
    assert s.output_tokens == 3 + 2 + 3 + 1
    assert s.output_tokens_per_s == 9 / 4.0
    assert s.requests_per_s == 3 / 4.0                           # ran to their end
    assert s.timeout_rate == 1 / 6 and s.error_rate == 1 / 6
    assert s.ttft.n == 4 and s.ttft.p50 == pytest.approx(0.15)   # 0.1, 0.1, 0.2, 0.4 (cancelled counts)
    assert s.itl.n == 2 + 1 + 2 and s.itl.max == pytest.approx(0.3)
    assert s.e2e.n == 3 and s.e2e.max == pytest.approx(0.8)
    assert s.goodput is None and s.slo_attainment is None        # no SLO given
    assert s.top_errors == {"TargetError: HTTP 429": 1}


@pytest.mark.parametrize("slo, met", [
    (SLO(ttft=0.3), [0, 2, 3]),
    (SLO(itl=0.2), [0, 1, 3]),              # one chunk: no gap, cannot miss the ITL SLO
    (SLO(ttft=0.3, itl=0.2), [0, 3]),
    (SLO(e2e=0.4), [0, 3]),                 # the cancelled request is judged on TTFT and ITL only
    (SLO(ttft=10, itl=10, e2e=10), [0, 1, 2, 3]),
])
def test_goodput_counts_requests_meeting_every_slo(slo, met):
    records = sweep()
    assert [r.index for r in records if slo.met_by(r)] == met
    s = level_stats(records, wall_s=2.0, slo=slo)
    assert s.goodput == len(met) / 2.0
    assert s.slo_attainment == len(met) / 6
