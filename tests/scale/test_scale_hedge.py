"""Hedging's pure parts: the token bucket's cap, the p95 delay, suspension after refusals, and the
race (first token wins, the loser is cancelled) over in-memory streams with scripted delays."""

from __future__ import annotations

import asyncio

import pytest

from kiln.scale.hedge import SUSPEND_AFTER_REFUSAL, HedgePolicy, TokenBucket, TtftWindow, race


def test_the_bucket_caps_hedges_at_the_fraction_of_traffic():
    bucket = TokenBucket(fraction=0.05, burst=1.0)
    taken = 0
    for _ in range(1000):
        bucket.earn()
        taken += bucket.take()
    assert taken <= 1 + 0.05 * 1000 and taken >= 0.05 * 1000 - 1
    with pytest.raises(ValueError):
        TokenBucket(fraction=1.5)


def test_the_delay_is_the_recent_p95_but_never_below_the_floor():
    policy = HedgePolicy(floor=0.5)
    assert policy.delay() == 0.5                         # nothing seen yet
    for i in range(100):
        policy.window.observe(i / 10)                    # 0.0 .. 9.9 s
    assert policy.delay() == pytest.approx(9.5)
    window = TtftWindow(size=10)
    for i in range(100):
        window.observe(float(i))                         # only the last ten count
    assert window.p95() == 99.0 and len(window._sorted) == 10


def test_refusals_suspend_hedging_for_a_while():
    now = [100.0]
    policy = HedgePolicy(fraction=1.0, clock=lambda: now[0])
    policy.refused()
    assert policy.suspended and not policy.allow()
    now[0] += SUSPEND_AFTER_REFUSAL + 0.1
    assert not policy.suspended and policy.allow()


class ScriptedStream:
    """A stream whose first token comes after `delay` seconds."""

    def __init__(self, name: str, delay: float):
        self.replica_id, self.delay, self.cancelled = name, delay, False

    async def first_token(self) -> None:
        await asyncio.sleep(self.delay)

    def cancel(self) -> None:
        self.cancelled = True


def _race(primary_delay: float, hedge_delay: float, policy: HedgePolicy | None = None):
    policy = policy or HedgePolicy(fraction=1.0, floor=0.01)
    primary, opened = ScriptedStream("slow", primary_delay), []

    async def open_hedge(avoid):
        opened.append(avoid)
        hedge = ScriptedStream("fast", hedge_delay)
        opened.append(hedge)
        return hedge

    winner = asyncio.run(race(primary, open_hedge, policy))
    return winner, primary, opened, policy.counts


def test_a_late_primary_loses_to_the_hedge_and_is_cancelled():
    winner, primary, opened, counts = _race(primary_delay=5.0, hedge_delay=0.0)
    assert opened[0] == "slow"                           # the duplicate avoids the first replica
    assert winner is opened[1] and primary.cancelled and not winner.cancelled
    assert (counts.sent, counts.won, counts.cancelled) == (1, 1, 1)


def test_a_primary_that_answers_in_time_is_never_hedged():
    winner, primary, opened, counts = _race(primary_delay=0.0, hedge_delay=0.0)
    assert winner is primary and not opened and counts.sent == 0


def test_an_exhausted_bucket_sends_no_hedge():
    policy = HedgePolicy(fraction=0.0, floor=0.01)
    assert policy.bucket.take()                          # the one starting token, spent
    winner, primary, opened, counts = _race(primary_delay=0.05, hedge_delay=0.0, policy=policy)
    assert winner is primary and not opened and counts.sent == 0


def test_no_hedge_while_replicas_refuse():
    policy = HedgePolicy(fraction=1.0, floor=0.01)
    policy.refused()
    winner, primary, opened, counts = _race(primary_delay=0.05, hedge_delay=0.0, policy=policy)
    assert winner is primary and not opened and policy.bucket.tokens >= 1
