"""One request as the client saw it: when it started, when each content chunk arrived, how it ended,
and what the server said (status, Retry-After, finish reason, usage, text).

Every time is client-side (perf_counter) in seconds since the level started. TTFT is the first
content chunk; inter-token latencies are the gaps between content chunks (a chunk may carry
several tokens; the token count comes from the server's usage chunk when it sends one). A reply
asked for whole (not streamed) has no chunk times: no TTFT, no inter-token gaps, only its end.
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


class TargetError(RuntimeError):
    """A target's failure; an HTTP refusal carries its status and Retry-After (seconds)."""

    def __init__(self, message: str, status: int = 0, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.retry_after = status, retry_after

    @classmethod
    def refusal(cls, status: int, body: str, retry_after: str | None) -> "TargetError":
        return cls(f"HTTP {status}: {body[:200]}", status, _seconds(retry_after))


def _seconds(header: str | None) -> float | None:
    """Retry-After in seconds; None when absent or an HTTP date (no server of ours sends one)."""
    try:
        return float(header) if header is not None else None
    except ValueError:
        return None


@dataclass
class Chunk:
    text: str = ""
    num_tokens: int = 0                 # tokens this chunk carries, when the target knows
    usage_tokens: int | None = None     # the server's completion_tokens (the usage chunk)
    status: int | None = None           # the HTTP status, on the chunk that first knows it
    finish_reason: str | None = None

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
    max_tokens: int = 0                 # as the workload asked for
    status: int = 0                     # HTTP status; 0 where none was read (gave up first, in-process)
    retry_after: float | None = None    # a refusal's Retry-After, seconds
    finish_reason: str | None = None
    completion_tokens: int | None = None    # the server's usage count, when it sent one
    text: str = ""

    @property
    def cancelled(self) -> bool:
        """The client hung up or gave up on purpose."""
        return self.outcome is Outcome.CANCELLED

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
                clock: Callable[[], float], start: float | None = None) -> RequestRecord:
    """Send one request and record it; never raises (a failure is an outcome). A client that gives
    up (spec.give_up_after) or hangs up (spec.cancel_after) closes the stream, aborting the request.
    start: the clock reading the caller decided to send at (default: now)."""
    record = RequestRecord(spec.index, spec.prefix_tokens + spec.prompt_tokens,
                           start=clock() if start is None else start,
                           max_tokens=spec.max_tokens)
    gives_up = spec.give_up_after is not None and spec.give_up_after < timeout
    try:
        await asyncio.wait_for(_consume(target.stream(prompt, spec), record, spec, clock),
                               spec.give_up_after if gives_up else timeout)
    except asyncio.TimeoutError:
        record.outcome = Outcome.CANCELLED if gives_up else Outcome.TIMEOUT
    except Exception as e:            # noqa: BLE001 - any failure of the target is the request's outcome
        _failed(record, e)
    record.end = clock()
    return record


def _failed(record: RequestRecord, e: Exception) -> None:
    record.outcome, record.error = Outcome.ERROR, f"{type(e).__name__}: {e}"[:300]
    if isinstance(e, TargetError) and e.status:
        record.status, record.retry_after = e.status, e.retry_after


async def _consume(chunks: AsyncIterator[Chunk], record: RequestRecord, spec: RequestSpec,
                   clock: Callable[[], float]) -> None:
    seen = 0                          # content chunks read
    # aclosing: leaving early (cancel, timeout) closes the stream now, which aborts the request.
    async with aclosing(chunks) as stream:
        async for chunk in stream:
            seen += _take(record, chunk, clock(), spec.stream)
            # cancel_after 0 hangs up on the first chunk, which may be the status line alone.
            if spec.cancel_after is not None and seen >= spec.cancel_after:
                record.outcome = Outcome.CANCELLED
                break
    if record.completion_tokens is not None:
        record.output_tokens = record.completion_tokens


def _take(record: RequestRecord, chunk: Chunk, now: float, streamed: bool) -> bool:
    """Fold one chunk into the record; True when it carried content."""
    record.status = chunk.status or record.status
    record.finish_reason = chunk.finish_reason or record.finish_reason
    if chunk.usage_tokens is not None:
        record.completion_tokens = chunk.usage_tokens
    if not chunk.has_content:
        return False
    record.text += chunk.text
    record.output_tokens += chunk.num_tokens or 1
    if streamed:
        record.chunk_times.append(now)
    return True
