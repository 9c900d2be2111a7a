"""Arrival processes: closed-loop clients (a concurrency level) or open-loop Poisson arrivals (a rate).

Each level issues requests for `duration` seconds (and at most `max_requests`), then waits for the
ones in flight, each bounded by its timeout. Every level starts again from the workload's first
request, so the levels of a sweep see the same requests.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from kiln.bench.records import RequestRecord, Target, issue
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
                    on_record: Callable[[RequestRecord], None] = lambda r: None) -> LevelRun:
    t0 = time.perf_counter()
    clock = (lambda: time.perf_counter() - t0)
    records: list[RequestRecord] = []

    async def send(spec: RequestSpec) -> None:
        # Rendering tokenizes long prompts: on a worker thread, off the loop that timestamps chunks.
        prompt = await asyncio.to_thread(render, spec)
        record = await issue(target, prompt, spec, limits.timeout, clock)
        records.append(record)
        on_record(record)
        return record

    if level.concurrency:
        await _closed_loop(send, specs, level.concurrency, limits, clock)
    else:
        await _open_loop(send, specs, poisson_arrivals(level.rate, limits.duration, seed, limits.max_requests), clock)
    wall = max((r.end for r in records), default=clock())
    return LevelRun(level, sorted(records, key=lambda r: r.index), wall)


RETRY_AFTER_FLOOR = 1.0


async def _closed_loop(send, specs: Iterator[RequestSpec], clients: int, limits: Limits, clock) -> None:
    issued = 0

    async def client() -> None:
        nonlocal issued
        while clock() < limits.duration and (limits.max_requests is None or issued < limits.max_requests):
            issued += 1
            record = await send(next(specs))
            if "HTTP 429" in (record.error or ""):
                # A polite client (the openai client does this) waits out Retry-After, which is
                # 1 s at least; retrying at once would measure the refusal path, not the server.
                await asyncio.sleep(RETRY_AFTER_FLOOR)

    await asyncio.gather(*(client() for _ in range(clients)))


async def _open_loop(send, specs: Iterator[RequestSpec], arrivals: list[float], clock) -> None:
    tasks = []
    for at in arrivals:
        await asyncio.sleep(max(0.0, at - clock()))
        tasks.append(asyncio.create_task(send(next(specs))))
    await asyncio.gather(*tasks)
