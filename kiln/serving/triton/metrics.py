"""kiln's engine statistics as Triton custom metrics (served on Triton's metrics port).

Gauges for the engine's state now, counters for what it has done; Prometheus counters only
grow, so each publish adds what changed since the last one. Labels name the model instance:
each instance is its own stub process with its own engine and KV pool.
"""

from __future__ import annotations

from dataclasses import fields

from kiln.serving.triton.engine_loop import EngineSnapshot

GAUGES = {
    "batch_size": ("kiln_batch_size", "Sequences in the engine's last step (0 when idle)"),
    "num_running": ("kiln_num_requests_running", "Requests holding KV blocks"),
    "num_waiting": ("kiln_num_requests_waiting", "Requests queued for admission"),
    "kv_blocks_used": ("kiln_kv_blocks_used", "KV cache blocks in use"),
    "kv_blocks_free": ("kiln_kv_blocks_free", "KV cache blocks free (cached prefixes included)"),
}
COUNTERS = {
    "steps": ("kiln_steps_total", "Engine steps run"),
    "scheduled_sequences": ("kiln_scheduled_sequences_total",
                            "Sequences scheduled, summed over steps (divide by steps for the mean batch)"),
    "prefix_cache_queries": ("kiln_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("kiln_prefix_cache_hits_total", "Prompt tokens found in the prefix cache"),
    "preemptions": ("kiln_preemptions_total", "Requests preempted (recomputed later)"),
}
FINISHED = ("kiln_requests_finished_total", "Requests finished, by reason (stop, length, abort)")


class TritonMetrics:
    def __init__(self, pb_utils, labels: dict[str, str]):
        self._pb, self._labels = pb_utils, labels
        family = pb_utils.MetricFamily
        # NOTE: the families must outlive their metrics (the backend refuses the reverse order).
        self._families = {key: family(name=name, description=doc, kind=family.GAUGE)
                          for key, (name, doc) in GAUGES.items()}
        self._families.update({key: family(name=name, description=doc, kind=family.COUNTER)
                               for key, (name, doc) in COUNTERS.items()})
        self._finished_family = family(name=FINISHED[0], description=FINISHED[1], kind=family.COUNTER)
        self._metrics = {key: f.Metric(labels=labels) for key, f in self._families.items()}
        self._finished: dict[str, object] = {}
        self._last = EngineSnapshot()

    def publish(self, s: EngineSnapshot) -> None:
        # NOTE: counters first: a scrape that sees the gauges of this snapshot (KV blocks back
        # to 0) also sees its counters (the abort that freed them).
        for key in COUNTERS:
            grown = getattr(s, key) - getattr(self._last, key)
            if grown:
                self._metrics[key].increment(grown)
        for reason, n in s.finished.items():
            grown = n - self._last.finished.get(reason, 0)
            if grown:
                self._finished_metric(reason).increment(grown)
        for key in GAUGES:
            self._metrics[key].set(getattr(s, key))
        self._last = EngineSnapshot(**{f.name: getattr(s, f.name) for f in fields(s)})

    def _finished_metric(self, reason: str):
        if reason not in self._finished:
            self._finished[reason] = self._finished_family.Metric(labels={**self._labels, "reason": reason})
        return self._finished[reason]

    def close(self) -> None:
        self._metrics.clear()
        self._finished.clear()
        self._families.clear()
        self._finished_family = None
