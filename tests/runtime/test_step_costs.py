"""The step-cost model behind decode-aware chunked prefill and admission's TTFT prediction."""

import pytest

from kiln.runtime.step_costs import PRIOR_DECODE_SECONDS, StepCostModel, StepCosts, batch_bucket


def costs(**kw):
    base = dict(target_itl=0.05, min_prefill_chunk=8, max_tokens=512,
                decode_seconds_by_bucket=((1, 0.01), (4, 0.02), (16, 0.04)), prefill_seconds_per_token=0.001)
    return StepCosts(**{**base, **kw})


def test_batch_buckets_are_powers_of_two():
    assert [batch_bucket(n) for n in (0, 1, 2, 3, 4, 5, 16, 17)] == [0, 1, 2, 4, 4, 8, 16, 32]


def test_decode_seconds_uses_the_bucket_at_or_above_and_extrapolates_along_the_largest_two():
    c = costs()
    assert c.decode_seconds(0) == 0
    assert c.decode_seconds(1) == 0.01
    assert c.decode_seconds(2) == 0.02          # no bucket 2 seen: the next one up (conservative)
    assert c.decode_seconds(9) == 0.04
    # Beyond the largest seen: along the line through the two largest (16 and 4), not in
    # proportion to the largest (0.08).
    assert c.decode_seconds(32) == pytest.approx(0.04 + 16 * 0.02 / 12)
    assert costs(decode_seconds_by_bucket=((16, 0.04),)).decode_seconds(32) == pytest.approx(0.08)
    flat = costs(decode_seconds_by_bucket=((8, 0.05), (16, 0.04)))     # noise: never below the largest
    assert flat.decode_seconds(64) == pytest.approx(0.04)
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


def test_the_stretch_bounds_a_step_relative_to_the_decode_step():
    c = costs(itl_stretch=2.0)
    assert c.step_target(1) == 0.02                # 2 x 10 ms, under the 50 ms target
    assert c.prefill_budget(1) == 10               # (0.02 - 0.01) / 0.001
    assert c.step_target(16) == 0.05               # 2 x 40 ms: the absolute target binds
    assert c.prefill_budget(16) == 10


def test_prefill_seconds_counts_the_decode_load():
    c = costs()
    assert c.prefill_seconds(0, 4) == 0
    assert c.prefill_seconds(512, 0) == pytest.approx(0.512)           # one step, nothing decodes
    assert c.prefill_seconds(90, 4) == pytest.approx(3 * (0.02 + 0.03))  # 30 tokens a step
    assert c.prefill_seconds(100, 4) == pytest.approx(3 * 0.05 + 0.02 + 0.01)
    assert c.prefill_seconds(1000, 16) > 4 * c.prefill_seconds(1000, 0)


def test_a_queue_of_prompts_shares_steps_and_each_joins_the_decodes_once_prefilled():
    c = costs()
    assert c.queue_prefill_seconds([], 4, 32) == 0
    assert c.queue_prefill_seconds([90], 4, 32) == pytest.approx(c.prefill_seconds(90, 4))
    # Nothing decodes: one step of the whole budget ends the first prompt and starts the second
    # (412 of its 512); then 1 decode, 40 tokens a step: 100 tokens in 2 steps and a 20-token one.
    assert c.queue_prefill_seconds([100, 512], 0, 32) == pytest.approx(0.512 + 2 * 0.05 + 0.01 + 0.02)
    # Four prompts of 15 beside 1 decode: 40 tokens a step (two and a half prompts), then 3
    # decodes (bucket 4, 20 ms: 30 a step) for the last 20 tokens.
    assert c.queue_prefill_seconds([15] * 4, 1, 32) == pytest.approx(0.05 + 0.02 + 0.02)
    # Counting the queue as decoding from the start (the old prediction) is slower.
    assert c.queue_prefill_seconds([15] * 4, 1, 32) < c.prefill_seconds(60, 5)
    # Prompts already prefilled (0 left) are decodes; seats cap the decodes.
    assert c.queue_prefill_seconds([0, 0, 0, 30], 1, 32) == pytest.approx(c.prefill_seconds(30, 4))
    assert c.queue_prefill_seconds([0] * 40 + [8], 0, 16) == pytest.approx(c.prefill_seconds(8, 16))
    # A horizon stops the walk once past it: the answer is still past it, never past the whole.
    whole = c.queue_prefill_seconds([400] * 8, 2, 32)
    assert 0.5 < c.queue_prefill_seconds([400] * 8, 2, 32, horizon=0.5) < whole
    assert c.queue_prefill_seconds([400] * 8, 2, 32, horizon=whole) == pytest.approx(whole)


def test_decoding_streams_that_reach_max_tokens_stop_sharing_the_steps():
    c = costs()
    # One decode with 2 tokens left beside a 100-token prompt: 2 steps of 40 tokens beside it
    # (bucket 1: 10 ms + 40 ms), then the stream has ended and the last 20 go in one idle step.
    assert c.queue_prefill_seconds([100], 1, 32, decode_ends=[2]) == pytest.approx(2 * 0.05 + 0.02)
    # Without the end it decodes throughout: slower, and equal to the old prediction.
    assert c.queue_prefill_seconds([100], 1, 32) == pytest.approx(c.prefill_seconds(100, 1))
    assert c.queue_prefill_seconds([100], 1, 32) > c.queue_prefill_seconds([100], 1, 32, decode_ends=[2])
    # Long replies outlast the queue: no change. Of more ends than decodes, the longest count
    # (a prefilling request's full max_tokens is among them; taking the longest is conservative).
    assert c.queue_prefill_seconds([100], 1, 32, decode_ends=[500]) == pytest.approx(c.prefill_seconds(100, 1))
    assert c.queue_prefill_seconds([100], 1, 32, decode_ends=[1, 500]) == pytest.approx(c.prefill_seconds(100, 1))
    # A prompt prefilled joins the decodes for good (its reply length is not known here).
    assert c.queue_prefill_seconds([40, 100], 0, 32, decode_ends=[]) == pytest.approx(
        c.queue_prefill_seconds([40, 100], 0, 32))


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


def test_under_load_alone_the_model_still_finds_the_target():
    """No idle prefill to learn from and the prior is wrong (decode 50 ms, 0.2 ms a token): the
    chunks still vary (a prompt's last chunk is what is left of it), and that is enough."""
    import random

    rng = random.Random(1)
    model = StepCostModel(target_itl=0.1, min_prefill_chunk=4, max_tokens=4096)
    for _ in range(200):
        chunk = min(model.costs().prefill_budget(16), rng.randint(1, 600))
        model.observe(16, chunk, 0.05 + 0.0002 * chunk)
    assert 0.05 + 0.0002 * model.costs().prefill_budget(16) == pytest.approx(0.1, rel=0.03)


def test_stalls_go_to_the_decode_step_not_the_token_cost():
    """A busy GIL or a noisy neighbour stretches steps at random. Charged to a small chunk's few
    tokens, a stall would inflate the token cost, shrink the next chunk, and feed on itself; the
    fit puts it in the intercept, where it belongs (every stream waits for it)."""
    import random

    rng = random.Random(0)
    model = StepCostModel(target_itl=0.1, min_prefill_chunk=8, max_tokens=512)
    for _ in range(400):                            # 16 streams, 30 ms decode, stalls up to 60 ms
        chunk = rng.randint(0, 64)
        model.observe(16, chunk, 0.03 + 0.0005 * chunk + rng.uniform(0, 0.06))
    assert model.prefill_seconds_per_token == pytest.approx(0.0005, rel=0.3)
    assert model.costs().decode_seconds(16) == pytest.approx(0.06, abs=0.012)
    assert 60 <= model.costs().prefill_budget(16) <= 110


def test_until_chunks_vary_the_token_cost_is_the_idle_prefills_share():
    model = StepCostModel(target_itl=0.1)
    assert model.prefill_seconds_per_token == 1e-3                  # the prior
    model.observe(0, 256, 0.128)
    assert model.prefill_seconds_per_token == pytest.approx(0.0005)
    model.observe(4, 40, 0.05)                                       # one point: no slope yet
    assert model.prefill_seconds_per_token == pytest.approx(0.0005)
    assert model.costs().decode_seconds(4) == pytest.approx(0.05 - 40 * 0.0005)


def test_a_slope_from_cold_steps_cannot_make_prefill_free():
    """The first calls at new shapes are slow (shape-specific kernels): a 100-token prompt in 0.3 s,
    then 256-token chunks in 0.13 s fit a negative slope. Before, the clamp to 1e-5 s a token
    predicted 700 queued tokens in ~0.07 s; the floor keeps a quarter of the idle share."""
    model = StepCostModel(target_itl=0.05, itl_stretch=1.5, min_prefill_chunk=16, max_tokens=256)
    model.observe(0, 100, 0.30)
    model.observe(0, 256, 0.13)
    model.observe(0, 256, 0.13)
    idle_share = model.fits[0].mean_seconds / model.fits[0].mean_tokens
    assert sum(f.var for f in model.fits.values()) >= 2048           # enough spread: a slope is fitted
    assert model.prefill_seconds_per_token == pytest.approx(0.25 * idle_share)
    assert model.costs().queue_prefill_seconds([700], 1, 16) > 0.2


def test_costs_snapshot_is_refreshed_after_each_observation():
    model = StepCostModel(target_itl=0.05)
    first = model.costs()
    assert model.costs() is first
    model.observe(2, 0, 0.03)
    assert model.costs() is not first and model.costs().decode_seconds(2) == pytest.approx(0.03)


def test_once_the_queue_is_late_the_walk_takes_the_late_steps():
    """The scheduler plans its steps on the late costs while a prompt is late for its objective
    (Scheduler._step_costs_now); the walk does the same from late_after on."""
    c = costs()
    assert c.late().target_itl == pytest.approx(1.3 * c.target_itl)
    assert (c.prefill_budget(4), c.late().prefill_budget(4)) == (30, 45)    # 20 ms of decodes, 1 ms a token
    beside_decodes = c.queue_prefill_seconds([300], 4, 32)
    assert beside_decodes == pytest.approx(10 * 0.05)
    # Two steps of 30 tokens (0.1 s), then the 240 left: five late steps of 45 and one of 15.
    assert c.queue_prefill_seconds([300], 4, 32, late_after=0.1) == pytest.approx(0.1 + 5 * 0.065 + 0.035)
    assert c.queue_prefill_seconds([300], 4, 32, late_after=0.0) == pytest.approx(6 * 0.065 + 0.05)
    # 16 decodes take 40 ms of a 50 ms step: 10 tokens a step on time; late, a step may take two
    # decode steps where that is longer than 1.3 x 50 ms, which leaves 40.
    assert (c.prefill_budget(16), c.late().prefill_budget(16)) == (10, 40)
    # With nothing decoding a step takes the whole token budget, late or not (512 tokens); the
    # first prompt then decodes beside the 288 left: 40 tokens a 50 ms step, or 55 a late one.
    assert c.queue_prefill_seconds([400, 400], 0, 32) == pytest.approx(0.512 + 7 * 0.05 + 0.018)
    assert c.queue_prefill_seconds([400, 400], 0, 32, late_after=-1.0) == pytest.approx(0.512 + 5 * 0.065 + 0.023)
