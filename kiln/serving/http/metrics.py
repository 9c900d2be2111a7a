"""Prometheus metrics, in a registry of the app's own (so two servers in one process, as in
tests, never share series). Request latencies come from the engine's timestamps on each Request;
the engine's own metrics (kiln/serving/engine_metrics.py, the same names as on Triton) are read
from the engine client's snapshot at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kiln.runtime.engine_stats import StepReport
from kiln.runtime.request import Request
from kiln.serving import engine_metrics as em

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
BATCH_WAIT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.15, 0.25, 0.5, 1, 2.5)


class ServerMetrics:
    def __init__(self):
        disable_created_metrics()        # the *_created series only double what a scrape says
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("kiln_time_to_first_token_seconds", "Arrival to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kiln_inter_token_latency_seconds", "Between consecutive tokens of a request.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("kiln_e2e_request_latency_seconds", "Arrival to finish.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("kiln_request_queue_time_seconds", "Arrival to first scheduled.",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("kiln_request_prefill_time_seconds", "First scheduled to first token.",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.decode = Histogram("kiln_request_decode_time_seconds", "First token to finish.",
                                buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram(em.BATCH_SIZE.name, em.BATCH_SIZE.doc, buckets=em.BATCH_BUCKETS, registry=r)
        self.batch_wait = Histogram("kiln_batch_wait_seconds", "How long the batch wait window held new prompts "
                                    "before the step that admitted them (--batch-wait-ms).",
                                    buckets=BATCH_WAIT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kiln_prompt_tokens", "Prompt tokens of engine requests.", registry=r)
        self.generation_tokens = Counter("kiln_generation_tokens", "Tokens generated.", registry=r)
        self.rejected = Counter("kiln_requests_rejected", "Requests refused: 429 by admission bound, "
                                "or invalid (4xx).", ["reason"], registry=r)
        self.aborted = Counter("kiln_requests_aborted", "Engine requests aborted because every "
                               "client waiting on them disconnected.", registry=r)
        self.cache_hits = Counter("kiln_response_cache_hits", "Responses served from the response cache "
                                  "(stored) or by joining an identical request in flight.", ["kind"], registry=r)

    def observe_step(self, step: StepReport) -> None:
        """Engine thread; prometheus-client metrics are thread-safe."""
        self.batch_size.observe(step.batch_size)
        if step.batch_wait_seconds is not None:
            self.batch_wait.observe(step.batch_wait_seconds)

    def observe_request(self, request: Request, num_generated: int) -> None:
        self.prompt_tokens.inc(request.num_prompt_tokens)
        self.generation_tokens.inc(num_generated)
        t = request.timings
        for hist, start, end in ((self.queue, request.arrival_time, t.first_scheduled_time),
                                 (self.prefill, t.first_scheduled_time, t.first_token_time),
                                 (self.ttft, request.arrival_time, t.first_token_time),
                                 (self.decode, t.first_token_time, t.finished_time),
                                 (self.e2e, request.arrival_time, t.finished_time)):
            if start is not None and end is not None:
                hist.observe(max(end - start, 0.0))
        for a, b in zip(t.token_times, t.token_times[1:]):
            self.itl.observe(b - a)

    def watch(self, client, admission, generations) -> None:
        """Publish the engine snapshot, the admission state and the server's own books at every scrape."""
        self.registry.register(_EngineCollector(client, admission, generations))


class _EngineCollector:
    def __init__(self, client, admission, generations):
        self.client, self.admission, self.generations = client, admission, generations

    def collect(self):
        s = self.client.snapshot
        for m in em.GAUGES:
            yield _gauge(m.name, m.doc, getattr(s, m.field))
        for m in em.COUNTERS:
            yield _counter(m.name, m.doc, getattr(s, m.field))
        finished = CounterMetricFamily(em.FINISHED.name, em.FINISHED.doc, labels=[em.FINISH_REASON_LABEL])
        for reason, n in sorted(s.finished.items()):
            finished.add_metric([reason], n)
        yield finished
        yield from _gateway_gauges(s)
        yield _gauge("kiln_admission_waiting_requests", "Admitted requests without a first token.",
                     self.admission.pending)
        yield _gauge("kiln_admission_waiting_tokens", "Their prompt tokens.", self.admission.pending_tokens)
        yield from _admission_audit(self.admission.audit)
        yield _gauge("kiln_admission_ttft_calibration", "Realised over modelled TTFT of admitted requests "
                     "(its 90th percentile); it scales the prediction.", self.admission.calibration.factor)
        yield _gauge("kiln_admission_refusal_calibration", "Realised over modelled TTFT of admitted requests "
                     "(its 25th percentile); it scales the prediction a 429 is judged on.",
                     self.admission.refusal_calibration.factor)
        yield _gauge("kiln_prefill_tokens_per_second", "Measured prefill rate with nothing decoding "
                     "(admission predicts TTFT from the step-cost model it comes from).",
                     self.admission.prefill_tokens_per_second)
        yield _gauge("kiln_requests_in_progress", "Engine requests the server has open (shared ones once).",
                     self.generations.num_flights)
        cache = self.generations.cache
        yield _gauge("kiln_response_cache_entries", "Responses in the response cache.", len(cache) if cache else 0)
        yield _gauge("kiln_response_cache_bytes", "Their estimated size.", cache.nbytes if cache else 0)


# The Gateway API Inference Extension's model-server protocol reads these two gauges (vLLM's
# names, which its endpoint picker defaults to): the queue and the KV cache's use as a fraction.
# Aliases of kiln_requests_waiting and kiln_kv_blocks_used / kiln_kv_blocks_total.
GATEWAY_QUEUE, GATEWAY_KV_USAGE = "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"


def _gateway_gauges(s):
    yield _gauge(GATEWAY_QUEUE, "Requests in the engine's waiting queue (alias of kiln_requests_waiting, "
                 "for the Kubernetes inference gateway).", s.num_waiting)
    used = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
    yield _gauge(GATEWAY_KV_USAGE, "KV-cache blocks in use as a fraction of the pool (kiln_kv_blocks_used "
                 "/ kiln_kv_blocks_total, for the Kubernetes inference gateway).", used)


def _gauge(name, doc, value):
    family = GaugeMetricFamily(name, doc)
    family.add_metric([], value)
    return family


def _counter(name, doc, value):
    family = CounterMetricFamily(name, doc)
    family.add_metric([], value)
    return family


def _admission_audit(audit):
    """Admission's decisions against what happened (kiln/serving/traffic/admission.py, Audit)."""
    checks = (("admitted_on_time", "Admitted requests whose first token came within the TTFT objective."),
              ("admitted_late", "Admitted requests whose first token came after the TTFT objective."),
              ("refused", "Requests refused (429) for their predicted TTFT."),
              ("refused_unneeded", "Of those, refusals the next admitted request proved unneeded: its first "
                                   "token came within the refusal's bound (an estimate of false refusals)."))
    for name, help_text in checks:
        yield _counter(f"kiln_admission_{name}", help_text, getattr(audit, name))
