"""The engine's metrics: one vocabulary, the same names over HTTP /metrics and on Triton's metrics
port (README, "Metrics"). Values come from the engine client's EngineSnapshot and StepReports.

Names are the sample names a scraper sees: counters end in _total (prometheus-client adds the
suffix to a counter family's samples; Triton custom metrics are exported as named).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineMetric:
    name: str
    field: str          # the EngineSnapshot attribute it reports
    doc: str


GAUGES = (
    EngineMetric("kiln_requests_running", "num_running", "Requests in the running batch (holding KV blocks)."),
    EngineMetric("kiln_requests_waiting", "num_waiting", "Requests in the engine's waiting queue."),
    EngineMetric("kiln_kv_blocks_used", "kv_blocks_used", "KV-cache blocks held by requests."),
    EngineMetric("kiln_kv_blocks_total", "kv_blocks_total", "KV-cache blocks in the pool."),
    EngineMetric("kiln_kv_bytes_used", "kv_bytes_used", "Bytes of the KV blocks in use."),
    EngineMetric("kiln_kv_bytes_total", "kv_bytes_total", "Bytes of the KV pool."),
    EngineMetric("kiln_target_itl_seconds", "target_itl",
                 "Step time decode-aware chunked prefill aims for while streams decode (0 = off)."),
    EngineMetric("kiln_itl_stretch", "itl_stretch",
                 "How many decode-only steps' time a step with prefill may take (0 = no such bound)."),
    EngineMetric("kiln_prefill_token_budget", "prefill_budget",
                 "Prefill tokens the last engine step was allowed beside its decodes."),
    EngineMetric("kiln_step_decode_seconds", "decode_step_seconds",
                 "Estimated decode-only step time at the current running batch."),
    EngineMetric("kiln_step_prefill_seconds_per_token", "prefill_seconds_per_token",
                 "Estimated prefill cost per token beyond a step's decodes."),
    EngineMetric("kiln_speculative_acceptance_rate", "speculative_acceptance_rate",
                 "Accepted over proposed speculative tokens since start (0 without speculation)."),
)
COUNTERS = (
    EngineMetric("kiln_steps_total", "steps", "Engine steps run."),
    EngineMetric("kiln_scheduled_sequences_total", "scheduled_sequences",
                 "Sequences scheduled, summed over steps (divided by steps: the mean batch size)."),
    EngineMetric("kiln_preemptions_total", "preemptions", "Requests preempted (freed and recomputed)."),
    EngineMetric("kiln_kv_evictions_total", "kv_evictions", "Cached KV blocks evicted for reuse."),
    EngineMetric("kiln_kv_allocation_failures_total", "kv_allocation_failures",
                 "KV block allocations that did not fit."),
    EngineMetric("kiln_prefix_cache_queries_total", "prefix_cache_queries",
                 "Prompt tokens looked up in the prefix cache."),
    EngineMetric("kiln_prefix_cache_hits_total", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    EngineMetric("kiln_speculative_proposed_tokens_total", "speculative_proposed",
                 "Tokens proposed by speculative decoding and verified by the engine."),
    EngineMetric("kiln_speculative_accepted_tokens_total", "speculative_accepted",
                 "Of those, tokens accepted (each saves one engine step of its request)."),
    EngineMetric("kiln_engine_failures_total", "engine_failures",
                 "Engine steps that raised; each ended every request in flight with an error."),
)
FINISHED = EngineMetric("kiln_requests_finished_total", "finished",
                        "Engine requests ended, by finish reason (stop, length, abort, timeout, error).")
FINISH_REASON_LABEL = "finish_reason"
BATCH_SIZE = EngineMetric("kiln_batch_size", "batch_size", "Sequences per engine step (a histogram).")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
