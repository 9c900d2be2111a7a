"""One request as the client saw it: when it started, when each content chunk arrived, how it ended.

Every time is client-side (perf_counter) in seconds since the level started. TTFT is the first
content chunk; inter-token latencies are the gaps between content chunks (a chunk may carry
several tokens; the token count comes from the server's usage chunk when it sends one).
"""

from __future__ import annotations

import asyncio
import enum
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

from kiln.bench.text import Prompt
from kiln.bench.workloads import RequestSpec


class Outcome(str, enum.Enum):
    OK = "ok"                   # ran to its end (length or stop)
    CANCELLED = "cancelled"     # the client hung up on purpose (the cancel workload)
    TIMEOUT = "timeout"         # --timeout passed first
    ERROR = "error"             # refused, failed, or the connection broke


@dataclass
class Chunk:
    text: str = ""
    num_tokens: int = 0                 # tokens this chunk carries, when the target knows
    usage_tokens: int | None = None     # the server's completion_tokens (the usage chunk)

    @property
    def has_content(self) -> bool:
        return bool(self.text) or self.num_tokens > 0


class Target(Protocol):
    name: str

    def stream(self, prompt: Prompt, spec: RequestSpec) -> AsyncIterator[Chunk]:
        """The response as chunks; closing the iterator early abandons the request."""


@dataclass
class RequestRecord:
    index: int
    prompt_tokens: int                  # as the workload asked for (prefix + own text)
    start: float
    chunk_times: list[float] = field(default_factory=list)
    end: float | None = None
    output_tokens: int = 0
    outcome: Outcome = Outcome.OK
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2e(self) -> float | None:
        return self.end - self.start if self.outcome is Outcome.OK and self.end is not None else None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (the decode pace the user sees)."""
        if self.outcome is not Outcome.OK or self.output_tokens < 2 or not self.chunk_times:
            return None
        return (self.end - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def mean_itl(self) -> float | None:
        gaps = self.itls
        return sum(gaps) / len(gaps) if gaps else None


async def issue(target: Target, prompt: Prompt, spec: RequestSpec, timeout: float,
                clock: Callable[[], float]) -> RequestRecord:
    """Send one request and record it; never raises (a failure is an outcome)."""
    record = RequestRecord(spec.index, spec.prefix_tokens + spec.prompt_tokens, start=clock())
    try:
        await asyncio.wait_for(_consume(target.stream(prompt, spec), record, spec.cancel_after, clock), timeout)
    except asyncio.TimeoutError:
        record.outcome = Outcome.TIMEOUT
    except Exception as e:            # noqa: BLE001 - any failure of the target is the request's outcome
        record.outcome, record.error = Outcome.ERROR, f"{type(e).__name__}: {e}"[:300]
    record.end = clock()
    return record


async def _consume(chunks: AsyncIterator[Chunk], record: RequestRecord, cancel_after: int | None,
                   clock: Callable[[], float]) -> None:
    usage = None
    # aclosing: leaving early (cancel, timeout) closes the stream now, which aborts the request.
    async with aclosing(chunks) as stream:
        async for chunk in stream:
            now = clock()
            if chunk.usage_tokens is not None:
                usage = chunk.usage_tokens
            if not chunk.has_content:
                continue
            record.chunk_times.append(now)
            record.output_tokens += chunk.num_tokens or 1
            if cancel_after is not None and len(record.chunk_times) >= cancel_after:
                record.outcome = Outcome.CANCELLED
                break
    if usage is not None:
        record.output_tokens = usage
