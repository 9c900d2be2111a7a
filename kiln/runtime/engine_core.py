"""The engine core step: schedule() -> runner.execute() -> scheduler.update(), plus statistics."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from kiln.contract.artifact import EngineArtifact
from kiln.config import RuntimeConfig
from kiln.engines.load import load_engine
from kiln.runtime.kv_manager import KVCacheManager
from kiln.runtime.memory import plan_kv_blocks
from kiln.runtime.request import Request, RequestStatus
from kiln.runtime.runner import ModelRunner
from kiln.runtime.scheduler import Scheduler
from kiln.runtime.speculative.factory import make_speculator
from kiln.runtime.step_io import RequestDelta

log = logging.getLogger("kiln")

MAX_CYCLE_OVERHEAD = 0.25     # seconds between steps beyond which the loop must have idled


@dataclass
class EngineStats:
    steps: int = 0
    prefill_seconds: float = 0.0       # steps that ran at least one prefill chunk
    decode_seconds: float = 0.0        # steps that only decoded
    step_seconds: float = 0.0
    finished_by_reason: dict[str, int] = field(default_factory=dict)


class EngineCore:
    def __init__(self, artifact: EngineArtifact, config: RuntimeConfig = RuntimeConfig()):
        self.artifact, self.config = artifact, config
        self.engine = load_engine(artifact, config.threads)
        layout = self.engine.kv_layout
        self.plan = plan_kv_blocks(layout, config, self._scheduler_config().max_model_len)
        log.info("%s", self.plan.describe())
        self.engine.allocate_kv(self.plan.num_blocks)
        self.kv = KVCacheManager(self.plan.num_blocks, layout.block_size, config.scheduler.enable_prefix_caching)
        self.speculator = make_speculator(config.speculative, artifact, config, self.plan.num_tokens)
        self.scheduler = Scheduler(self._scheduler_config(), self.kv, self.speculator)
        self.runner = ModelRunner(self.engine, self.kv, config.seed)
        self.stats = EngineStats()
        # (start, own seconds, engine seconds) of the last step, for the cycle and the debug trace
        self._last_step: tuple[float, float, float] | None = None

    def _scheduler_config(self):
        """The user's scheduler knobs, clipped to what the artifact can run."""
        m, cfg = self.artifact.manifest, self.config.scheduler
        threshold = cfg.long_prefill_token_threshold or m.buckets.max_seq
        auto_batch = cfg.max_num_seqs == 0
        return replace(cfg, max_model_len=min(cfg.max_model_len, m.generation["max_model_len"]),
                       max_num_seqs=min(cfg.max_num_seqs or m.buckets.max_batch, m.buckets.max_batch),
                       itl_bounds_batch=auto_batch,
                       long_prefill_token_threshold=min(threshold, m.buckets.max_seq))

    def add_request(self, request: Request) -> None:
        """Raises ValueError (nothing else changes) when the request can never run."""
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> None:
        self.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def finish(self, request_id: str, status: RequestStatus, stop_reason=None) -> None:
        self.scheduler.finish_request(request_id, status, stop_reason)
        self.runner.release(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestDelta]:
        # NOTE: monotonic, the clock Request.arrival_time uses, so the latencies subtract cleanly.
        t0 = time.monotonic()
        self._observe_cycle(t0)
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        for s in out.scheduled:
            if s.request.timings.first_scheduled_time is None:
                s.request.timings.first_scheduled_time = t0
        engine0 = self.runner.stats.engine_seconds
        update = self.scheduler.update(out, self.runner.execute(out))
        now = time.monotonic()
        for delta in update.deltas:
            _stamp_token(delta.request, now)
        for r in update.finished:
            self._retire(r, now)
        self._record_step(out, now - t0)
        self._last_step = (t0, now - t0, self.runner.stats.engine_seconds - engine0)
        return update.deltas

    def _observe_cycle(self, now: float) -> None:
        """Teach the scheduler's step-cost model the last step, timed from its start to this
        one's: what a stream waits between tokens (the step, detokenizing and delivering its
        outputs, the server's share of the GIL). NOTE: after an idle gap (the loop had nothing
        to run) the cycle means nothing; the step's own time stands in."""
        if self._last_step is None:
            return
        start, own, engine = self._last_step
        cycle = now - start
        self.scheduler.observe_step(cycle if cycle <= own + MAX_CYCLE_OVERHEAD else own)
        if log.isEnabledFor(logging.DEBUG):
            s = self.scheduler.last_step_stats
            log.debug("step: %d decodes, %d prefill tokens (budget %d): engine %.1f ms, own %.1f ms, cycle %.1f ms",
                      s.num_decodes, s.num_prefill_tokens, s.prefill_budget, engine * 1e3, own * 1e3, cycle * 1e3)
        self._last_step = None

    def _retire(self, request: Request, now: float) -> None:
        request.timings.finished_time = now
        self.runner.release(request.request_id)
        reason = request.finish_reason or "unknown"
        self.stats.finished_by_reason[reason] = self.stats.finished_by_reason.get(reason, 0) + 1

    def _record_step(self, out, seconds: float) -> None:
        self.stats.steps += 1
        self.stats.step_seconds += seconds
        if any(s.num_new_tokens - len(s.proposed) > 1 for s in out.scheduled):
            self.stats.prefill_seconds += seconds
        else:
            self.stats.decode_seconds += seconds


def _stamp_token(request: Request, now: float) -> None:
    """The request gained tokens at `now` (its first-token and inter-token times)."""
    request.timings.first_token_time = request.timings.first_token_time or now
    request.timings.token_times.append(now)
