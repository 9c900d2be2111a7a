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

Faults: what that policy cannot absorb ends the loop for good, never silently. A step that raises
something other than an Exception (a native panic, a BaseException), an error while failing the
requests (or anywhere else in the loop's own bookkeeping), or a step that runs past
`step_timeout` seconds (a watchdog thread notices) sets `fault` to the reason: every request in
flight ends with EngineFault, new requests are refused with it, and the KV blocks are freed once
the engine thread gets control back. The loop is not restarted: after a panic or a failed
clean-up the core's state (scheduler, KV pool, the engine's device memory) cannot be trusted, and
a stuck step still owns the core (a thread cannot be killed), so a second loop would race it. A
front end reports the fault (the HTTP server's /health and /ready answer 503) so that an
orchestrator replaces the process.

`stream()` consumers also get their timeout without the engine thread: after `timeout(id)` the
stream ends with a finish_reason "timeout" delta of its own at most TIMEOUT_GRACE seconds later,
even if the loop never answers.
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


class EngineFault(EngineError):
    """The engine loop stopped for good (see `EngineClient.fault`); the client takes no new requests."""


class ClientClosed(RuntimeError):
    """The client was shut down; it takes no new requests."""


TIMEOUT_GRACE = 1.0       # seconds a timed-out stream waits for the engine's own final delta
_EXPIRED = object()       # put into a stream's inbox when its timeout's grace has passed


@dataclass(frozen=True)
class _Add:
    entries: tuple[tuple[Request, Sink], ...]


@dataclass(frozen=True)
class _Finish:
    request_id: str
    status: RequestStatus


class StreamingClient:
    """What every engine client offers a front end, over two primitives a subclass provides:
    `submit_all` (requests and their sinks) and `_finish_command` (end one request). The engine
    runs on a thread of this process (EngineClient) or in a process of its own
    (kiln/runtime/engine_process.py); front ends cannot tell them apart."""

    def __init__(self, front):
        self.front = front                       # make_request's owner: the LLM, or the engine process's front
        self._streams: dict[str, AsyncSink] = {}  # stream() consumers, for their HTTP-side timeout

    def submit_all(self, entries: list[tuple[Request, Sink]]) -> None:
        raise NotImplementedError

    def _finish_command(self, request_id: str, status: RequestStatus) -> None:
        raise NotImplementedError

    # -- any thread ---------------------------------------------------------------------------
    def submit(self, request: Request, sink: Sink) -> None:
        self.submit_all([(request, sink)])

    def abort(self, request_id: str) -> None:
        """Ends the request (finish_reason "abort"); its blocks are free within one step.
        A no-op once the client is shut down (the request has ended already)."""
        self._finish_command(request_id, RequestStatus.FINISHED_ABORTED)

    def timeout(self, request_id: str) -> None:
        """Ends the request with finish_reason "timeout"; its sink gets a final delta."""
        self._finish_command(request_id, RequestStatus.FINISHED_TIMEOUT)
        sink = self._streams.get(request_id)
        if sink is not None:                  # end the stream even if the loop never answers
            try:
                sink.loop.call_soon_threadsafe(sink.loop.call_later, TIMEOUT_GRACE, sink.inbox.put_nowait, _EXPIRED)
            except RuntimeError:              # its event loop is closed: nobody is waiting
                pass

    def make_request(self, prompt, params, request_id: str | None = None) -> Request:
        return self.front.make_request(prompt, params, request_id)

    async def stream(self, request: Request) -> AsyncIterator[StreamDelta]:
        """The request's deltas. A consumer that stops iterating aborts the request."""
        sink = AsyncSink()
        self.submit(request, sink)
        self._streams[request.request_id] = sink
        finished = False
        try:
            while not finished:
                item = await sink.inbox.get()
                if item is _EXPIRED:          # timed out, and the engine did not end it in time
                    item = StreamDelta(request.request_id, "", [], finished=True, finish_reason="timeout")
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self.abort(request.request_id)


class EngineClient(StreamingClient):
    def __init__(self, llm, step_timeout: float | None = None):
        super().__init__(llm)
        self.llm, self.core, self.outputs = llm, llm.core, llm.outputs
        # Seconds one step may run before the watchdog declares the engine stuck; None or 0: no
        # watchdog. Read when an engine thread starts, so set it before the first request.
        self.step_timeout = step_timeout
        self.fault: str | None = None             # why the loop stopped for good; None while healthy
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
        self._watchdog: threading.Thread | None = None
        self._closed = False
        self._step_started: float | None = None   # monotonic start of the step running now

        # Called on the engine thread once an iteration has delivered its deltas and published
        # its snapshot (the engine process forwards a step's outputs from here in one message).
        self.loop_listeners: list[Callable[[], None]] = []

    # -- any thread ---------------------------------------------------------------------------
    def submit_all(self, entries: list[tuple[Request, Sink]]) -> None:
        """Requests submitted together join the same step."""
        self._command(_Add(tuple(entries)))

    def _finish_command(self, request_id: str, status: RequestStatus) -> None:
        self._command(_Finish(request_id, status), refuse_when_closed=False)

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
        """Stops the loop; requests still in flight end with ClientClosed. With the engine faulted
        and its thread stuck in a step, it waits for nothing and leaves the core alone."""
        with self._lock:
            self._closed = True
            thread = self._thread
        while thread is not None and thread.is_alive():
            thread.join(0.1)
            if self.fault is not None and thread.is_alive():
                return                        # stuck in a step: its requests have ended already
        self._drain_commands()                # no thread runs now: this one may touch the core
        self._fail_all(ClientClosed("the engine client shut down"), count_failure=False)

    def _command(self, command, refuse_when_closed: bool = True) -> None:
        with self._lock:
            if self._closed or self.fault is not None:
                if not refuse_when_closed:
                    return
                if self.fault is not None:
                    raise EngineFault(self.fault)
                raise ClientClosed("the engine client is shut down; it takes no new requests")
            self._commands.put(command)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
                self._thread.start()
                if self.step_timeout:
                    self._watchdog = threading.Thread(target=self._watch, args=(self._thread, self.step_timeout),
                                                      name="kiln-engine-watchdog", daemon=True)
                    self._watchdog.start()

    # -- the watchdog thread (one per engine thread, while it lives) ----------------------------
    def _watch(self, thread: threading.Thread, limit: float) -> None:
        while thread.is_alive():
            thread.join(min(1.0, limit / 4))
            with self._lock:
                started = self._step_started
                if started is None or self.fault is not None or time.monotonic() - started <= limit:
                    continue
                # NOTE: decided under the lock _end_step() takes: the step is still running, so
                # the engine thread touches no sink until it returns and sees the fault.
                sinks = self._set_fault(f"an engine step has run for more than {limit:g} s (--step-timeout)")
            log.critical("engine step stuck for more than %g s: failing %d requests; the server is "
                         "not ready any more", limit, len(sinks))
            self._fail_sinks(sinks)
            return

    def _set_fault(self, reason: str) -> list[Sink]:
        """Under self._lock: the fault, and the sinks it ends (those in flight and those queued)."""
        self.fault = reason
        self._counters.engine_failures += 1
        sinks, self._sinks = list(self._sinks.values()), {}
        while True:                           # NOTE: no new command comes in: _command sees the fault
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                sinks.extend(sink for _, sink in command.entries)
        return sinks

    def _fail_sinks(self, sinks: list[Sink]) -> None:
        error = EngineFault(self.fault)
        for sink in sinks:
            self._counters.count_finished(ERROR)
            fail_sink(sink, error)

    # -- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:            # a panic, or a failure while failing the requests
            self._die(e)

    def _loop(self) -> None:
        while True:
            try:
                self._iterate()
            except Exception as e:            # a bug outside the step: end the requests, not the loop
                log.exception("engine loop iteration failed")
                self._fail_all(EngineError(f"engine loop failure: {type(e).__name__}: {e}"))
            if self.fault is not None:        # the watchdog gave up on a step that came back since
                self._free_all()
            self._notify_loop_listeners()     # what _await_batch delivered (an abort's final delta)
            with self._lock:
                # NOTE: decided under the lock _command() holds while it enqueues, so a command
                # is either seen here or finds no thread and starts a new one.
                if self._closed or self.fault is not None or (
                        not self.core.has_unfinished() and self._commands.empty()):
                    self._thread = None
                    return

    def _die(self, error: BaseException) -> None:
        """What escaped the loop: the fault, and the requests end; the thread exits."""
        log.critical("the engine loop died; the server is not ready any more", exc_info=error)
        with self._lock:
            sinks = self._set_fault(f"the engine loop died: {type(error).__name__}: {error}") \
                if self.fault is None else []
        self._fail_sinks(sinks)
        try:
            self._free_all()
        except BaseException:                 # nothing more to do: the process is to be replaced
            log.exception("could not free the KV blocks after the engine loop died")
        with self._lock:
            self._thread = None

    def _free_all(self) -> None:
        """After a fault: every request out of the core (its KV blocks freed)."""
        for request_id in list(self.core.scheduler.requests):
            self.core.abort(request_id)
            self.outputs.forget(request_id)
        self._publish()

    def _iterate(self) -> None:
        self._drain_commands()
        self._abort_cancelled()
        if self.core.has_unfinished():
            self._step()
        self._publish()
        self._await_batch()

    def _await_batch(self) -> None:
        """While the batch wait window holds the waiting prompts and nothing else ran, sleep
        until a command arrives or the window ends (runtime/batch_wait.py), instead of spinning."""
        sched = self.core.scheduler
        if sched.last_step_stats.batch_size or sched.batch_wait.remaining <= 0 or not self.core.has_unfinished():
            return
        try:
            command = self._commands.get(timeout=sched.batch_wait.remaining)
        except queue.Empty:
            return
        self._apply(command)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            self._apply(command)

    def _apply(self, command) -> None:
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
            fail_sink(sink, e)
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
        self._step_started = time.monotonic()
        try:
            deltas = [self._process(d) for d in self.core.step()]
        except Exception as e:                # the failure policy: see the module docstring
            if self._end_step():
                return
            log.exception("engine step failed; failing the %d requests in flight", len(self._sinks))
            self._fail_all(EngineError(f"engine failure: {type(e).__name__}: {e}"))
            return
        if self._end_step():                  # the watchdog gave up on it: its requests ended
            return
        self._report_step(time.perf_counter() - t0)
        for delta in deltas:
            self._deliver(delta)

    def _end_step(self) -> bool:
        """The step is over; True when the engine faulted meanwhile (the watchdog)."""
        with self._lock:
            self._step_started = None
            return self.fault is not None

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
            fail_sink(sink, error)

    def _report_step(self, seconds: float) -> None:
        s = self.core.scheduler.last_step_stats
        if not s.batch_size:                  # nothing ran (the batch wait window held the prompts)
            return
        self._counters.steps += 1
        self._counters.scheduled_sequences += s.batch_size
        report = StepReport(s.batch_size, s.num_scheduled_tokens, s.num_prefill_chunks, seconds,
                            s.batch_wait_seconds)
        self.last_step = report
        for listener in self.step_listeners:
            listener(report)

    def _publish(self) -> None:
        snapshot = take_snapshot(self.core, self._counters, self._prefix_cache)
        if snapshot != self.snapshot:
            self.snapshot = snapshot
            for listener in self.snapshot_listeners:
                listener(snapshot)
        self._notify_loop_listeners()

    def _notify_loop_listeners(self) -> None:
        for listener in self.loop_listeners:
            listener()


def fail_sink(sink: Sink, error: Exception) -> None:
    try:
        sink.fail(error)
    except Exception as e:                    # its consumer is gone; nothing more to tell it
        log.warning("could not report %r to a request's sink: %s", error, e)
