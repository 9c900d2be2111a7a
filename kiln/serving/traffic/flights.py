"""A flight is one engine generation and everyone waiting on it.

Identical deterministic requests share one flight (single-flight), and a finished flight becomes a
Recording the response cache replays, so the renderer reads deltas from either in the same way.
The flight runs in its own task: a subscriber that leaves does not stop it while others remain,
and the last one to leave aborts it in the engine.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from kiln.runtime.outputs import StreamDelta
from kiln.runtime.request import Request


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


# What one position's TokenLogprobs holds in memory: the tuple, its float and list, and per top
# entry a (token id, logprob) tuple of an int and a float.
LOGPROBS_POSITION_BYTES, LOGPROBS_TOP_ENTRY_BYTES = 200, 130


def logprobs_nbytes(positions) -> int:
    """The memory of a delta's logprobs (None where a position has none)."""
    return sum(LOGPROBS_POSITION_BYTES + LOGPROBS_TOP_ENTRY_BYTES * len(lp.top) for lp in positions if lp is not None)


class Recording:
    """A finished generation, as the response cache stores it."""

    done, error = True, None

    def __init__(self, deltas: list[StreamDelta], usage: Usage):
        self.deltas, self.usage = tuple(deltas), usage
        self.parsed: dict = {}        # the reply's tool calls, parsed once (responses.Renderer.body)
        self.nbytes = 200 + sum(100 + 4 * len(d.text) + 8 * len(d.token_ids) + logprobs_nbytes(d.logprobs)
                                + logprobs_nbytes(d.prompt_logprobs or ()) for d in self.deltas)

    def subscribe(self) -> Subscription:
        return Subscription(self)

    async def changed(self) -> None:       # never waited on: a recording is done
        return None


class Flight:
    def __init__(self, client, request: Request, timeout: float | None,
                 on_first_token: Callable[[], None], on_done: Callable[[Flight], None],
                 after: asyncio.Event | None = None):
        """after: the request reaches the engine once this is set (a sibling choice's first delta,
        so that its prompt's blocks are in the prefix cache by then)."""
        self.client, self.request, self.timeout = client, request, timeout
        self.after = after
        self.first_delta = asyncio.Event()   # set at the first delta, or when the flight ends without one
        self.deltas: list[StreamDelta] = []
        self.done, self.cancelled = False, False
        self.error: Exception | None = None
        self._on_first_token, self._on_done = on_first_token, on_done
        self._subscribers = 0
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._deadline: asyncio.TimerHandle | None = None

    def start(self) -> Flight:
        loop = asyncio.get_running_loop()
        if self.timeout:
            self._deadline = loop.call_later(self.timeout, self.client.timeout, self.request.request_id)
        self._task = loop.create_task(self._run())
        # NOTE: a done-callback, not a finally: it runs even if the task is cancelled before it starts.
        self._task.add_done_callback(self._finish)
        return self

    @property
    def joinable(self) -> bool:
        return not self.cancelled and self.error is None

    @property
    def finish_reason(self) -> str | None:
        return self.deltas[-1].finish_reason if self.deltas and self.deltas[-1].finished else None

    @property
    def usage(self) -> Usage:
        completion = sum(len(d.token_ids) for d in self.deltas)
        return Usage(self.request.num_prompt_tokens, completion, self.request.num_cached_tokens)

    def recording(self) -> Recording:
        return Recording(self.deltas, self.usage)

    def subscribe(self) -> Subscription:
        self._subscribers += 1
        return Subscription(self, on_close=self._unsubscribe)

    async def changed(self) -> None:
        event = self._changed
        await event.wait()

    # -- the flight's task ---------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            if self.after is not None:
                await self.after.wait()
            async for delta in self.client.stream(self.request):
                if not self.deltas:
                    self._on_first_token()
                self._publish(delta)
        except Exception as e:                # e.g. the engine refused the request
            self.error = e

    def _finish(self, _task) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self.done = True
        self.first_delta.set()
        self._wake()
        self._on_done(self)

    def _publish(self, delta: StreamDelta) -> None:
        self.deltas.append(delta)
        self.first_delta.set()
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _unsubscribe(self) -> None:
        self._subscribers -= 1
        if self._subscribers == 0 and not self.done:
            self.cancelled = True             # nobody is listening: free its KV blocks now
            self._task.cancel()


class Subscription:
    """One reader of a flight or a recording, from its first delta."""

    def __init__(self, source: Flight | Recording, on_close: Callable[[], None] | None = None):
        self.source, self._on_close = source, on_close

    @property
    def usage(self) -> Usage:
        return self.source.usage

    async def deltas(self) -> AsyncIterator[StreamDelta]:
        i = 0
        while True:
            while i < len(self.source.deltas):
                yield self.source.deltas[i]
                i += 1
            if self.source.done:
                if self.source.error is not None:
                    raise self.source.error
                return
            await self.source.changed()

    def close(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()
