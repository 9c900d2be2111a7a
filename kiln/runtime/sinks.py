"""Where one request's output goes. The engine client's loop is the only caller, on its thread;
each sink hands the output to its consumer's own world (an asyncio loop, a waiting caller,
Triton's response sender)."""

from __future__ import annotations

import asyncio
import threading
from typing import Protocol

from kiln.runtime.outputs import CompletionOutput, OutputProcessor, StreamDelta
from kiln.runtime.request import Request


class Sink(Protocol):
    def deliver(self, delta: StreamDelta) -> None:
        """A delta of the request (the last one has finished=True). Raising drops the request."""

    def fail(self, error: Exception) -> None:
        """The request ended without a final delta: refused when added, or the engine failed."""

    def cancelled(self) -> bool:
        """Polled every loop iteration: True aborts the request (its final delta still comes)."""


class AsyncSink:
    """Deltas into an asyncio queue, from the engine thread into the consumer's event loop."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.inbox: asyncio.Queue = asyncio.Queue()

    def deliver(self, delta: StreamDelta) -> None:
        # NOTE: raises RuntimeError once the consumer's loop is closed; the client then drops it.
        self.loop.call_soon_threadsafe(self.inbox.put_nowait, delta)

    def fail(self, error: Exception) -> None:
        self.loop.call_soon_threadsafe(self.inbox.put_nowait, error)

    def cancelled(self) -> bool:
        return False


class CompletionSink:
    """The whole output of one request, for a caller that blocks until it is done. Without
    `outputs` (the engine in another process), whoever delivers the final delta sets `output`
    first."""

    def __init__(self, request: Request, outputs: OutputProcessor | None = None):
        self.request, self.outputs = request, outputs
        self.output: CompletionOutput | None = None
        self.error: Exception | None = None
        self.done = threading.Event()

    def deliver(self, delta: StreamDelta) -> None:
        if delta.finished:
            if self.outputs is not None:
                # NOTE: on the engine thread, before the client forgets the request's detokenizer.
                self.output = self.outputs.result(self.request)
            self.done.set()

    def fail(self, error: Exception) -> None:
        self.error = error
        self.done.set()

    def cancelled(self) -> bool:
        return False

    def result(self) -> CompletionOutput:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.output
