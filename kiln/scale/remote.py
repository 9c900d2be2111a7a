"""The ingress's side of one replica stream (messages.py): opened, raced, read, cancelled."""

from __future__ import annotations

from typing import AsyncIterator

from kiln.runtime.outputs import StreamDelta
from kiln.serving.traffic.flights import Usage

_END = ("end",)


class ReplicaFailed(RuntimeError):
    """The replica failed mid-stream (its engine, or the replica process itself)."""


class ReplicaStream:
    """One Serve streaming response. Items read ahead (the opening, the race for the first
    token) are buffered and replayed by items()."""

    def __init__(self, response):
        self._response = response            # a DeploymentResponseGenerator (or any async iterator)
        self._buffer: list[tuple] = []
        self.replica_id: str | None = None
        self.cancelled = False
        self.done = False                    # its last message was read: nothing to cancel

    async def _next(self) -> tuple:
        try:
            return await self._response.__anext__()
        except StopAsyncIteration:
            return _END
        except Exception as e:                # the replica died, or Ray could not reach it
            return ("failed", f"the replica failed: {type(e).__name__}: {e}")

    async def opening(self) -> tuple:
        """The first message: ("admitted", id) or ("refused", id, ...)."""
        item = await self._next()
        if item[0] in ("admitted", "refused"):
            self.replica_id = item[1]
        else:
            self._buffer.append(item)
        return item

    async def first_token(self) -> None:
        """Reads ahead up to the first delta (or the stream's end)."""
        while not self._buffer or self._buffer[-1][0] not in ("delta", "usage", "failed", "end"):
            self._buffer.append(await self._next())

    async def items(self) -> AsyncIterator[tuple]:
        while self._buffer:
            item = self._buffer.pop(0)
            self.done = item[0] in ("usage", "failed", "end")
            yield item
            if self.done:
                return
        while True:
            item = await self._next()
            self.done = item[0] in ("usage", "failed", "end")
            yield item
            if self.done:
                return

    def cancel(self) -> None:
        if not self.cancelled and not self.done:
            self.cancelled = True
            self._response.cancel()


class RemoteSubscription:
    """What responses.Renderer reads (deltas() and usage), from a replica stream."""

    source = None                             # no response-cache memo on this side

    def __init__(self, stream: ReplicaStream):
        self.stream = stream
        self.usage = Usage(0, 0, 0)

    async def deltas(self) -> AsyncIterator[StreamDelta]:
        async for item in self.stream.items():
            kind = item[0]
            if kind == "delta":
                yield item[1]
            elif kind == "usage":
                self.usage = item[1]
                return
            elif kind == "failed":
                raise ReplicaFailed(item[1])
            elif kind == "end":
                raise ReplicaFailed("the replica ended the stream early")
