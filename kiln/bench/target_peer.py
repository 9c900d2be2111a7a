"""Peers without in-flight batching (HF transformers `generate`, onnxruntime-genai's Generator):
one request at a time on a worker thread, each new token reported as it is produced.

Requests that arrive while one runs wait, as they would behind a server built on such a loop;
that wait is part of their TTFT. A client that goes away stops the generation at its next token.
"""

from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Callable

from kiln.bench.records import Chunk
from kiln.bench.text import Prompt
from kiln.bench.workloads import RequestSpec

_DONE = object()
Emit = Callable[[int], None]          # called from the worker thread with each step's new-token count


class SequentialPeer:
    name = "peer"

    def __init__(self, to_ids: Callable[[Prompt], list[int]], context_len: int, temperature: float):
        self.to_ids, self.context_len, self.temperature = to_ids, context_len, temperature
        self._lock = asyncio.Lock()

    def generate(self, ids: list[int], max_tokens: int, emit: Emit, stop: threading.Event) -> None:
        """Exactly max_tokens new tokens (EOS ignored) unless `stop` is set; on the worker thread."""
        raise NotImplementedError

    async def prepare(self) -> None:
        await asyncio.to_thread(self.generate, [1, 2, 3], 2, lambda n: None, threading.Event())

    def observer(self, interval: float):
        from kiln.bench.observe import Observer

        return Observer(interval)            # nothing to watch: there is no queue but the lock's

    async def stream(self, prompt: Prompt, spec: RequestSpec) -> AsyncIterator[Chunk]:
        if spec.json_schema:
            # Unconstrained tokens would be timed as if they were constrained: refuse instead.
            raise NotImplementedError(f"{self.name} cannot constrain its output to a JSON Schema")
        loop, inbox, stop = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()
        ids = self.to_ids(prompt)
        emit = (lambda n: loop.call_soon_threadsafe(inbox.put_nowait, n))
        async with self._lock:
            job = asyncio.ensure_future(asyncio.to_thread(self._run, ids, spec.max_tokens, emit, stop))
            try:
                while (item := await inbox.get()) is not _DONE:
                    yield Chunk(num_tokens=item)
                await job                       # re-raises a failure of the generation
            finally:
                stop.set()
                await asyncio.shield(asyncio.wait([job]))      # the next request waits for this one

    async def close(self) -> None:
        pass

    def _run(self, ids: list[int], max_tokens: int, emit: Emit, stop: threading.Event) -> None:
        try:
            self.generate(ids, max_tokens, emit, stop)
        finally:
            emit(_DONE)
