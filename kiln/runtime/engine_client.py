"""EngineClient: the one loop that steps the engine core, for every front end.

`LLM.generate`, `LLM.stream`, the HTTP server and the Triton backend all submit requests here;
each request names a sink (kiln/runtime/sinks.py) that receives its deltas. One thread at a time
steps the core: it starts when work arrives and exits when the engine is idle and no command
waits, so an idle LLM holds no thread. The core, the output processor and the sinks are touched
by that thread only; other threads talk to it through the command queue, and learn about the
engine only from what it publishes: `snapshot` (an immutable EngineSnapshot, replaced after every
loop iteration) and `last_step` (the last step's StepReport, also handed to step listeners).

Failure policy: when a step raises, every request in flight ends at once: its sink gets an
EngineError, its KV blocks are freed, and the failure is counted (engine_failures). The client
stays usable: the next request is scheduled on a clean pool. Nothing is retried, since a
half-run step may have sampled tokens that were never delivered.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from kiln.runtime.engine_stats import ERROR, EngineSnapshot, LoopCounters, StepReport, take_snapshot
from kiln.runtime.outputs import CompletionOutput, StreamDelta
from kiln.runtime.request import Request, RequestStatus
from kiln.runtime.sinks import AsyncSink, CompletionSink, Sink
from kiln.runtime.step_io import RequestDelta

log = logging.getLogger("kiln")


class EngineError(RuntimeError):
    """The engine failed mid-step; every request in flight at that moment ends with this error."""


class ClientClosed(RuntimeError):
    """The client was shut down; it takes no new requests."""


@dataclass(frozen=True)
class _Add:
    entries: tuple[tuple[Request, Sink], ...]


@dataclass(frozen=True)
class _Finish:
    request_id: str
    status: RequestStatus


class EngineClient:
    def __init__(self, llm):
        self.llm, self.core, self.outputs = llm, llm.core, llm.outputs
        self._counters = LoopCounters()
        self._prefix_cache = False                # whether snapshots carry the prefix cache's hashes
        # NOTE: taken here, before any engine thread runs; then replaced whole: readers see old or new.
        self.snapshot: EngineSnapshot = take_snapshot(self.core, self._counters)
        self.last_step = StepReport(0, 0, 0, 0.0)
        self.step_listeners: list[Callable[[StepReport], None]] = []
        self.snapshot_listeners: list[Callable[[EngineSnapshot], None]] = []
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()             # guards _thread and _closed
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- any thread ---------------------------------------------------------------------------
    def submit(self, request: Request, sink: Sink) -> None:
        self.submit_all([(request, sink)])

    def submit_all(self, entries: list[tuple[Request, Sink]]) -> None:
        """Requests submitted together join the same step."""
        self._command(_Add(tuple(entries)))

    def abort(self, request_id: str) -> None:
        """Ends the request (finish_reason "abort"); its blocks are free within one step.
        A no-op once the client is shut down (the request has ended already)."""
        self._command(_Finish(request_id, RequestStatus.FINISHED_ABORTED), refuse_when_closed=False)

    def timeout(self, request_id: str) -> None:
        """Ends the request with finish_reason "timeout"; its sink gets a final delta."""
        self._command(_Finish(request_id, RequestStatus.FINISHED_TIMEOUT), refuse_when_closed=False)

    def make_request(self, prompt, params, request_id: str | None = None) -> Request:
        return self.llm.make_request(prompt, params, request_id)

    async def stream(self, request: Request) -> AsyncIterator[StreamDelta]:
        """The request's deltas. A consumer that stops iterating aborts the request."""
        sink = AsyncSink()
        self.submit(request, sink)
        finished = False
        try:
            while not finished:
                item = await sink.inbox.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request.request_id)

    def complete(self, requests: list[Request]) -> list[CompletionOutput]:
        """Blocks until every request is done; outputs in request order. The first error raises
        (after aborting the others)."""
        sinks = [CompletionSink(r, self.outputs) for r in requests]
        self.submit_all(list(zip(requests, sinks)))
        try:
            return [s.result() for s in sinks]
        except BaseException:               # an error, or Ctrl-C while waiting
            for r in requests:
                self.abort(r.request_id)
            raise

    def publish_prefix_cache(self) -> None:
        """From the next loop iteration on, snapshots carry a view of the prefix cache's hashes
        (snapshot.prefix_cache), copied whenever the cache changed; for admission control."""
        self._prefix_cache = True

    def backlog(self) -> int:
        """Requests not running yet: commands not taken up, plus the scheduler's waiting queue."""
        return self._commands.qsize() + self.snapshot.num_waiting

    def shutdown(self) -> None:
        """Stops the loop; requests still in flight end with ClientClosed."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            thread.join()
        self._drain_commands()                # no thread runs now: this one may touch the core
        self._fail_all(ClientClosed("the engine client shut down"), count_failure=False)

    def _command(self, command, refuse_when_closed: bool = True) -> None:
        with self._lock:
            if self._closed:
                if not refuse_when_closed:
                    return
                raise ClientClosed("the engine client is shut down; it takes no new requests")
            self._commands.put(command)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
                self._thread.start()

    # -- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                self._iterate()
            except Exception as e:            # a bug outside the step: end the requests, not the loop
                log.exception("engine loop iteration failed")
                self._fail_all(EngineError(f"engine loop failure: {type(e).__name__}: {e}"))
            with self._lock:
                # NOTE: decided under the lock _command() holds while it enqueues, so a command
                # is either seen here or finds no thread and starts a new one.
                if self._closed or (not self.core.has_unfinished() and self._commands.empty()):
                    self._thread = None
                    return

    def _iterate(self) -> None:
        self._drain_commands()
        self._abort_cancelled()
        if self.core.has_unfinished():
            self._step()
        self._publish()

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                for request, sink in command.entries:
                    self._add(request, sink)
            else:
                self._finish(command.request_id, command.status)

    def _add(self, request: Request, sink: Sink) -> None:
        try:
            self.core.add_request(request)
        except ValueError as e:               # it can never run (e.g. longer than the context)
            self._counters.count_finished(ERROR)
            _fail(sink, e)
            return
        self.outputs.add(request)
        self._sinks[request.request_id] = sink

    def _finish(self, request_id: str, status: RequestStatus) -> None:
        request = self.core.scheduler.get_request(request_id)
        if request is None:                   # finished already, or never added
            return
        self.core.finish(request_id, status)
        self._deliver(self.outputs.aborted(request))

    def _abort_cancelled(self) -> None:
        for request_id, sink in list(self._sinks.items()):
            if sink.cancelled():
                self._finish(request_id, RequestStatus.FINISHED_ABORTED)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            deltas = [self._process(d) for d in self.core.step()]
        except Exception as e:                # the failure policy: see the module docstring
            log.exception("engine step failed; failing the %d requests in flight", len(self._sinks))
            self._fail_all(EngineError(f"engine failure: {type(e).__name__}: {e}"))
            return
        self._report_step(time.perf_counter() - t0)
        for delta in deltas:
            self._deliver(delta)

    def _process(self, step_delta: RequestDelta) -> StreamDelta:
        delta, stop = self.outputs.process(step_delta)
        if stop is not None:                  # a stop string ended a request the engine still runs
            self.core.finish(delta.request_id, RequestStatus.FINISHED_STOPPED, stop_reason=stop)
        return delta

    def _deliver(self, delta: StreamDelta) -> None:
        sink = self._sinks.get(delta.request_id)
        if sink is None:
            return
        try:
            sink.deliver(delta)
        except Exception as e:                # its consumer is gone: stop spending steps on it
            log.warning("dropping request %s: %s", delta.request_id, e)
            if not delta.finished:
                self.core.finish(delta.request_id, RequestStatus.FINISHED_ABORTED)
                self._retire(delta.request_id, "abort")
                return
        if delta.finished:
            self._retire(delta.request_id, delta.finish_reason or "unknown")

    def _retire(self, request_id: str, reason: str) -> None:
        self._sinks.pop(request_id, None)
        self.outputs.forget(request_id)
        self._counters.count_finished(reason)

    def _fail_all(self, error: Exception, count_failure: bool = True) -> None:
        if count_failure:
            self._counters.engine_failures += 1
        for request_id in list(self.core.scheduler.requests):
            self.core.abort(request_id)       # frees its KV blocks
        for request_id, sink in list(self._sinks.items()):
            self._retire(request_id, ERROR)
            _fail(sink, error)

    def _report_step(self, seconds: float) -> None:
        s = self.core.scheduler.last_step_stats
        self._counters.steps += 1
        self._counters.scheduled_sequences += s.batch_size
        report = StepReport(s.batch_size, s.num_scheduled_tokens, s.num_prefill_chunks, seconds)
        self.last_step = report
        for listener in self.step_listeners:
            listener(report)

    def _publish(self) -> None:
        snapshot = take_snapshot(self.core, self._counters, self._prefix_cache)
        if snapshot == self.snapshot:
            return
        self.snapshot = snapshot
        for listener in self.snapshot_listeners:
            listener(snapshot)


def _fail(sink: Sink, error: Exception) -> None:
    try:
        sink.fail(error)
    except Exception as e:                    # its consumer is gone; nothing more to tell it
        log.warning("could not report %r to a request's sink: %s", error, e)
