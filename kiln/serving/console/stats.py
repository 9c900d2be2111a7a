"""One dashboard point from scrapes of the server's Prometheus registry.

A scrape is the registry's samples as flat numbers plus each histogram's cumulative buckets. A point
compares the newest scrape with the one before it (rates over the last period) and with one a window
earlier (percentiles and hit rates over the window, as PromQL's `rate(...[10s])` would).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

QUANTILES = (0.5, 0.9, 0.99)
# kiln_requests_rejected_total's reasons that are not a 429 (ServerMetrics labels a 429 by its bound).
NOT_BUSY = frozenset({"invalid", "unauthorized", "not_ready"})


@dataclass(frozen=True)
class Scrape:
    t: float
    values: dict[str, float]                                   # 'name' or 'name{k="v"}' -> value
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)   # histogram -> (le, count)


def scrape(registry, now: float | None = None) -> Scrape:
    values, buckets = {}, {}
    for family in registry.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                buckets.setdefault(s.name[:-len("_bucket")], []).append((float(s.labels["le"]), s.value))
            else:
                values[_key(s.name, s.labels)] = s.value
    for series in buckets.values():
        series.sort()
    return Scrape(time.time() if now is None else now, values, buckets)


def _key(name: str, labels: dict) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """PromQL's histogram_quantile: linear inside the bucket holding rank q; None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank and count > below:
            if math.isinf(le):
                return lower                  # the +Inf bucket has no width: its lower bound
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def bucket_delta(new: Scrape, old: Scrape, name: str) -> list[tuple[float, float]]:
    before = dict(old.buckets.get(name, []))
    return [(le, count - before.get(le, 0.0)) for le, count in new.buckets.get(name, [])]


def point(new: Scrape, prev: Scrape, window: Scrape) -> dict:
    """The dashboard's numbers at `new.t`. `prev` is one period back, `window` several."""
    v = new.values
    dt = max(new.t - prev.t, 1e-9)
    steps = _delta(new, prev, "kiln_steps_total")
    sequences = _delta(new, prev, "kiln_scheduled_sequences_total")
    queries = _delta(new, window, "kiln_prefix_cache_queries_total")
    return {
        "t": round(new.t, 3),
        "running": v.get("kiln_requests_running", 0), "waiting": v.get("kiln_requests_waiting", 0),
        "kv_used": v.get("kiln_kv_blocks_used", 0), "kv_total": v.get("kiln_kv_blocks_total", 0),
        "batch": sequences / steps if steps else 0,
        # NOTE: each scheduled sequence yields one token per step (a prompt's non-final prefill
        # chunks aside), so this counts generated tokens as they come; kiln_generation_tokens_total
        # only counts a request's tokens when it ends.
        "tokens_per_s": sequences / dt,
        "prefix_hit_rate": _delta(new, window, "kiln_prefix_cache_hits_total") / queries if queries else None,
        "rejected_429": _busy_rejections(new) - _busy_rejections(prev),
        "ttft": _quantiles(new, window, "kiln_time_to_first_token_seconds"),
        "itl": _quantiles(new, window, "kiln_inter_token_latency_seconds"),
    }


def _delta(new: Scrape, old: Scrape, key: str) -> float:
    return new.values.get(key, 0.0) - old.values.get(key, 0.0)


def _busy_rejections(s: Scrape) -> float:
    prefix = 'kiln_requests_rejected_total{reason="'
    return sum(value for key, value in s.values.items()
               if key.startswith(prefix) and key[len(prefix):-2] not in NOT_BUSY)


def _quantiles(new: Scrape, window: Scrape, name: str) -> dict[str, float | None]:
    delta = bucket_delta(new, window, name)
    return {f"p{round(q * 100)}": histogram_quantile(q, delta) for q in QUANTILES}
