"""The engine core stepping on a background thread, answering Triton requests through sinks.

It mirrors kiln.runtime.AsyncEngine, with callbacks instead of asyncio queues: Triton's execute()
only enqueues and returns, and every concurrent request joins the one in-flight batch that this
thread steps. The core, the output processor and the sinks are touched by this thread only.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from kiln.runtime.outputs import StreamDelta
from kiln.runtime.request import Request

log = logging.getLogger("kiln.triton")


class Sink(Protocol):
    """Where one request's replies go (a Triton response sender, or a list in tests)."""

    def deliver(self, delta: StreamDelta, batch_size: int) -> None: ...
    def fail(self, message: str) -> None: ...
    def cancelled(self) -> bool: ...
    def close_cancelled(self) -> None: ...


@dataclass
class EngineSnapshot:
    """The statistics published as metrics; cumulative fields only grow."""
    batch_size: int = 0                 # sequences in the last step (0 when idle)
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    steps: int = 0
    scheduled_sequences: int = 0        # summed over steps: / steps = mean batch size
    prefix_cache_queries: int = 0       # prompt tokens looked up
    prefix_cache_hits: int = 0          # prompt tokens found
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)   # finish reason -> requests


class EngineLoop:
    def __init__(self, llm, publish: Callable[[EngineSnapshot], None] = lambda snapshot: None,
                 publish_interval: float = 0.05):
        self.llm, self.core, self.outputs = llm, llm.core, llm.outputs
        self._publish_fn, self._publish_interval = publish, publish_interval
        self._published_at = 0.0
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._stats = EngineSnapshot()
        self._published: EngineSnapshot | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kiln-triton-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request, sink: Sink) -> None:
        self._commands.put(("add", (request, sink)))

    def backlog(self) -> int:
        """Requests not running yet: submitted but not added, plus the scheduler's waiting queue."""
        return self._commands.qsize() + self.core.scheduler.num_waiting

    def shutdown(self) -> None:
        self._stopped = True
        self._commands.put(("stop", None))
        self._thread.join(timeout=10)

    # -- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped:
            try:
                self._iterate()
            except Exception as e:     # an engine failure must not leave streams hanging
                log.exception("engine step failed")
                self._fail_all(f"kiln engine error: {e}")

    def _iterate(self) -> None:
        self._drain_commands(block=not self.core.has_unfinished())
        self._abort_cancelled()
        if self.core.has_unfinished():
            self._step()
        self._publish()

    def _drain_commands(self, block: bool) -> None:
        while True:
            try:
                cmd, arg = self._commands.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if cmd == "add":
                self._add(*arg)

    def _add(self, request: Request, sink: Sink) -> None:
        try:
            self.core.add_request(request)
        except ValueError as e:        # e.g. a prompt longer than the context
            sink.fail(str(e))
            return
        self.outputs.add(request)
        self._sinks[request.request_id] = sink

    def _abort_cancelled(self) -> None:
        for request_id, sink in list(self._sinks.items()):
            if sink.cancelled():
                self._abort(request_id)
                sink.close_cancelled()

    def _abort(self, request_id: str) -> None:
        """Frees the request's KV blocks at once; its sink gets nothing more."""
        self.core.abort(request_id)
        self.outputs.forget(request_id)
        self._sinks.pop(request_id, None)
        self._count_finished("abort")

    def _step(self) -> None:
        deltas = self.core.step()
        batch_size = self.core.scheduler.last_step_stats.batch_size
        self._stats.steps += 1
        self._stats.scheduled_sequences += batch_size
        for delta in deltas:
            self._deliver(self.outputs.process(delta), batch_size)

    def _deliver(self, delta: StreamDelta, batch_size: int) -> None:
        sink = self._sinks.get(delta.request_id)
        if sink is None:
            return
        try:
            sink.deliver(delta, batch_size)
        except Exception as e:         # the client is gone: stop spending steps on it
            log.warning("dropping request %s: %s", delta.request_id, e)
            if not delta.finished:
                self._abort(delta.request_id)
                return
        if delta.finished:
            self._sinks.pop(delta.request_id, None)
            self.outputs.forget(delta.request_id)
            self._count_finished(delta.finish_reason or "unknown")

    def _count_finished(self, reason: str) -> None:
        self._stats.finished[reason] = self._stats.finished.get(reason, 0) + 1

    def _fail_all(self, message: str) -> None:
        for request_id, sink in list(self._sinks.items()):
            self._abort(request_id)
            sink.fail(message)

    # -- statistics ---------------------------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        kv, sched = self.core.kv.stats(), self.core.scheduler
        s = self._stats
        return EngineSnapshot(
            batch_size=sched.last_step_stats.batch_size if self.core.has_unfinished() else 0,
            num_running=sched.num_running, num_waiting=sched.num_waiting,
            kv_blocks_used=kv.used, kv_blocks_free=kv.free, steps=s.steps,
            scheduled_sequences=s.scheduled_sequences, prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits, preemptions=sched.num_preemptions, finished=dict(s.finished))

    def _publish(self) -> None:
        """At most every publish_interval while busy (each metric update is a round trip to the
        Triton process), and always once the engine goes idle, so idle values are exact."""
        now = time.monotonic()
        if self.core.has_unfinished() and now - self._published_at < self._publish_interval:
            return
        snapshot = self.snapshot()
        if snapshot != self._published:
            self._publish_fn(snapshot)
            self._published, self._published_at = snapshot, now
