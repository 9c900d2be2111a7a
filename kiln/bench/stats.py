"""Per-level arithmetic over request records: percentiles, rates, goodput.

Latencies count requests that were served (ran to the end, or were cut short by their own client);
timeouts and errors are rates of their own, so a failing server cannot look fast.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass

from kiln.bench.records import Outcome, RequestRecord

SERVED = (Outcome.OK, Outcome.CANCELLED)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Distribution:
    n: int
    mean: float | None
    p50: float | None
    p95: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values: list[float]) -> "Distribution":
        mean = sum(values) / len(values) if values else None
        return cls(len(values), mean, percentile(values, 50), percentile(values, 95), percentile(values, 99),
                   max(values) if values else None)


@dataclass(frozen=True)
class SLO:
    """Per-request service levels; a request meets the SLO when it meets every one given."""
    ttft: float | None = None        # seconds to the first content chunk
    itl: float | None = None         # the request's mean gap between content chunks
    e2e: float | None = None         # seconds to the end (requests that ran to their end)

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.ttft, self.itl, self.e2e))

    def met_by(self, r: RequestRecord) -> bool:
        if r.outcome not in SERVED or r.ttft is None:
            return False
        return (_within(r.ttft, self.ttft) and _within(r.mean_itl, self.itl)
                and (r.outcome is Outcome.CANCELLED or _within(r.e2e, self.e2e)))


def _within(value: float | None, limit: float | None) -> bool:
    # A request with a single chunk has no inter-token gap, so it cannot miss an ITL SLO.
    return limit is None or value is None or value <= limit


@dataclass(frozen=True)
class LevelStats:
    num_requests: int
    outcomes: dict[str, int]
    wall_s: float
    ttft: Distribution
    itl: Distribution
    tpot: Distribution
    e2e: Distribution
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float               # requests that ran to their end
    goodput: float | None               # requests meeting the SLO, per second
    slo_attainment: float | None        # share of all requests meeting the SLO
    timeout_rate: float
    error_rate: float
    top_errors: dict[str, int]

    def to_json(self) -> dict:
        return asdict(self)


def level_stats(records: list[RequestRecord], wall_s: float, slo: SLO = SLO()) -> LevelStats:
    served = [r for r in records if r.outcome in SERVED]
    outcomes = Counter(r.outcome.value for r in records)
    n, tokens = len(records), sum(r.output_tokens for r in records)
    met = sum(slo.met_by(r) for r in records) if slo.given else None
    return LevelStats(
        num_requests=n, outcomes={o.value: outcomes.get(o.value, 0) for o in Outcome}, wall_s=wall_s,
        ttft=Distribution.of([r.ttft for r in served if r.ttft is not None]),
        itl=Distribution.of([gap for r in served for gap in r.itls]),
        tpot=Distribution.of([r.tpot for r in records if r.tpot is not None]),
        e2e=Distribution.of([r.e2e for r in records if r.e2e is not None]),
        output_tokens=tokens, output_tokens_per_s=_rate(tokens, wall_s),
        requests_per_s=_rate(outcomes.get(Outcome.OK.value, 0), wall_s),
        goodput=None if met is None else _rate(met, wall_s),
        slo_attainment=None if met is None or not n else met / n,
        timeout_rate=outcomes.get(Outcome.TIMEOUT.value, 0) / n if n else 0.0,
        error_rate=outcomes.get(Outcome.ERROR.value, 0) / n if n else 0.0,
        top_errors=dict(Counter(r.error for r in records if r.error).most_common(3)),
    )


def _rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0
