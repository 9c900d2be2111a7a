"""kiln's engine metrics as Triton custom metrics (served on Triton's metrics port), under the same
names as `kiln serve`'s /metrics (kiln/serving/engine_metrics.py).

Gauges for the engine's state now, counters for what it has done; Prometheus counters only grow,
so each publish adds what changed since the last one. Every metric update is a round trip to the
Triton process, so snapshots are published at most every `interval` seconds while the engine is
busy, and always once it goes idle (so idle values are exact). Labels name the model instance:
each instance is its own stub process with its own engine and KV pool.
"""

from __future__ import annotations

import time

from kiln.runtime.engine_stats import EngineSnapshot, StepReport
from kiln.serving import engine_metrics as em


class TritonMetrics:
    def __init__(self, pb_utils, labels: dict[str, str], interval: float = 0.05):
        self._labels, self._interval = labels, interval
        family = pb_utils.MetricFamily
        # NOTE: the families must outlive their metrics (the backend refuses the reverse order).
        self._families = {m.field: family(name=m.name, description=m.doc, kind=family.GAUGE) for m in em.GAUGES}
        self._families |= {m.field: family(name=m.name, description=m.doc, kind=family.COUNTER)
                           for m in em.COUNTERS}
        self._finished_family = family(name=em.FINISHED.name, description=em.FINISHED.doc, kind=family.COUNTER)
        self._batch_family = family(name=em.BATCH_SIZE.name, description=em.BATCH_SIZE.doc, kind=family.HISTOGRAM)
        self._metrics = {key: f.Metric(labels=labels) for key, f in self._families.items()}
        self._batch = self._batch_family.Metric(labels=labels, buckets=[float(b) for b in em.BATCH_BUCKETS])
        self._finished: dict[str, object] = {}
        self._last = EngineSnapshot()
        self._published_at = 0.0

    def observe_step(self, step: StepReport) -> None:
        """A step listener (engine thread)."""
        self._batch.observe(float(step.batch_size))

    def publish(self, s: EngineSnapshot) -> None:
        """A snapshot listener (engine thread)."""
        now = time.monotonic()
        busy = s.num_running + s.num_waiting > 0
        if busy and now - self._published_at < self._interval:
            return
        self._published_at = now
        # NOTE: counters first: a scrape that sees the gauges of this snapshot (KV blocks back
        # to 0) also sees its counters (the abort that freed them).
        for m in em.COUNTERS:
            grown = getattr(s, m.field) - getattr(self._last, m.field)
            if grown:
                self._metrics[m.field].increment(grown)
        for reason, n in s.finished.items():
            grown = n - self._last.finished.get(reason, 0)
            if grown:
                self._finished_metric(reason).increment(grown)
        for m in em.GAUGES:
            self._metrics[m.field].set(getattr(s, m.field))
        self._last = s

    def _finished_metric(self, reason: str):
        if reason not in self._finished:
            labels = {**self._labels, em.FINISH_REASON_LABEL: reason}
            self._finished[reason] = self._finished_family.Metric(labels=labels)
        return self._finished[reason]

    def close(self) -> None:
        self._metrics.clear()
        self._finished.clear()
        self._batch = None
        self._families.clear()
        self._finished_family = self._batch_family = None
