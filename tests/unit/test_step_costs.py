"""The step-cost model behind decode-aware chunked prefill and admission's TTFT prediction."""

import pytest

from kiln.runtime.step_costs import PRIOR_DECODE_SECONDS, StepCostModel, StepCosts, batch_bucket


def costs(**kw):
    base = dict(target_itl=0.05, min_prefill_chunk=8, max_tokens=512,
                decode_seconds_by_bucket=((1, 0.01), (4, 0.02), (16, 0.04)), prefill_seconds_per_token=0.001)
    return StepCosts(**{**base, **kw})


def test_batch_buckets_are_powers_of_two():
    assert [batch_bucket(n) for n in (0, 1, 2, 3, 4, 5, 16, 17)] == [0, 1, 2, 4, 4, 8, 16, 32]


def test_decode_seconds_uses_the_bucket_at_or_above_and_extrapolates_linearly():
    c = costs()
    assert c.decode_seconds(0) == 0
    assert c.decode_seconds(1) == 0.01
    assert c.decode_seconds(2) == 0.02          # no bucket 2 seen: the next one up (conservative)
    assert c.decode_seconds(9) == 0.04
    assert c.decode_seconds(32) == pytest.approx(0.08)   # beyond the largest seen: scaled
    assert StepCosts().decode_seconds(3) == PRIOR_DECODE_SECONDS


def test_prefill_budget_is_the_spare_time_over_the_token_cost():
    c = costs()
    assert c.prefill_budget(1) == 40            # (0.05 - 0.01) / 0.001
    assert c.prefill_budget(4) == 30
    assert c.prefill_budget(16) == 10
    assert c.prefill_budget(32) == 8            # decodes alone miss the target: the floor
    assert c.prefill_budget(0) == 512           # nobody to protect: the whole token budget
    assert costs(target_itl=0).prefill_budget(4) == 508    # policy off: the room the decodes leave
    assert costs(max_tokens=20).prefill_budget(4) == 16    # never more than that room


def test_prefill_seconds_counts_the_decode_load():
    c = costs()
    assert c.prefill_seconds(0, 4) == 0
    assert c.prefill_seconds(512, 0) == pytest.approx(0.512)           # one step, nothing decodes
    assert c.prefill_seconds(90, 4) == pytest.approx(3 * (0.02 + 0.03))  # 30 tokens a step
    assert c.prefill_seconds(100, 4) == pytest.approx(3 * 0.05 + 0.02 + 0.01)
    assert c.prefill_seconds(1000, 16) > 4 * c.prefill_seconds(1000, 0)


def test_the_model_learns_a_step_law_and_hits_the_target():
    """Made-up engine: 5 ms + 5 ms per decode bucket doubling, 0.5 ms per prefill token."""
    def engine(decodes, prefill):
        return (0.005 * batch_bucket(decodes).bit_length() if decodes else 0.0) + 0.0005 * prefill

    model = StepCostModel(target_itl=0.04, min_prefill_chunk=4, max_tokens=1024)
    for _ in range(40):
        model.observe(8, 0, engine(8, 0))
        model.observe(0, 300, engine(0, 300))
    for _ in range(40):
        budget = model.costs().prefill_budget(8)
        model.observe(8, budget, engine(8, budget))
    assert model.costs().decode_seconds(8) == pytest.approx(0.02, rel=0.01)
    assert model.costs().prefill_seconds_per_token == pytest.approx(0.0005, rel=0.02)
    assert engine(8, model.costs().prefill_budget(8)) == pytest.approx(0.04, rel=0.03)


def test_a_wrong_decode_estimate_still_converges_to_the_target():
    """Under load there may be no decode-only step to learn from: the token cost absorbs the error."""
    model = StepCostModel(target_itl=0.1, min_prefill_chunk=4, max_tokens=4096)
    for _ in range(60):                        # the true decode step of 16 is 50 ms; prior says 20
        budget = model.costs().prefill_budget(16)
        model.observe(16, budget, 0.05 + 0.0002 * budget)
    budget = model.costs().prefill_budget(16)
    assert 0.05 + 0.0002 * budget == pytest.approx(0.1, rel=0.03)


def test_stalls_in_small_steps_are_charged_to_the_decode_step_not_the_tokens():
    """A busy GIL or a noisy neighbour stretches steps at random. Charged to a small chunk's few
    tokens, a stall would inflate the token cost, shrink the next chunk, and feed on itself."""
    import random

    rng = random.Random(0)
    model = StepCostModel(target_itl=0.1, min_prefill_chunk=8, max_tokens=512)
    for _ in range(20):
        model.observe(0, 256, 0.128)                # idle prefills: 0.5 ms a token
    learnt = model.prefill_seconds_per_token
    for _ in range(200):                            # 16 streams, 30 ms decode + stalls up to 60 ms
        budget = min(model.costs().prefill_budget(16), 40)
        model.observe(16, budget, 0.03 + 0.0005 * budget + rng.uniform(0, 0.06))
    assert model.prefill_seconds_per_token == learnt
    assert 0.03 < model.costs().decode_seconds(16) < 0.09
    assert model.costs().prefill_budget(16) >= 20


def test_costs_snapshot_is_refreshed_after_each_observation():
    model = StepCostModel(target_itl=0.05)
    first = model.costs()
    assert model.costs() is first
    model.observe(2, 0, 0.03)
    assert model.costs() is not first and model.costs().decode_seconds(2) == 0.03
