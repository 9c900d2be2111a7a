"""What the engine client publishes about the engine: one immutable snapshot after every loop
iteration (read from any thread), and one report per step (for histograms and rate estimates).
Everything a front end (the HTTP server, Triton, the bench observer) knows of the engine comes
from these: only the engine client's thread touches the engine core.

Every front end exports the same snapshot under the same metric names (kiln/serving/engine_metrics.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.config import SchedulingPolicy
from kiln.runtime.kv_manager import PrefixCacheView
from kiln.runtime.memory import KvPlan
from kiln.runtime.step_costs import StepCosts

# How a request ended, beyond the engine's own finish reasons (stop, length, abort, timeout).
ERROR = "error"          # the engine failed mid-step, or refused the request when it was added

NO_PREFIX_CACHE = PrefixCacheView()     # published when no reader asked for the prefix cache's hashes


@dataclass(frozen=True)
class StepReport:
    batch_size: int
    num_scheduled_tokens: int
    num_prefill_chunks: int
    seconds: float
    batch_wait_seconds: float | None = None   # the batch wait window's hold before this step's prompts


@dataclass(frozen=True)
class EngineSnapshot:
    """Gauges describe the engine now; counters (cumulative) only grow; limits never change."""
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_bytes_per_block: int = 0
    steps: int = 0
    scheduled_sequences: int = 0        # summed over steps: / steps = the mean batch size
    preemptions: int = 0
    kv_evictions: int = 0
    kv_allocation_failures: int = 0
    prefix_cache_queries: int = 0       # prompt tokens looked up
    prefix_cache_hits: int = 0          # prompt tokens found
    engine_failures: int = 0            # steps that raised; each failed every request in flight
    speculative_proposed: int = 0       # tokens proposed and verified (speculative decoding)
    speculative_accepted: int = 0       # of those, accepted
    finished: dict[str, int] = field(default_factory=dict)   # finish reason -> requests
    # What admission control predicts TTFT from (kiln/runtime/step_costs.py):
    max_num_seqs: int = 0
    step_costs: StepCosts = field(default_factory=StepCosts)
    prefill_budget: int = 0             # prefill tokens the last step was allowed
    remaining_tokens: tuple[int, ...] = ()   # running requests' tokens left to max_tokens, ascending
    prefilled_tokens: int = 0           # prompt tokens computed of requests without a first token
    num_prefilling: int = 0             # running requests without a first token (not decoding yet)
    last_batch_size: int = 0            # sequences the last step scheduled
    # What the prefix cache holds (what a prompt would hit); NO_PREFIX_CACHE unless asked for
    prefix_cache: PrefixCacheView = NO_PREFIX_CACHE
    priority_scheduling: bool = False   # the waiting queue is ordered by SamplingParams.priority
    # Limits, fixed when the engine was loaded:
    max_model_len: int = 0
    kv_block_size: int = 0
    kv_plan: KvPlan | None = None
    speculative: bool = False           # speculative decoding is on

    @property
    def target_itl(self) -> float:
        return self.step_costs.target_itl

    @property
    def itl_stretch(self) -> float:
        return self.step_costs.itl_stretch

    @property
    def prefill_seconds_per_token(self) -> float:
        return self.step_costs.prefill_seconds_per_token

    @property
    def decode_step_seconds(self) -> float:
        """The estimated decode-only step at today's running batch."""
        return self.step_costs.decode_seconds(self.num_running)

    @property
    def speculative_acceptance_rate(self) -> float:
        return self.speculative_accepted / self.speculative_proposed if self.speculative_proposed else 0.0

    @property
    def kv_bytes_used(self) -> int:
        return self.kv_blocks_used * self.kv_bytes_per_block

    @property
    def kv_bytes_total(self) -> int:
        return self.kv_blocks_total * self.kv_bytes_per_block


@dataclass
class LoopCounters:
    """The client's own tallies, folded into every snapshot (engine thread only)."""
    steps: int = 0
    scheduled_sequences: int = 0
    engine_failures: int = 0
    finished: dict[str, int] = field(default_factory=dict)

    def count_finished(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1


def take_snapshot(core, counters: LoopCounters, prefix_cache: bool = False) -> EngineSnapshot:
    """The engine now (the engine client's thread only). `prefix_cache`: include a view of the
    prefix cache's hashes (copied whenever they changed, so only when someone reads it)."""
    kv, sched = core.kv, core.scheduler
    spec = core.speculator.stats if core.speculator is not None else None
    return EngineSnapshot(
        num_running=sched.num_running, num_waiting=sched.num_waiting,
        kv_blocks_total=kv.num_blocks, kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
        kv_bytes_per_block=core.plan.bytes_per_block, steps=counters.steps,
        scheduled_sequences=counters.scheduled_sequences, preemptions=sched.num_preemptions,
        kv_evictions=kv.pool.evictions, kv_allocation_failures=kv.allocation_failures,
        prefix_cache_queries=kv.prefix_queries, prefix_cache_hits=kv.prefix_hits,
        engine_failures=counters.engine_failures, finished=dict(counters.finished),
        speculative_proposed=spec.proposed if spec else 0, speculative_accepted=spec.accepted if spec else 0,
        max_num_seqs=sched.batch_limit, step_costs=sched.step_costs.costs(),
        prefill_budget=sched.last_step_stats.prefill_budget,
        remaining_tokens=tuple(sorted(r.max_tokens - r.num_output_tokens for r in sched.running)),
        prefilled_tokens=sum(r.num_computed_tokens for r in sched.running if r.num_output_tokens == 0),
        num_prefilling=sum(1 for r in sched.running if r.num_output_tokens == 0),
        last_batch_size=sched.last_step_stats.batch_size,
        prefix_cache=kv.prefix_view() if prefix_cache else NO_PREFIX_CACHE,
        max_model_len=sched.config.max_model_len, kv_block_size=kv.block_size, kv_plan=core.plan,
        priority_scheduling=sched.config.policy is SchedulingPolicy.PRIORITY,
        speculative=core.speculator is not None)
