"""How many replicas: from kiln's own admission signals, not Serve's request counts.

Every replica reports (record_autoscaling_stats) what its admission control sees:
  predicted_ttft     the TTFT a new short request would be predicted now (queue and seats), s
  ttft_slo           its objective (0: none), s
  waiting_tokens     prompt tokens admitted and not yet prefilled
  prefill_tps        its measured prefill rate, tokens/s
  refused_per_s      429s it answered per second since its last report

A replica's pressure is the larger of predicted_ttft / (TARGET * slo) and the time its waiting
prompts take to prefill over the same budget: 1.0 means the queue uses TARGET of the objective.
The desired count is ceil(sum of pressures) -- enough replicas for each to sit at the target --
and at least one more than now while any replica refuses. Serve's wrapper applies min/max
replicas, the up/down delays and the scaling factors to what this returns.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

TARGET = 0.5                 # of the TTFT objective a replica's queue should use
DEFAULT_BUDGET = 1.0         # seconds of queue per replica when no objective is set
METRICS = ("predicted_ttft", "ttft_slo", "waiting_tokens", "prefill_tps", "refused_per_s")


@dataclass(frozen=True)
class ReplicaSignals:
    predicted_ttft: float = 0.0
    ttft_slo: float = 0.0
    waiting_tokens: float = 0.0
    prefill_tps: float = 0.0
    refused_per_s: float = 0.0

    @property
    def budget(self) -> float:
        return TARGET * (self.ttft_slo if self.ttft_slo > 0 else DEFAULT_BUDGET)

    @property
    def pressure(self) -> float:
        prefill = self.waiting_tokens / self.prefill_tps if self.prefill_tps > 0 else 0.0
        return max(self.predicted_ttft, prefill) / self.budget


def desired_replicas(signals: list[ReplicaSignals], current: int, min_replicas: int = 1,
                     max_replicas: int = 1) -> int:
    """The replica count the signals ask for, within [min_replicas, max_replicas]."""
    if not signals:                       # nothing reported yet: keep what runs
        want = current
    else:
        want = math.ceil(sum(s.pressure for s in signals) - 1e-9)
        if any(s.refused_per_s > 0 for s in signals):
            want = max(want, current + 1)
    return min(max(want, min_replicas, 0), max(max_replicas, min_replicas))


def signals_by_replica(aggregated: Mapping[str, Mapping[object, float]] | None) -> list[ReplicaSignals]:
    """Serve's aggregated metrics ({metric: {replica: value}}) -> one ReplicaSignals per replica."""
    if not aggregated:
        return []
    replicas = set().union(*(aggregated.get(m, {}).keys() for m in METRICS))
    return [ReplicaSignals(**{m: float(aggregated.get(m, {}).get(r, 0.0)) for m in METRICS})
            for r in sorted(replicas, key=str)]


def kiln_autoscaling_policy(ctx) -> tuple[int, dict]:
    """A Serve custom autoscaling policy (AutoscalingConfig(policy={"policy_function":
    "kiln.scale.autoscale:kiln_autoscaling_policy"})); ctx is Serve's AutoscalingContext."""
    signals = signals_by_replica(ctx.aggregated_metrics)
    want = desired_replicas(signals, ctx.current_num_replicas, ctx.capacity_adjusted_min_replicas,
                            ctx.capacity_adjusted_max_replicas)
    return want, {}
