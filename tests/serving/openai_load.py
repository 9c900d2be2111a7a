"""A bounded mixed load through the official `openai` client: streamed and whole replies, short
and long prompts, clients that hang up mid-stream or give up before their reply. Each request's
outcome (status, client-side TTFT, finish) is kept for the assertions."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass

import openai

HANG_UP_SHARE = 0.2         # of requests: streamed ones close after a few chunks
GIVE_UP_SHARE = 0.05        # whole-reply ones are abandoned before they finish
BACK_OFF_CAP = 0.25         # seconds; a 429's Retry-After is at least 1 s, too long for a short test


@dataclass
class Outcome:
    status: int
    streamed: bool
    cancelled: bool = False
    ttft: float | None = None
    finish_reason: str | None = None
    completion_tokens: int | None = None
    max_tokens: int = 0
    refused_after: float | None = None      # seconds until a 429 arrived
    retry_after: str | None = None
    error: str | None = None


@dataclass
class Load:
    outcomes: list[Outcome]
    seconds: float

    @property
    def statuses(self) -> Counter:
        return Counter(o.status for o in self.outcomes)

    def admitted(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 200]

    def summary(self) -> str:
        ttfts = sorted(o.ttft for o in self.admitted() if o.ttft is not None)
        worst = ttfts[-1] if ttfts else float("nan")
        p50 = ttfts[len(ttfts) // 2] if ttfts else float("nan")
        refusals = sorted(o.refused_after for o in self.outcomes if o.refused_after is not None)
        refused = f", 429 answered in <= {refusals[-1] * 1000:.0f} ms" if refusals else ""
        return (f"{len(self.outcomes)} requests in {self.seconds:.1f} s: {dict(self.statuses)}, "
                f"{sum(o.cancelled for o in self.outcomes)} hung up; TTFT p50 {p50:.3f} s, "
                f"max {worst:.3f} s{refused}")


def _prompt(rng: random.Random) -> str:
    words = rng.choice([4, 12, 50, 140])           # short and long prompts (140 words: ~780 tokens)
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "kiln", "fire"]) for _ in range(words))


async def _streamed(client: openai.AsyncOpenAI, model: str, rng: random.Random, out: Outcome, t0: float) -> None:
    hang_up_after = rng.randint(1, 4) if rng.random() < HANG_UP_SHARE else None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": _prompt(rng)}], max_tokens=out.max_tokens,
        temperature=0.9, stream=True, stream_options={"include_usage": True})
    out.status, chunks = 200, 0
    async for chunk in stream:
        if chunk.usage is not None:
            out.completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content and out.ttft is None:
                out.ttft = time.monotonic() - t0
            out.finish_reason = choice.finish_reason or out.finish_reason
            chunks += 1
        if hang_up_after is not None and chunks >= hang_up_after:
            out.cancelled = True
            await stream.close()                 # the client disconnects mid-stream
            return


async def _whole(client: openai.AsyncOpenAI, model: str, rng: random.Random, out: Outcome, t0: float) -> None:
    give_up = rng.uniform(0.01, 0.2) if rng.random() < GIVE_UP_SHARE else None
    call = client.completions.create(model=model, prompt=_prompt(rng), max_tokens=out.max_tokens, temperature=0.9)
    try:
        reply = await asyncio.wait_for(call, timeout=give_up)
    except asyncio.TimeoutError:                # the client drops the connection before its reply
        out.cancelled = True                    # status stays 0: no answer was read
        return
    out.status = 200
    out.finish_reason = reply.choices[0].finish_reason
    out.completion_tokens = reply.usage.completion_tokens


async def _one(client: openai.AsyncOpenAI, model: str, rng: random.Random) -> Outcome:
    streamed = rng.random() < 0.75
    out = Outcome(status=0, streamed=streamed, max_tokens=rng.randint(4, 48))
    t0 = time.monotonic()
    try:
        await (_streamed if streamed else _whole)(client, model, rng, out, t0)
    except openai.APIStatusError as e:
        out.status, out.error = e.status_code, e.message
        if e.status_code == 429:
            out.refused_after = time.monotonic() - t0
            out.retry_after = e.response.headers.get("retry-after")
    return out


async def _client_loop(url: str, model: str, seed: int, deadline: float, outcomes: list[Outcome]) -> None:
    rng = random.Random(seed)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        while time.monotonic() < deadline:
            outcome = await _one(client, model, rng)
            outcomes.append(outcome)
            if outcome.status == 429:
                await asyncio.sleep(min(float(outcome.retry_after or 1), BACK_OFF_CAP))


def run_openai_load(url: str, model: str, clients: int, seconds: float, seed: int = 0) -> Load:
    outcomes: list[Outcome] = []
    t0 = time.monotonic()

    async def main():
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(_client_loop(url, model, seed * 1000 + i, deadline, outcomes)
                               for i in range(clients)))

    asyncio.run(main())
    return Load(outcomes, time.monotonic() - t0)
