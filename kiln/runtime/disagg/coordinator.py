"""DisaggregatedLLM: a prefill worker and a decode worker (processes, workers.py) over one
artifact, and the coordinator that routes each request from one to the other.

A request goes to the prefill worker; its handover (KV blocks in shared memory, the first token)
goes on to the decode worker, which runs it to the end. Greedy output is the colocated runtime's:
the same engine computes the same K/V, and the copy is exact. Failure: a worker that dies ends
every request not yet done (its result says so, and WorkerFailed is raised), the other worker is
told to abort them, and the coordinator unlinks every segment not imported yet. The coordinator
takes no new request after that: the workers are to be replaced.

Segments: every handover of one DisaggregatedLLM is named under its session's prefix
(handover.session_prefix), so the coordinator finds them all without having read them: when a
worker fails, at shutdown, and when the object is collected or the interpreter exits without a
shutdown (a finalizer), it stops the workers and unlinks every segment of its session. A handover
naming a segment outside the session is dropped without touching that segment.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import uuid
import weakref
from multiprocessing.connection import wait
from pathlib import Path

from kiln.config import RuntimeConfig
from kiln.runtime.disagg.handover import Handover, discard, owned_segment, session_prefix, sweep
from kiln.runtime.disagg.workers import worker_main
from kiln.runtime.sampling_params import SamplingParams

START_TIMEOUT = 300.0


class WorkerFailed(RuntimeError):
    """A worker process died; the requests it held end with this error."""


class DisaggregatedLLM:
    def __init__(self, artifact: str | Path, config: RuntimeConfig = RuntimeConfig()):
        ctx = mp.get_context("spawn")          # NOTE: no fork: the parent may hold threads and sessions
        self.workers: dict[str, tuple[mp.Process, object]] = {}
        self.prefix = session_prefix(uuid.uuid4().hex[:12])
        self.failed: WorkerFailed | None = None
        self._params: dict[str, SamplingParams] = {}
        self._handovers: dict[str, Handover] = {}       # sent to the decode worker, not done yet
        self._aborting: set[str] = set()                # aborted, their last answer not in yet
        self.results: dict[str, tuple[list[int], str]] = {}
        self.token_times: dict[str, list[float]] = {}   # monotonic, per token: for latency figures
        for role in ("prefill", "decode"):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(role, str(artifact), config, child, self.prefix),
                               name=f"kiln-{role}", daemon=True)
            proc.start()
            child.close()
            self.workers[role] = (proc, parent)
            if len(self.workers) == 1:
                # NOTE: the finalizer holds the workers and the prefix, never self
                self._finalizer = weakref.finalize(self, _stop_and_sweep, self.workers, self.prefix)
        for role in self.workers:
            self._expect(role, "ready", START_TIMEOUT)

    # -- requests -----------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams) -> str:
        if self.failed is not None:
            raise self.failed
        request_id = f"disagg-{uuid.uuid4().hex[:12]}"
        self._params[request_id] = params
        self._send("prefill", ("prefill", request_id, list(prompt_ids), params))
        return request_id

    def abort(self, request_id: str) -> None:
        """Ends the request ("abort"); both workers free its blocks within a step."""
        if request_id not in self._params:
            return
        self._aborting.add(request_id)
        for role in self.workers:
            self._send(role, ("abort", request_id))

    def wait(self, request_ids: list[str], timeout: float = 300.0) -> list[tuple[list[int], str]]:
        """(tokens, finish reason) of each request, in order, once all are done."""
        while not all(r in self.results for r in request_ids):
            self._pump(timeout)
        return [self.results.pop(r) for r in request_ids]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        ids = [self.submit(p, params) for p in prompts]
        return [tokens for tokens, _ in self.wait(ids)]

    def handed_over(self, request_id: str) -> bool:
        return request_id in self._handovers

    def stats(self, role: str) -> tuple[int, int, bool]:
        """(free KV blocks, total, has unfinished requests) of one worker."""
        self._send(role, ("stats",))
        return self._expect(role, "stats", 60)[1:]

    def shutdown(self) -> None:
        """Stops both workers, then unlinks every segment of this session: the handovers sent to
        the decode worker and not imported, and those never read (still in a pipe)."""
        self._finalizer()
        for handover in self._handovers.values():     # where the system lists no segments to sweep
            discard(handover)
        self._handovers.clear()

    # -- the pipes ----------------------------------------------------------------------------
    def _pump(self, timeout: float) -> None:
        conns = {conn: role for role, (_, conn) in self.workers.items()}
        ready = wait(list(conns), timeout)
        if not ready:
            raise TimeoutError(f"no worker answered within {timeout:g} s")
        for conn in ready:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                self._failed(conns[conn])
                return
            self._route(message)

    def _route(self, message) -> None:
        if message[0] == "handover":
            handover = message[1]
            if not isinstance(handover, Handover) or not owned_segment(handover.segment, self.prefix):
                return                                    # not this session's: never touched
            if handover.request_id not in self._params:  # its request already ended (a worker failed)
                discard(handover)
                return
            if handover.request_id in self._aborting:     # handed over before the abort reached it
                discard(handover)
                self._finish(handover.request_id, [], "abort")
                return
            self._handovers[handover.request_id] = handover
            self.token_times[handover.request_id] = [time.monotonic()]     # the first token, about
            self._send("decode", ("decode", handover, self._params[handover.request_id]))
        elif message[0] == "done":
            _, request_id, tokens, reason, times = message
            if request_id in self._params:               # else: the other worker's answer came first
                self.token_times[request_id] = [*self.token_times.pop(request_id, []), *times]
                self._finish(request_id, tokens, reason)

    def _finish(self, request_id: str, tokens: list[int], reason: str) -> None:
        self._handovers.pop(request_id, None)
        self._params.pop(request_id)
        self._aborting.discard(request_id)
        self.results[request_id] = (tokens, reason)

    def _failed(self, role: str) -> None:
        """A worker died: every request not done ends with WorkerFailed, the other worker drops
        them, and no handed-over segment is left behind."""
        proc, _ = self.workers[role]
        proc.join(5)
        error = WorkerFailed(f"the {role} worker died (exit code {proc.exitcode})")
        other = "decode" if role == "prefill" else "prefill"
        for request_id in list(self._params):
            self.results[request_id] = ([], f"error: {error}")
            self._try_send(other, ("abort", request_id))
        self._params.clear()
        self._aborting.clear()
        for handover in self._handovers.values():
            discard(handover)
        self._handovers.clear()
        if not self.workers[other][0].is_alive() or role == "prefill":
            sweep(self.prefix)               # written by a dead worker, or unread: nobody imports them
        self.failed = error
        raise error

    def _try_send(self, role: str, message) -> None:
        try:
            self.workers[role][1].send(message)
        except OSError:
            pass

    def _send(self, role: str, message) -> None:
        proc, conn = self.workers[role]
        try:
            conn.send(message)
        except (BrokenPipeError, OSError):
            self._failed(role)

    def _expect(self, role: str, kind: str, timeout: float):
        _, conn = self.workers[role]
        while True:
            if not conn.poll(timeout):
                raise TimeoutError(f"the {role} worker did not answer {kind!r} within {timeout:g} s")
            try:
                message = conn.recv()
            except (EOFError, OSError):
                self._failed(role)
            if message[0] == kind:
                return message
            self._route(message)


def _stop_and_sweep(workers: dict, prefix: str) -> None:
    """Stop the workers (a stop message, then a kill past 10 s), then unlink every segment of the
    session: once no worker runs, none is being written or imported."""
    for role, (proc, conn) in workers.items():
        if proc.is_alive():
            try:
                conn.send(("stop",))
            except OSError:
                pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    sweep(prefix)
