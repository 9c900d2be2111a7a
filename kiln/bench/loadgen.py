"""The load generator `kiln bench` and the serving tests share: one loop, pluggable pieces.

- how a request is sent: a Target (target_http.HttpTarget: raw httpx SSE; target_openai.OpenAITarget:
  the official client; the in-process engine and its peers);
- what is sent: a spec stream (workloads.request_specs, a named workload or a caller's Workload)
  and a render (spec -> Prompt); each spec says whether its client hangs up (cancel_after) or gives
  up (give_up_after), and whether it streams;
- the arrivals: closed-loop clients (a concurrency level) or open-loop Poisson arrivals (a rate);
- how a client backs off after a 429 (RetryAfter);
- when to stop: `duration` seconds of issuing requests and/or at most `max_requests`, then the
  ones in flight are waited for, each bounded by its timeout.

Every request ends as one RequestRecord (records.py). Every level starts again from the
workload's first request, so the levels of a sweep see the same requests.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator

from kiln.bench.records import RequestRecord, Target, issue
from kiln.bench.stats import percentile
from kiln.bench.text import Prompt
from kiln.bench.workloads import RequestSpec


@dataclass(frozen=True)
class Level:
    concurrency: int | None = None      # closed loop: this many clients, each waits for its reply
    rate: float | None = None           # open loop: Poisson arrivals at this many requests/s

    def __post_init__(self):
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("a level is either a concurrency or a rate")
        if (self.rate if self.concurrency is None else self.concurrency) <= 0:
            raise ValueError(f"a level must be positive: {self}")

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.concurrency else f"{self.rate:g} req/s"

    @property
    def value(self) -> float:
        return float(self.concurrency or self.rate)


@dataclass(frozen=True)
class Limits:
    duration: float                     # seconds of issuing requests per level
    timeout: float                      # per request, from its start
    max_requests: int | None = None     # per level


@dataclass
class LevelRun:
    level: Level
    records: list[RequestRecord]
    wall_s: float                       # level start to the end of its last request

    @property
    def statuses(self) -> Counter:
        return Counter(r.status for r in self.records)

    def summary(self) -> str:
        """One line for a log: statuses, hang-ups, tokens, client-side TTFT, how fast 429s came."""
        ttfts = [r.ttft for r in self.records if r.ttft is not None and r.status == 200]
        tokens = sum(r.completion_tokens or 0 for r in self.records if not r.cancelled)
        refused = [r.end - r.start for r in self.records if r.status == 429]
        p = (lambda q: float("nan") if not ttfts else percentile(ttfts, q))
        return (f"{len(self.records)} requests in {self.wall_s:.1f} s: statuses {dict(self.statuses)}, "
                f"{sum(r.cancelled for r in self.records)} cancelled, {tokens} tokens "
                f"({tokens / max(self.wall_s, 1e-9):.0f} tok/s), TTFT p50 {p(50):.3f} s p90 {p(90):.3f} s "
                f"max {p(100):.3f} s" + (f", 429 answered in <= {max(refused) * 1e3:.0f} ms" if refused else ""))


@dataclass(frozen=True)
class RetryAfter:
    """A closed-loop client's pause after a 429: the server's Retry-After (`default` when it sent
    none), held within [floor, cap]. After any other outcome it goes on at once."""
    cap: float
    floor: float = 0.0
    default: float = 1.0

    def __call__(self, record: RequestRecord) -> float:
        if record.status != 429:
            return 0.0
        wait = self.default if record.retry_after is None else record.retry_after
        return min(self.cap, max(self.floor, wait))


# `kiln bench`: a polite client (the openai client does this) waits out Retry-After, which is 1 s at
# least; retrying at once would measure the refusal path, not the server.
POLITE = RetryAfter(cap=1.0, floor=1.0)


def poisson_arrivals(rate: float, duration: float, seed: int, max_requests: int | None = None) -> list[float]:
    """Arrival offsets (seconds) of a Poisson process: exponential gaps, seeded per (seed, rate)."""
    rng, t, out = random.Random(f"arrivals:{seed}:{rate}"), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration or (max_requests is not None and len(out) >= max_requests):
            return out
        out.append(t)


async def run_level(target: Target, specs: Iterator[RequestSpec], render: Callable[[RequestSpec], Prompt],
                    level: Level, limits: Limits, seed: int,
                    on_record: Callable[[RequestRecord], None] = lambda r: None,
                    backoff: Callable[[RequestRecord], float] = POLITE) -> LevelRun:
    t0 = time.perf_counter()
    clock = (lambda: time.perf_counter() - t0)
    records: list[RequestRecord] = []

    async def send(spec: RequestSpec, deadline: float = math.inf) -> RequestRecord | None:
        """None when rendering ended past the deadline (the level's issuing time): not sent."""
        # Rendering tokenizes long prompts: on a worker thread, off the loop that timestamps chunks.
        prompt = await asyncio.to_thread(render, spec)
        now = clock()
        if now >= deadline:
            return None
        record = await issue(target, prompt, spec, limits.timeout, clock, start=now)
        records.append(record)
        on_record(record)
        return record

    if level.concurrency:
        await _closed_loop(send, specs, level.concurrency, limits, clock, backoff)
    else:
        await _open_loop(send, specs, poisson_arrivals(level.rate, limits.duration, seed, limits.max_requests), clock)
    wall = max((r.end for r in records), default=clock())
    return LevelRun(level, sorted(records, key=lambda r: r.index), wall)


def run_load(make_target: Callable[[], Target], specs: Iterator[RequestSpec],
             render: Callable[[RequestSpec], Prompt], level: Level, limits: Limits,
             backoff: Callable[[RequestRecord], float] = POLITE, seed: int = 0) -> LevelRun:
    """One level in an event loop of its own, on a target made (and closed) inside it: for callers
    without a loop (the serving tests). make_target() returns an object with stream() and close()."""
    async def go() -> LevelRun:
        target = make_target()
        try:
            return await run_level(target, specs, render, level, limits, seed, backoff=backoff)
        finally:
            await target.close()
    return asyncio.run(go())


async def _closed_loop(send, specs: Iterator[RequestSpec], clients: int, limits: Limits, clock,
                       backoff: Callable[[RequestRecord], float]) -> None:
    issued = 0

    async def client() -> None:
        nonlocal issued
        while clock() < limits.duration and (limits.max_requests is None or issued < limits.max_requests):
            issued += 1
            # NOTE: the deadline again after rendering (a thread hop: a few ms on a busy machine),
            # so no request starts past the duration.
            record = await send(next(specs), limits.duration)
            if record is None:
                return
            if pause := backoff(record):
                await asyncio.sleep(pause)

    await asyncio.gather(*(client() for _ in range(clients)))


async def _open_loop(send, specs: Iterator[RequestSpec], arrivals: list[float], clock) -> None:
    tasks = []
    for at in arrivals:
        await asyncio.sleep(max(0.0, at - clock()))
        tasks.append(asyncio.create_task(send(next(specs))))
    await asyncio.gather(*tasks)
