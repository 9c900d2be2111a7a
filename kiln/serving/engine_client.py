"""The one narrow client the HTTP layer uses to reach the engine core.

It is the runtime's AsyncEngine (engine core stepping on its own thread) plus what a server needs:
requests built by the caller (so their timings and cached-token counts can be read once they
finish), a timeout that ends a request with status FINISHED_TIMEOUT, and an immutable snapshot of
the engine's counters published after every step, which the HTTP thread may read at any time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from kiln.runtime.async_engine import AsyncEngine
from kiln.runtime.request import Request, RequestStatus
from kiln.runtime.sampling_params import SamplingParams
from kiln.serving.requests import EngineLimits



@dataclass(frozen=True)
class EngineSnapshot:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_bytes_per_block: int = 0
    num_preemptions: int = 0
    kv_evictions: int = 0
    kv_allocation_failures: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0


@dataclass(frozen=True)
class StepReport:
    """One engine step, for the batch-size histogram and the prefill-rate estimate."""
    batch_size: int
    num_scheduled_tokens: int
    num_prefill_chunks: int
    seconds: float


class EngineClient(AsyncEngine):
    def __init__(self, llm):
        self.snapshot = EngineSnapshot()
        self.step_listeners: list[Callable[[StepReport], None]] = []
        self._timed_out: set[str] = set()
        core = llm.core
        self.limits = EngineLimits(core.scheduler.config.max_model_len, core.kv.num_blocks,
                                   core.kv.block_size, core.artifact.manifest.spec.vocab_size)
        super().__init__(llm)

    def make_request(self, prompt_ids, params: SamplingParams, request_id: str) -> Request:
        return self.llm.make_request(list(prompt_ids), params, request_id)

    def timeout(self, request_id: str) -> None:
        """End the request with finish_reason "timeout"; its stream gets a final delta."""
        self._timed_out.add(request_id)
        self.abort(request_id)

    # -- engine thread ------------------------------------------------------------------------
    def _step(self) -> None:
        t0 = time.perf_counter()
        super()._step()
        self._report_step(time.perf_counter() - t0)

    def _after_step(self) -> None:
        self._publish_snapshot()

    def _abort(self, request_id: str) -> None:
        status = RequestStatus.FINISHED_TIMEOUT if request_id in self._timed_out else RequestStatus.FINISHED_ABORTED
        self._timed_out.discard(request_id)
        request = self.core.scheduler.get_request(request_id)
        self.core.finish(request_id, status)
        self.outputs.forget(request_id)
        if request is not None:
            self._send(request_id, self.outputs.aborted(request))

    def _report_step(self, seconds: float) -> None:
        s = self.core.scheduler.last_step_stats
        report = StepReport(s.batch_size, s.num_scheduled_tokens, s.num_prefill_chunks, seconds)
        for listener in self.step_listeners:
            listener(report)

    def _publish_snapshot(self) -> None:
        # NOTE: one reference assignment; readers on other threads see the old or the new snapshot.
        kv, sched = self.core.kv, self.core.scheduler
        self.snapshot = EngineSnapshot(
            num_running=sched.num_running, num_waiting=sched.num_waiting,
            kv_blocks_total=kv.num_blocks, kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
            kv_bytes_per_block=self.core.plan.bytes_per_block, num_preemptions=sched.num_preemptions,
            kv_evictions=kv.pool.evictions, kv_allocation_failures=kv.allocation_failures,
            prefix_queries=kv.prefix_queries, prefix_hits=kv.prefix_hits)
