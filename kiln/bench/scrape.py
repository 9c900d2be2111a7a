"""Prometheus text from a server's /metrics, parsed generically into numbers and histograms.

Names differ between servers (and between versions of kiln's own), so each quantity is looked up
under a list of candidate names and a missing one is simply absent from the report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kiln.bench.stats import Distribution

WAITING = ("kiln_requests_waiting", "kiln_num_requests_waiting", "vllm:num_requests_waiting")
RUNNING = ("kiln_requests_running", "kiln_num_requests_running", "vllm:num_requests_running")
BATCH_SIZE = ("kiln_batch_size",)
TTFT = ("kiln_time_to_first_token_seconds", "vllm:time_to_first_token_seconds")
SPEC_PROPOSED = ("kiln_speculative_proposed_tokens", "vllm:spec_decode_num_draft_tokens")
SPEC_ACCEPTED = ("kiln_speculative_accepted_tokens", "vllm:spec_decode_num_accepted_tokens")
# kiln's admission audit (kiln/serving/traffic/admission.py): refusals for a predicted TTFT, and those the
# next admitted request proved unneeded.
REFUSED = ("kiln_admission_refused",)
REFUSED_UNNEEDED = ("kiln_admission_refused_unneeded",)


@dataclass
class Histogram:
    buckets: dict[float, float] = field(default_factory=dict)     # upper bound `le` -> cumulative count
    sum: float = 0.0
    count: float = 0.0

    def minus(self, earlier: "Histogram") -> "Histogram":
        """What was observed between two scrapes (histograms only grow)."""
        return Histogram({le: c - earlier.buckets.get(le, 0.0) for le, c in self.buckets.items()},
                         self.sum - earlier.sum, self.count - earlier.count)

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding the q-quantile (an upper estimate, never interpolated)."""
        if self.count <= 0:
            return None
        for le in sorted(self.buckets):
            if self.buckets[le] >= q * self.count:
                return le
        return math.inf

    def distribution(self) -> Distribution:
        return Distribution(int(self.count), self.mean, self.quantile(0.5), self.quantile(0.95),
                            self.quantile(0.99), self.quantile(1.0))


@dataclass
class MetricsSnapshot:
    values: dict[str, float] = field(default_factory=dict)   # gauges and counters (no _total), summed over labels
    histograms: dict[str, Histogram] = field(default_factory=dict)

    def value(self, names: tuple[str, ...]) -> float | None:
        return next((self.values[n] for n in names if n in self.values), None)

    def histogram(self, names: tuple[str, ...]) -> Histogram | None:
        return next((self.histograms[n] for n in names if n in self.histograms), None)


def parse_metrics(text: str) -> MetricsSnapshot:
    snap = MetricsSnapshot()
    for family in text_string_to_metric_families(text):
        if family.type == "histogram":
            snap.histograms[family.name] = _histogram(family)
        elif family.type in ("gauge", "counter", "untyped", "unknown"):
            name = _counter_name(family)
            total = sum(s.value for s in family.samples if not s.name.endswith("_created"))
            snap.values[name] = snap.values.get(name, 0.0) + total
    return snap


def _counter_name(family) -> str:
    # NOTE: prometheus_client 0.26's parser leaves `x_total{label=...}` samples out of the `x` counter
    # family and yields one untyped `x_total` family per labelled sample: fold them back into `x`.
    if family.type in ("untyped", "unknown") and family.name.endswith("_total"):
        return family.name[: -len("_total")]
    return family.name


def _histogram(family) -> Histogram:
    h = Histogram()
    for s in family.samples:        # series with other labels are summed: one histogram per name
        if s.name.endswith("_bucket"):
            le = float(s.labels["le"])
            h.buckets[le] = h.buckets.get(le, 0.0) + s.value
        elif s.name.endswith("_sum"):
            h.sum += s.value
        elif s.name.endswith("_count"):
            h.count += s.value
    return h
