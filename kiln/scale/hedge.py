"""Hedged requests: when a request has no first token after max(the recent p95 TTFT, a floor),
send a duplicate to a different replica; the first to produce a token wins, the other is
cancelled (its replica frees the KV). Hedges are capped by a token bucket (a fraction of the
traffic) and suspended while replicas refuse, when a duplicate would only add load.

The pieces are plain asyncio over any stream with `first_token()` and `cancel()`, so they test
without Ray; the ingress plugs in its replica streams.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

DEFAULT_FRACTION = 0.05       # of requests that may be hedged
DEFAULT_FLOOR = 0.5           # seconds: never hedge sooner, however fast the recent TTFTs
SUSPEND_AFTER_REFUSAL = 5.0   # seconds without hedges after a replica refused (429)


class TokenBucket:
    """Each request earns `fraction` of a hedge; a hedge spends one. Starts with `burst` tokens,
    so at most burst + fraction x requests are hedged."""

    def __init__(self, fraction: float = DEFAULT_FRACTION, burst: float = 1.0):
        if not 0 <= fraction <= 1 or burst < 0:
            raise ValueError(f"hedge fraction must be in [0, 1] and burst >= 0, got {fraction}, {burst}")
        self.fraction, self.burst, self.tokens = fraction, burst, burst

    def earn(self) -> None:
        self.tokens = min(self.tokens + self.fraction, max(self.burst, 1.0))

    def take(self) -> bool:
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class TtftWindow:
    """The last `size` first-token times; their 95th percentile."""

    def __init__(self, size: int = 200):
        self._order: deque[float] = deque(maxlen=size)
        self._sorted: list[float] = []

    def observe(self, seconds: float) -> None:
        if len(self._order) == self._order.maxlen:
            self._sorted.pop(bisect.bisect_left(self._sorted, self._order[0]))
        self._order.append(seconds)
        bisect.insort(self._sorted, seconds)

    def p95(self) -> float | None:
        if not self._sorted:
            return None
        return self._sorted[min(len(self._sorted) - 1, int(0.95 * len(self._sorted)))]


@dataclass
class HedgeCounts:
    sent: int = 0
    won: int = 0          # the duplicate produced the first token
    cancelled: int = 0    # streams cancelled because the other won


class HedgePolicy:
    def __init__(self, fraction: float = DEFAULT_FRACTION, floor: float = DEFAULT_FLOOR,
                 clock: Callable[[], float] = time.monotonic):
        self.bucket, self.window, self.floor = TokenBucket(fraction), TtftWindow(), floor
        self.counts, self._clock = HedgeCounts(), clock
        self._refused_at: float | None = None

    def delay(self) -> float:
        p95 = self.window.p95()
        return max(p95 if p95 is not None else self.floor, self.floor)

    def refused(self) -> None:
        self._refused_at = self._clock()

    @property
    def suspended(self) -> bool:
        return self._refused_at is not None and self._clock() - self._refused_at < SUSPEND_AFTER_REFUSAL

    def allow(self) -> bool:
        """Spends a hedge token unless hedging is suspended."""
        return not self.suspended and self.bucket.take()


class Stream(Protocol):
    replica_id: str | None

    async def first_token(self) -> None: ...     # returns at the first token (or the stream's end)

    def cancel(self) -> None: ...


async def race(primary: Stream, open_hedge: Callable[[str | None], Awaitable[Stream | None]],
               policy: HedgePolicy) -> Stream:
    """The stream to answer from. A hedge is opened after policy.delay() without a first token
    from `primary`, if the policy allows one; the stream that reaches its first token later is
    cancelled. open_hedge(avoid) may return None (no other replica would take it).

    Cancelled (the client left during the race) or failing, the race cancels its reads and every
    stream it holds, the duplicate included, before it re-raises: no replica goes on generating
    for nobody. Only the returned stream is left open; the caller cancels it when done."""
    policy.bucket.earn()
    started = time.monotonic()
    streams: list[Stream] = [primary]
    tasks: list[asyncio.Future] = []
    try:
        first = asyncio.ensure_future(primary.first_token())
        tasks.append(first)
        done, _ = await asyncio.wait({first}, timeout=policy.delay())
        if done or not policy.allow():
            await first
            policy.window.observe(time.monotonic() - started)
            return primary
        hedge = await open_hedge(primary.replica_id)
        if hedge is None:
            await first
            return primary
        streams.append(hedge)
        policy.counts.sent += 1
        second = asyncio.ensure_future(hedge.first_token())
        tasks.append(second)
        done, _ = await asyncio.wait({first, second}, return_when=asyncio.FIRST_COMPLETED)
        won = second in done and first not in done
        winner, loser, losing_task = (hedge, primary, first) if won else (primary, hedge, second)
        losing_task.cancel()
        loser.cancel()
        streams.remove(loser)
        policy.counts.cancelled += 1
        policy.counts.won += won
        await (second if won else first)
        policy.window.observe(time.monotonic() - started)
        return winner
    except BaseException:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.cancel()
        raise
