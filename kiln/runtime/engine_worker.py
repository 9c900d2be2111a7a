"""The engine process's side (see engine_process.py): an LLM and its EngineClient, driven by the
API process's commands, its outputs sent back once per loop iteration.

Threads here: the main thread reads commands and hands them to the engine client; the engine
client's own thread steps the core and, at the end of every iteration, sends what the iteration
produced (the Outbox); the watchdog's failures go out at once. Ctrl-C is the API process's to
handle: it tells this one to shut down, and when it dies without saying so its pipe's end ends
this process too.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection

from kiln.logs import configure_logging
from kiln.runtime.engine_client import ClientClosed, EngineError
from kiln.runtime.engine_wire import FAILED, STARTED, Command, Delivery, EngineOutputs, portable_error
from kiln.runtime.outputs import StreamDelta
from kiln.runtime.request import Request, RequestStatus

log = logging.getLogger("kiln.engine")

ORPHAN_GRACE = 10.0       # seconds an orphaned engine process gets to shut down before it exits hard


def run_engine_worker(commands, outputs, artifact: str, config, log_level: str) -> None:
    """The engine process's main: load, say so, then apply commands until shut down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(log_level)
    from kiln.runtime.llm import LLM

    try:
        llm = LLM(artifact, config)
    except BaseException as e:        # a refused artifact, a missing backend: the API process says why
        outputs.send((FAILED, portable_error(e)))
        return
    outbox = Outbox(outputs, llm.client)
    outputs.send((STARTED, llm.client.snapshot))
    try:
        _serve(llm, commands, outbox)
    finally:
        llm.client.shutdown()         # requests still in flight end with ClientClosed
        outbox.flush()


def _serve(llm, commands, outbox: Outbox) -> None:
    client = llm.client
    while True:
        try:
            command = commands.recv()
        except (EOFError, OSError):   # the API process is gone (even by SIGKILL: its pipe ends)
            _exit_soon(ORPHAN_GRACE)
            return
        kind = command[0]
        if kind == Command.SHUTDOWN:
            return
        if kind == Command.ADD:
            _add(llm, command[1], outbox)
        elif kind == Command.FINISH:
            request_id, status = command[1], command[2]
            (client.timeout if status is RequestStatus.FINISHED_TIMEOUT else client.abort)(request_id)
        elif kind == Command.STEP_TIMEOUT:
            client.step_timeout = command[1]
        elif kind == Command.PREFIX_CACHE:
            client.publish_prefix_cache()


def _add(llm, entries: list[tuple[Request, bool]], outbox: Outbox) -> None:
    ready = []
    for request, wants_output in entries:
        try:
            request.sampling_params = llm.bind(request.sampling_params)
        except ValueError as e:       # the API process bound it already: this is not expected
            outbox.fail(request.request_id, e)
            continue
        ready.append((request, ForwardingSink(request, outbox, llm.outputs if wants_output else None)))
    outbox.taken += len(entries)
    try:
        llm.client.submit_all(ready)
    except (EngineError, ClientClosed) as e:
        for request, _ in ready:
            outbox.fail(request.request_id, e)


class ForwardingSink:
    """A request's deltas into the outbox, with what the API process's copy of the request needs."""

    def __init__(self, request: Request, outbox: Outbox, outputs=None):
        self.request, self.outbox, self.outputs = request, outbox, outputs
        self._first = True

    def deliver(self, delta: StreamDelta) -> None:
        r = self.request
        d = Delivery(r.request_id, delta)
        if self._first or delta.finished:
            d.num_cached_tokens, d.timings, self._first = r.num_cached_tokens, r.timings, False
        if delta.finished:
            if self.outputs is not None:      # NOTE: on the engine thread, before the client forgets it
                d.output = self.outputs.result(r)
        self.outbox.add(d)

    def fail(self, error: Exception) -> None:
        self.outbox.fail(self.request.request_id, error)

    def cancelled(self) -> bool:
        return False


class Outbox:
    """What the engine produced since the last message; sent by `flush`, one message at a time."""

    def __init__(self, connection, client):
        self.connection, self.client = connection, client
        self.taken = 0
        self._lock = threading.Lock()
        self._deliveries: list[Delivery] = []
        self._reports = []
        self._sent_snapshot, self._sent_fault, self._sent_taken = client.snapshot, None, 0
        client.step_listeners.append(self._report)
        client.loop_listeners.append(self.flush)

    def add(self, delivery: Delivery) -> None:
        with self._lock:
            self._deliveries.append(delivery)

    def fail(self, request_id: str, error: Exception) -> None:
        """At once: failures come from the watchdog and from shutdown, outside the loop."""
        self.add(Delivery(request_id, error=portable_error(error)))
        self.flush()

    def _report(self, report) -> None:
        with self._lock:
            self._reports.append(report)

    def flush(self) -> None:
        with self._lock:
            snapshot, fault, taken = self.client.snapshot, self.client.fault, self.taken
            if not (self._deliveries or self._reports) and snapshot is self._sent_snapshot \
                    and fault == self._sent_fault and taken == self._sent_taken:
                return
            message = EngineOutputs(self._deliveries, self._reports,
                                    None if snapshot is self._sent_snapshot else snapshot, fault, taken)
            self._deliveries, self._reports = [], []
            self._sent_snapshot, self._sent_fault, self._sent_taken = snapshot, fault, taken
            try:
                self.connection.send(message)
            except (OSError, ValueError):     # the API process is gone; the main thread ends this one
                pass


def _exit_soon(seconds: float) -> None:
    """The API process is gone: nobody reads what this one would still send. A step that does
    not end (stuck in a kernel) must not keep it alive: exit hard after `seconds`."""
    timer = threading.Timer(seconds, os._exit, args=(1,))
    timer.daemon = True
    timer.start()


def main(argv: list[str]) -> None:
    """`python -m kiln.runtime.engine_worker COMMANDS_FD OUTPUTS_FD`: the pipes' ends the API
    process passed; the first command is (artifact, RuntimeConfig, log level)."""
    commands = Connection(int(argv[0]), writable=False)
    outputs = Connection(int(argv[1]), readable=False)
    artifact, config, log_level = commands.recv()
    run_engine_worker(commands, outputs, artifact, config, log_level)


if __name__ == "__main__":
    main(sys.argv[1:])
