"""AsyncEngine: the engine core stepping on a background thread, streams on asyncio queues.

The one narrow client the server and the Triton backend use: generate() yields StreamDeltas;
abort() (or a consumer that stops iterating) frees the request's blocks within one step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator

from kiln.runtime.outputs import StreamDelta
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams

log = logging.getLogger("kiln")


class AsyncEngine:
    def __init__(self, llm):
        self.llm, self.core, self.outputs = llm, llm.core, llm.outputs
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
        self._thread.start()

    def generate(self, prompt, params: SamplingParams, request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        return self.stream(self.llm.make_request(prompt, params, request_id))

    async def stream(self, request: Request) -> AsyncIterator[StreamDelta]:
        """Stream a request's deltas. A consumer that stops iterating aborts the request; its KV
        blocks are free within one engine step."""
        inbox: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = (asyncio.get_running_loop(), inbox)
        self._commands.put(("add", request))
        finished = False
        try:
            while not finished:
                item = await inbox.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:        # the consumer went away: free its blocks
                self.abort(request.request_id)
            self._streams.pop(request.request_id, None)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stopped = True
        self._commands.put(("stop", None))
        self._thread.join(timeout=5)

    # -- engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopped:
            self._drain_commands(block=not self.core.has_unfinished())
            if self.core.has_unfinished():
                try:
                    self._step()
                except Exception as e:      # an engine failure must not leave streams hanging
                    log.exception("engine step failed; failing the requests in flight")
                    self._fail_all(e)
            self._after_step()

    def _step(self) -> None:
        for delta in self.core.step():
            request_id = delta.request.request_id
            self._send(request_id, self.outputs.process(delta))
            if delta.request.is_finished:
                self.outputs.forget(request_id)     # a long-running server must not keep it

    def _after_step(self) -> None:
        """Hook for subclasses (statistics snapshots)."""

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self.core.scheduler.requests):
            self.core.abort(request_id)
            self.outputs.forget(request_id)
            self._send(request_id, RuntimeError(f"engine failure: {error}"))

    def _drain_commands(self, block: bool) -> None:
        while True:
            try:
                cmd, arg = self._commands.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if cmd == "add":
                self._add(arg)
            elif cmd == "abort":
                self._abort(arg)

    def _add(self, request: Request) -> None:
        try:
            self.core.add_request(request)
        except ValueError as e:
            self._send(request.request_id, e)
            return
        self.outputs.add(request)

    def _abort(self, request_id: str) -> None:
        request = self.core.scheduler.get_request(request_id)
        self.core.abort(request_id)
        self.outputs.forget(request_id)
        if request is not None:
            self._send(request_id, self.outputs.aborted(request))

    def _send(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, inbox = stream
            loop.call_soon_threadsafe(inbox.put_nowait, item)
