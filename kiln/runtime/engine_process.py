"""The engine core in a process of its own, behind the engine client's interface.

`kiln serve` runs the engine here by default, as vLLM v1 and SGLang do: the API process parses
bodies, renders templates, tokenizes and frames the streams; the engine process
(engine_worker.py) schedules and runs steps, detokenizes, and sends each loop iteration's new
deltas for all its requests in one message (engine_wire.py). The two never share a GIL: a busy
event loop does not hold the engine's Python between its kernels, and a step does not hold the
event loop. Detokenizing stays with the engine because a stop string must end its request before
the next step is scheduled, without a round trip.

`EngineProcess` is what the server holds in place of an `LLM` (a Frontend: artifact, tokenizer,
make_request); its `client` is an `EngineProcessClient`, which front ends use exactly as they use
an in-process `EngineClient`: submit, stream, complete, abort, timeout, snapshot, last_step, the
step and snapshot listeners, fault, backlog, publish_prefix_cache, shutdown.

Faults: when the engine process faults (engine_client.py's policy) its fault arrives here; when
it dies (a native crash, the OOM killer) the pipe's end says so: `fault` names the exit code and
every request in flight ends with EngineFault, so /health answers 503 and an orchestrator
replaces the server. Requests refused by a client that is shut down get ClientClosed.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

from kiln.config import RuntimeConfig
from kiln.contract.artifact import EngineArtifact
from kiln.runtime.engine_client import ClientClosed, EngineFault, StreamingClient, fail_sink
from kiln.runtime.engine_stats import EngineSnapshot, StepReport
from kiln.runtime.engine_wire import FAILED, STARTED, Command, Delivery, EngineOutputs
from kiln.runtime.engine_worker import run_engine_worker
from kiln.runtime.frontend import Frontend
from kiln.runtime.outputs import CompletionOutput, StreamDelta
from kiln.runtime.request import Request, RequestStatus
from kiln.runtime.sinks import CompletionSink, Sink
from kiln.tokenizer import Tokenizer

log = logging.getLogger("kiln")

SHUTDOWN_GRACE = 10.0     # seconds the engine process gets to end its requests and exit
START_POLL = 0.5          # seconds between checks that a loading engine process still lives


class EngineProcess(Frontend):
    """An artifact served by an engine in a child process: what a front end holds instead of an LLM."""

    def __init__(self, artifact: str | Path, config: RuntimeConfig | None = None, log_level: str = "info"):
        # NOTE: the manifest and tokenizer here; the child verifies the files' checksums itself.
        loaded = EngineArtifact.load(artifact, verify=False)
        self.process, commands, outputs = _spawn()
        try:
            commands.send((str(artifact), config or RuntimeConfig(), log_level))
            super().__init__(loaded, Tokenizer(loaded.tokenizer_dir))
            snapshot = _await_start(outputs, self.process)
        except BaseException:
            self.process.kill()
            raise
        self.client = EngineProcessClient(self, commands, outputs, self.process, snapshot)

    def shutdown(self) -> None:
        self.client.shutdown()


def _spawn() -> tuple[subprocess.Popen, Connection, Connection]:
    """The engine process, started fresh (`python -m kiln.runtime.engine_worker`: no fork of a
    process that runs threads, and no re-import of the caller's main module, as multiprocessing's
    spawn would), and a pipe each way."""
    commands_read, commands_write = os.pipe()
    outputs_read, outputs_write = os.pipe()
    process = subprocess.Popen([sys.executable, "-m", "kiln.runtime.engine_worker", str(commands_read),
                                str(outputs_write)], pass_fds=(commands_read, outputs_write),
                               stdin=subprocess.DEVNULL)
    os.close(commands_read)
    os.close(outputs_write)
    return process, Connection(commands_write, readable=False), Connection(outputs_read, writable=False)


def _await_start(outputs: Connection, process: subprocess.Popen) -> EngineSnapshot:
    """The engine's first snapshot once it has loaded; what it raised if it could not."""
    while not outputs.poll(START_POLL):
        if process.poll() is not None:
            raise RuntimeError(f"the engine process exited (code {process.returncode}) while loading the "
                               "artifact; its log above says why")
    kind, payload = outputs.recv()
    if kind == FAILED:
        raise payload
    assert kind == STARTED, kind
    return payload


class EngineProcessClient(StreamingClient):
    def __init__(self, front: EngineProcess, commands, outputs, process, snapshot: EngineSnapshot):
        super().__init__(front)
        self.snapshot = snapshot
        self.last_step = StepReport(0, 0, 0, 0.0)
        self.step_listeners: list = []
        self.snapshot_listeners: list = []
        self.fault: str | None = None
        self._step_timeout: float | None = None
        self._commands, self._process = commands, process
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()                  # guards _in_flight, _closed, fault
        self._in_flight: dict[str, tuple[Request, Sink]] = {}
        self._closed = False
        self._sent, self._taken = 0, 0
        self._reader = threading.Thread(target=self._read, args=(outputs,), name="kiln-engine-reader", daemon=True)
        self._reader.start()

    # -- any thread ---------------------------------------------------------------------------
    @property
    def step_timeout(self) -> float | None:
        return self._step_timeout

    @step_timeout.setter
    def step_timeout(self, seconds: float | None) -> None:
        self._step_timeout = seconds
        self._send((Command.STEP_TIMEOUT, seconds))

    def submit_all(self, entries: list[tuple[Request, Sink]]) -> None:
        """Requests submitted together join the same step."""
        with self._lock:
            if self.fault is not None:
                raise EngineFault(self.fault)
            if self._closed:
                raise ClientClosed("the engine client is shut down; it takes no new requests")
            for request, sink in entries:
                self._in_flight[request.request_id] = (request, sink)
            self._sent += len(entries)
        self._send((Command.ADD, [(request, isinstance(sink, CompletionSink)) for request, sink in entries]))

    def _finish_command(self, request_id: str, status: RequestStatus) -> None:
        if not self._closed and self.fault is None:
            self._send((Command.FINISH, request_id, status))

    def complete(self, requests: list[Request]) -> list[CompletionOutput]:
        """Blocks until every request is done; outputs in request order. The first error raises
        (after aborting the others)."""
        sinks = [CompletionSink(r) for r in requests]
        self.submit_all(list(zip(requests, sinks)))
        try:
            return [s.result() for s in sinks]
        except BaseException:
            for r in requests:
                self.abort(r.request_id)
            raise

    def publish_prefix_cache(self) -> None:
        self._send((Command.PREFIX_CACHE,))

    def backlog(self) -> int:
        """Requests not running yet: those sent but not taken in, plus the engine's waiting queue."""
        return max(self._sent - self._taken, 0) + self.snapshot.num_waiting

    def shutdown(self) -> None:
        """Stops the engine process; requests still in flight end with ClientClosed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._send((Command.SHUTDOWN,))
        try:
            self._process.wait(SHUTDOWN_GRACE)
        except subprocess.TimeoutExpired:     # stuck in a step: it cannot end its requests itself
            log.warning("the engine process did not stop within %g s; killing it", SHUTDOWN_GRACE)
            self._process.kill()
            self._process.wait()
        self._reader.join(SHUTDOWN_GRACE)
        self._fail_in_flight(ClientClosed("the engine client shut down"))

    def _send(self, command: tuple) -> None:
        try:
            with self._send_lock:
                self._commands.send(command)
        except (OSError, ValueError):         # the engine process is gone: the reader reports it
            pass

    # -- the reader thread --------------------------------------------------------------------
    def _read(self, outputs) -> None:
        while True:
            try:
                message = outputs.recv()
            except (EOFError, OSError):
                break
            try:
                self._apply(message)
            except Exception:                 # a listener's or a sink's bug: never the whole server
                log.exception("could not apply the engine process's outputs")
        self._engine_gone()

    def _apply(self, message: EngineOutputs) -> None:
        self._taken = message.taken
        for report in message.reports:
            self.last_step = report
            for listener in self.step_listeners:
                listener(report)
        if message.fault is not None and self.fault is None:
            self.fault = message.fault
        for delivery in message.deliveries:
            self._deliver(delivery)
        if message.snapshot is not None:
            self.snapshot = message.snapshot
            for listener in self.snapshot_listeners:
                listener(message.snapshot)
        self._abort_cancelled()

    def _deliver(self, d: Delivery) -> None:
        entry = self._in_flight.get(d.request_id)
        if entry is None:
            return
        request, sink = entry
        if d.num_cached_tokens is not None:
            request.num_cached_tokens = d.num_cached_tokens
        if d.timings is not None:
            request.timings = d.timings
        if d.error is not None:
            self._drop(d.request_id)
            fail_sink(sink, d.error)
            return
        if d.output is not None:
            sink.output = d.output
        try:
            sink.deliver(d.delta)
        except Exception as e:                # its consumer is gone: stop spending steps on it
            log.warning("dropping request %s: %s", d.request_id, e)
            self._drop(d.request_id)
            if not d.delta.finished:
                self.abort(d.request_id)
            return
        if d.delta.finished:
            self._drop(d.request_id)

    def _abort_cancelled(self) -> None:
        for request_id, (_, sink) in list(self._in_flight.items()):
            if sink.cancelled():
                self.abort(request_id)

    def _drop(self, request_id: str) -> None:
        with self._lock:
            self._in_flight.pop(request_id, None)

    def _engine_gone(self) -> None:
        """The pipe ended: after a shutdown, or because the engine process died."""
        with self._lock:
            if not self._closed and self.fault is None:
                self.fault = f"the engine process exited (code {_exit_code(self._process)})"
                log.critical("%s; the server is not ready any more", self.fault)
        if self.fault is not None:
            self._fail_in_flight(EngineFault(self.fault))

    def _fail_in_flight(self, error: Exception) -> None:
        with self._lock:
            entries, self._in_flight = list(self._in_flight.values()), {}
        for _, sink in entries:
            fail_sink(sink, error)


def _exit_code(process: subprocess.Popen) -> int | None:
    try:
        return process.wait(1.0)
    except subprocess.TimeoutExpired:         # its pipe closed, yet it runs: say so
        return None
