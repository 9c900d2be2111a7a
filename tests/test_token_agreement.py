"""The near-tie comparison the suite uses across numerically different paths (tests/token_agreement.py):
it passes where two greedy sequences part at a near-tie and fails on a real divergence."""

from __future__ import annotations

import numpy as np
import pytest
from token_agreement import FP32_GAP, assert_all_close, assert_greedy_close, assert_outputs_close

from kiln.runtime.sampler import Sampler, SamplingState
from kiln.runtime.sampling_params import SamplingParams

VOCAB = 64


def _top(*pairs):
    return dict(pairs)


def test_equal_sequences_agree_everywhere():
    tops = [_top((1, -0.1), (2, -3.0))] * 3
    assert assert_greedy_close([1, 1, 1], tops, [1, 1, 1], tops) is None


def test_a_near_tie_passes_and_ends_the_comparison():
    a_top = [_top((5, -1.0)), _top((7, -0.69), (8, -0.70), (9, -4.0))]
    b_top = [_top((5, -1.0)), _top((8, -0.69), (7, -0.695), (9, -4.0))]
    # after the tie the sequences may part freely: their contexts differ
    assert assert_greedy_close([5, 7, 1, 2], a_top, [5, 8, 30, 40], b_top) == 1


def test_a_token_outside_the_other_sides_top_k_fails():
    a_top = [_top((7, -0.1), (8, -3.0), (9, -4.0))]
    b_top = [_top((40, -0.1), (7, -5.0))]
    with pytest.raises(AssertionError, match="diverge at token 0.*not in its top-5"):
        assert_greedy_close([7], a_top, [40], b_top)


def test_a_token_in_the_top_k_but_far_below_fails():
    a_top = [_top((7, -0.05), (8, -3.0))]
    b_top = [_top((8, -0.05), (7, -3.1))]
    with pytest.raises(AssertionError, match="nats below its choice"):
        assert_greedy_close([7], a_top, [8], b_top)
    assert assert_greedy_close([7], a_top, [8], b_top, max_gap=3.5) == 0          # a looser tolerance


def test_top_k_is_cut_at_k():
    ranked = [(t, -0.001 * t) for t in range(10)]                 # token 6 is 6th: outside a top-5
    with pytest.raises(AssertionError, match="top-5"):
        assert_greedy_close([0], [ranked], [6], [ranked[::-1]])
    assert assert_greedy_close([0], [ranked], [6], [ranked[::-1]], k=7) == 0


def test_one_scored_side_judges_alone_and_no_scores_means_equal():
    a_top = [_top((1, -0.1)), _top((7, -0.69), (8, -0.70))]
    assert assert_greedy_close([1, 7], a_top, [1, 8], None) == 1
    with pytest.raises(AssertionError, match="not in its top-5"):
        assert_greedy_close([1, 7], a_top, [1, 50], None)
    with pytest.raises(AssertionError, match="no logprobs"):
        assert_greedy_close([1, 7], None, [1, 8], None)
    assert assert_greedy_close([1, 7], None, [1, 7], None) is None


def test_lengths_must_match_unless_told():
    with pytest.raises(AssertionError, match="3 tokens"):
        assert_greedy_close([1, 2, 3], None, [1, 2], None)
    assert assert_greedy_close([1, 2, 3], None, [1, 2], None, same_length=False) is None


def test_string_tokens_as_an_openai_api_reports_them():
    a = (["Hel", "lo", " world"], [{"Hel": -0.1}, {"lo": -0.2}, {" world": -0.9, " there": -0.91}])
    b = (["Hel", "lo", " there"], [{"Hel": -0.1}, {"lo": -0.2}, {" there": -0.9, " world": -0.915}])
    assert assert_outputs_close(a, b) == 2


# ---- on a toy model decoded by kiln's sampler: noise flips a tie, a broken cache diverges ----

def _toy_logits(context: list[int]) -> np.ndarray:
    """A deterministic next-token function of the whole context, with clear margins except where
    rigged: after [.., 3] tokens 11 and 12 tie to within 1e-4."""
    rng = np.random.default_rng(sum((i + 1) * t for i, t in enumerate(context)) % 2**32)
    row = rng.standard_normal(VOCAB).astype(np.float32) * 4
    if context[-1] == 3:
        row[11], row[12] = row.max() + 1.0, row.max() + 1.0 - 1e-4
    return row


def _decode(prompt: list[int], steps: int, perturb=lambda ctx, row: row):
    sampler, state = Sampler(), SamplingState.from_params(SamplingParams(temperature=0, logprobs=5), prompt)
    ctx, tokens, tops = list(prompt), [], []
    for _ in range(steps):
        out = sampler.sample(perturb(ctx, _toy_logits(ctx))[None], [state])
        token = out.token_ids[0]
        state.append(token)
        ctx.append(token)
        tokens.append(token)
        tops.append(out.logprobs[0])
    return tokens, tops


def test_fp32_noise_at_a_rigged_tie_is_a_near_tie():
    prompt = [5, 9, 3]
    ref = _decode(prompt, 8)

    def noise(ctx, row):                       # 2e-4 relative noise, as another batch shape gives
        row = row * (1 + 2e-4 * np.random.default_rng(len(ctx)).standard_normal(row.shape).astype(np.float32))
        if ctx[-1] == 3:
            row[12] += 3e-4                    # ... which, at the tie, lands the other way
        return row
    other = _decode(prompt, 8, noise)
    assert ref[0][0] == 11 and other[0][0] == 12
    assert assert_greedy_close(*ref, *other, max_gap=FP32_GAP) == 0


def test_a_stale_cache_diverges_and_fails():
    """A 'cache' that forgot the last two tokens: the context is wrong, and its tokens fall outside
    the reference's top-5 within a few steps."""
    prompt = [5, 9, 17, 40]
    ref = _decode(prompt, 8)
    broken = _decode(prompt, 8, perturb=lambda ctx, row: _toy_logits(ctx[:-2]))
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_greedy_close(*ref, *broken)


def test_all_close_names_the_failing_pair():
    good = ([1, 2], [_top((1, 0.0)), _top((2, 0.0))])
    bad = ([1, 9], [_top((1, 0.0)), _top((9, 0.0))])
    assert assert_all_close([good, good], [good, good]) == [None, None]
    with pytest.raises(AssertionError, match=r"batched\[1\] and alone\[1\] diverge at token 1"):
        assert_all_close([good, bad], [good, good], names=("batched", "alone"))


def test_logits_top_matches_the_samplers_logprobs():
    from token_agreement import logits_top

    row = np.random.default_rng(1).standard_normal(VOCAB).astype(np.float32) * 3
    state = SamplingState.from_params(SamplingParams(temperature=0, logprobs=5))
    mine = dict(Sampler().sample(row[None], [state]).logprobs[0].top)
    theirs = logits_top(row)
    assert list(mine) == list(theirs) and all(abs(mine[t] - theirs[t]) < 1e-5 for t in mine)
