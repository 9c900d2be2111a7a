"""A small load generator for the serving load test: streaming clients that loop until a
deadline, a share of them hanging up early, each outcome recorded for the assertions."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

TOPICS = ["the sea", "a small robot", "bread", "mountains", "a lost key", "the moon", "rain", "chess"]


@dataclass
class Outcome:
    status: int
    cancelled: bool = False
    done: bool = False                  # saw data: [DONE]
    finish_reason: str | None = None
    completion_tokens: int | None = None
    max_tokens: int = 0
    text: str = ""
    ttft: float | None = None
    errors: list[str] = field(default_factory=list)
    retry_after: float = 0.0


@dataclass
class LoadReport:
    outcomes: list[Outcome]
    seconds: float

    @property
    def statuses(self) -> Counter:
        return Counter(o.status for o in self.outcomes)

    def completed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 200 and not o.cancelled]

    def summary(self) -> str:
        done = self.completed()
        tokens = sum(o.completion_tokens or 0 for o in done)
        ttfts = sorted(o.ttft for o in done if o.ttft is not None)
        p = (lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else float("nan"))
        return (f"{len(self.outcomes)} requests in {self.seconds:.1f} s: statuses {dict(self.statuses)}, "
                f"{sum(o.cancelled for o in self.outcomes)} cancelled, {len(done)} completed, "
                f"{tokens} tokens ({tokens / self.seconds:.0f} tok/s), TTFT p50 {p(0.5):.2f} s p90 {p(0.9):.2f} s")


def _prompt(rng: random.Random) -> str:
    topic = rng.choice(TOPICS)
    size = rng.choice(["short", "short", "medium", "long"])
    if size == "short":
        return f"Write one sentence about {topic}."
    filler = " ".join(f"Fact {i}: {topic} is interesting because of reason number {i}." for i in range(
        4 if size == "medium" else 12))
    return f"{filler}\nSummarise the facts above about {topic} in one sentence."


async def _one(client: httpx.AsyncClient, url: str, rng: random.Random, hang_up: bool) -> Outcome:
    max_tokens = rng.randint(8, 32)
    body = {"messages": [{"role": "user", "content": _prompt(rng)}], "max_tokens": max_tokens,
            "temperature": 0.8, "stream": True, "stream_options": {"include_usage": True}}
    chunks_before_hanging_up = rng.randint(0, 4) if hang_up else None
    t0 = time.monotonic()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        out = Outcome(r.status_code, max_tokens=max_tokens)
        if r.status_code != 200:
            await r.aread()
            out.retry_after = float(r.headers.get("retry-after", 0))
            return out
        n = 0
        async for line in r.aiter_lines():
            if chunks_before_hanging_up is not None and n >= chunks_before_hanging_up:
                out.cancelled = True
                return out                 # leaving the block closes the connection
            if line.startswith("data: "):
                n += 1
                _record(out, line[6:], t0)
    return out


def _record(out: Outcome, data: str, t0: float) -> None:
    if data == "[DONE]":
        out.done = True
        return
    event = json.loads(data)
    if "error" in event:
        out.errors.append(event["error"]["message"])
        return
    if event.get("usage"):
        out.completion_tokens = event["usage"]["completion_tokens"]
    for choice in event["choices"]:
        text = choice["delta"].get("content") or ""
        if text and out.ttft is None:
            out.ttft = time.monotonic() - t0
        out.text += text
        out.finish_reason = choice["finish_reason"] or out.finish_reason


async def _client_loop(url: str, seed: int, hang_up: bool, deadline: float, outcomes: list[Outcome]):
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120), limits=limits) as client:
        while time.monotonic() < deadline:
            outcome = await _one(client, url, rng, hang_up)
            outcomes.append(outcome)
            if outcome.status == 429:        # a polite client: back off as Retry-After says (capped)
                await asyncio.sleep(min(outcome.retry_after, 2.0))


def run_load(url: str, clients: int, seconds: float, hang_up_share: float = 0.25) -> LoadReport:
    """`clients` concurrent streaming clients for `seconds`; the first `hang_up_share` of them
    disconnect from every request after a few chunks (some before the first token)."""
    outcomes: list[Outcome] = []
    t0 = time.monotonic()

    async def main():
        deadline = time.monotonic() + seconds
        hang_ups = int(clients * hang_up_share)
        await asyncio.gather(*(_client_loop(url, i, i < hang_ups, deadline, outcomes) for i in range(clients)))

    asyncio.run(main())
    return LoadReport(outcomes, time.monotonic() - t0)
