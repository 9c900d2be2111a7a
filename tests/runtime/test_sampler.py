import copy
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.runtime import sampler as sampler_module
from kiln.runtime.sampler import Sampler, SamplingState, TokenLogprobs, apply_penalties
from kiln.runtime.sampling_params import SamplingParams

SAMPLER = Sampler()


def states(*params: SamplingParams, prompt=()) -> list[SamplingState]:
    return [SamplingState.from_params(p, prompt) for p in params]


def random_logits(rows: int, vocab: int, scale: float = 3.0, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(np.float32)


def draw_counts(logits_row, params: SamplingParams, draws: int) -> np.ndarray:
    """Token frequencies over `draws` samples: a batch of identical rows, one seeded state each."""
    rows = 100
    batch = np.repeat(np.asarray(logits_row, dtype=np.float32)[None], rows, axis=0)
    reqs = [SamplingState.from_params(dataclasses.replace(params, seed=i)) for i in range(rows)]
    counts = np.zeros(len(logits_row), dtype=np.int64)
    for _ in range(draws // rows):
        np.add.at(counts, SAMPLER.sample(batch, reqs).token_ids, 1)
    return counts


# ---- greedy and top-k ----

def test_greedy_is_argmax():
    logits = random_logits(8, 1000)
    out = SAMPLER.sample(logits, states(*[SamplingParams(temperature=0)] * 8))
    assert out.token_ids == logits.argmax(axis=1).tolist()
    assert out.logprobs == [None] * 8


def test_top_k_1_is_greedy():
    logits = random_logits(8, 49152)
    reqs = states(*[SamplingParams(temperature=1.3, top_k=1, seed=i) for i in range(8)])
    assert SAMPLER.sample(logits, reqs).token_ids == logits.argmax(axis=1).tolist()


def test_greedy_consumes_no_randomness():
    (state,) = states(SamplingParams(temperature=0, seed=7))
    before = copy.deepcopy(state.rng.bit_generator.state)
    SAMPLER.sample(random_logits(1, 100), [state])
    assert state.rng.bit_generator.state == before


def test_each_sampled_token_consumes_exactly_one_draw():
    params = SamplingParams(temperature=0.8, top_k=30, top_p=0.9, min_p=0.01, seed=11)
    (state,) = states(params)
    for step in range(5):
        SAMPLER.sample(random_logits(1, 49152, seed=step), [state])
    reference = np.random.default_rng(11)
    for _ in range(5):
        reference.random()
    assert state.rng.bit_generator.state == reference.bit_generator.state


@pytest.mark.parametrize("scale", [0.5, 3.0, 10.0])
def test_top_k_candidates_are_the_k_largest(scale):
    row = random_logits(1, 49152, scale)[0]
    ids, _ = sampler_module._filtered_weights(row, SamplingParams(top_k=50))
    assert set(ids.tolist()) == set(np.argsort(-row)[:50].tolist())


# ---- seeds and batch invariance ----

def run_steps(target_row_logits, batch_for_step, target_index, state, others, steps):
    tokens = []
    for step in range(steps):
        batch = batch_for_step(step)
        batch[target_index] = target_row_logits[step]
        reqs = others[:target_index] + [state] + others[target_index:]
        out = SAMPLER.sample(batch, reqs)
        for req, token in zip(reqs, out.token_ids):
            req.append(token)
        tokens.append(out.token_ids[target_index])
    return tokens


def test_seeded_row_is_batch_invariant():
    steps, vocab = 25, 49152
    rows = random_logits(steps, vocab, seed=1)
    params = SamplingParams(temperature=0.9, top_k=200, top_p=0.95, repetition_penalty=1.3, seed=1234)
    alone = run_steps(rows, lambda s: np.empty((1, vocab), np.float32), 0,
                      SamplingState.from_params(params, [1, 2, 3]), [], steps)
    others = states(SamplingParams(temperature=0), SamplingParams(temperature=1.0),
                    SamplingParams(temperature=0.7, min_p=0.1, seed=99), SamplingParams(top_p=0.5, logprobs=3))
    crowded = run_steps(rows, lambda s: random_logits(5, vocab, seed=100 + s), 2,
                        SamplingState.from_params(params, [1, 2, 3]), others, steps)
    assert alone == crowded
    other_seed = dataclasses.replace(params, seed=4321)
    assert run_steps(rows, lambda s: np.empty((1, vocab), np.float32), 0,
                     SamplingState.from_params(other_seed, [1, 2, 3]), [], steps) != alone


# ---- distributions ----

def test_temperature_frequencies_match_softmax():
    logits = np.array([1.0, 0.5, 0.0, -0.5, -1.0])
    counts = draw_counts(logits, SamplingParams(temperature=0.7), 20_000)
    expected = np.exp(logits / 0.7) / np.exp(logits / 0.7).sum()
    np.testing.assert_allclose(counts / counts.sum(), expected, atol=0.015)


def test_temperature_frequencies_on_a_large_vocabulary():
    # Mass concentrated in a few tokens spread over blocks of the two-level draw.
    logits = np.full(49152, -30.0)
    logits[[3, 700, 20_000, 49_151]] = [0.0, 0.5, 1.0, 0.2]
    counts = draw_counts(logits, SamplingParams(temperature=1.0), 10_000)
    chosen = [3, 700, 20_000, 49_151]
    expected = np.exp(logits[chosen]) / np.exp(logits[chosen]).sum()
    assert counts.sum() == counts[chosen].sum()
    np.testing.assert_allclose(counts[chosen] / counts.sum(), expected, atol=0.02)


def test_top_p_samples_only_the_nucleus():
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    counts = draw_counts(logits, SamplingParams(top_p=0.75), 5_000)
    assert counts[2] == counts[3] == 0
    np.testing.assert_allclose(counts[:2] / counts.sum(), [0.625, 0.375], atol=0.03)


def reference_nucleus(row, temperature, top_p) -> set[int]:
    weights = np.exp((row - row.max()) / np.float32(temperature))
    order = np.argsort(-weights, kind="stable")
    cumulative = np.cumsum(weights[order], dtype=np.float64)
    target = top_p * weights.sum(dtype=np.float64)
    return set(order[: int(np.searchsorted(cumulative, target)) + 1].tolist())


@pytest.mark.parametrize("scale, top_p", [(5.0, 0.99), (3.0, 0.9), (1.0, 0.5), (0.3, 0.95)])
def test_top_p_keeps_exactly_the_nucleus_on_a_large_vocabulary(scale, top_p):
    # Peaked to flat: exercises the small head, the large head and the full sort.
    row = random_logits(1, 49152, scale)[0]
    ids, _ = sampler_module._filtered_weights(row, SamplingParams(top_p=top_p))
    assert set(ids.tolist()) == reference_nucleus(row, 1.0, top_p)


def test_min_p_drops_tokens_below_the_scaled_maximum():
    logits = np.log([0.5, 0.3, 0.15, 0.05])           # threshold 0.2 · 0.5 = 0.1
    counts = draw_counts(logits, SamplingParams(min_p=0.2), 5_000)
    assert counts[3] == 0 and (counts[:3] > 0).all()
    np.testing.assert_allclose(counts[:3] / counts.sum(), np.array([0.5, 0.3, 0.15]) / 0.95, atol=0.03)


def reference_allowed(row, p: SamplingParams) -> set[int]:
    order = np.argsort(-row, kind="stable")
    if p.top_k:
        order = order[: p.top_k]
    probs = np.exp((row[order] - row.max()) / p.temperature)
    probs /= probs.sum()
    keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1 if p.top_p < 1 else len(order)
    allowed = order[:keep]
    return {t for t, q in zip(allowed.tolist(), probs[:keep]) if q >= p.min_p * probs[0]}


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.integers(2, 3000),
       temperature=st.floats(0.2, 2.0), top_k=st.integers(0, 60),
       top_p=st.sampled_from([1.0, 0.95, 0.8, 0.3]), min_p=st.sampled_from([0.0, 0.05, 0.3]))
def test_sampled_token_is_always_allowed(seed, vocab, temperature, top_k, top_p, min_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    logits = random_logits(1, vocab, scale=2.0, seed=seed)
    allowed = reference_allowed(logits[0].astype(np.float64), params)
    (state,) = states(params)
    for _ in range(20):
        assert SAMPLER.sample(logits, [state]).token_ids[0] in allowed


# ---- penalties: exact arithmetic ----

ROW = np.array([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]], dtype=np.float32)


def penalized(prompt, output, **penalties) -> list[float]:
    (state,) = states(SamplingParams(**penalties), prompt=prompt)
    for token in output:
        state.append(token)
    return apply_penalties(ROW, [state])[0].tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_over_prompt_and_output():
    assert penalized([0, 1, 1], [3, 3, 4], repetition_penalty=2.0) == [1.0, -2.0, 0.5, 1.5, -4.0, 1.0]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    assert penalized([0, 1], [3, 3, 4], presence_penalty=0.25) == [2.0, -1.0, 0.5, 2.75, -2.25, 1.0]
    assert penalized([0, 1], [3, 3, 4], frequency_penalty=0.5) == [2.0, -1.0, 0.5, 2.0, -2.5, 1.0]


def test_penalties_compose_repetition_first():
    got = penalized([0, 1], [3, 3, 4], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    assert got == [1.0, -2.0, 0.5, 0.25, -4.75, 1.0]


def test_penalties_leave_the_input_alone():
    untouched = ROW.copy()
    (state,) = states(SamplingParams(repetition_penalty=2.0), prompt=[0])
    apply_penalties(ROW, [state])
    np.testing.assert_array_equal(ROW, untouched)
    assert apply_penalties(ROW, states(SamplingParams())) is ROW


def test_greedy_follows_penalized_logits():
    (state,) = states(SamplingParams(temperature=0, presence_penalty=0.5))
    logits = np.array([[3.0, 2.9]], dtype=np.float32)
    assert SAMPLER.sample(logits, [state]).token_ids == [0]
    state.append(0)
    assert SAMPLER.sample(logits, [state]).token_ids == [1]


# ---- logprobs ----

def log_softmax(row) -> np.ndarray:
    row = row.astype(np.float64)
    return row - row.max() - np.log(np.exp(row - row.max()).sum())


@pytest.mark.parametrize("vocab", [100, 49152])
def test_logprobs_are_log_softmax_of_the_raw_logits(vocab):
    logits = random_logits(2, vocab)
    params = SamplingParams(temperature=0.5, top_k=10, repetition_penalty=1.5, logprobs=5, seed=3)
    reqs = states(params, SamplingParams(temperature=0, logprobs=0), prompt=[0, 1, 2])
    out = SAMPLER.sample(logits, reqs)
    for row, token, lp in zip(logits, out.token_ids, out.logprobs):
        reference = log_softmax(row)
        assert isinstance(lp, TokenLogprobs)
        assert lp.token_logprob == pytest.approx(reference[token], abs=1e-5)
        expected_top = np.argsort(-reference)[: len(lp.top)].tolist()
        assert [t for t, _ in lp.top] == expected_top
        np.testing.assert_allclose([v for _, v in lp.top], reference[expected_top], atol=1e-5)
    assert len(out.logprobs[0].top) == 5 and out.logprobs[1].top == []


def test_logprobs_top_n_is_capped_by_the_vocabulary():
    out = SAMPLER.sample(np.array([[0.0, 1.0, 2.0]]), states(SamplingParams(temperature=0, logprobs=20)))
    assert [t for t, _ in out.logprobs[0].top] == [2, 1, 0]


def test_batch_shape_must_match_requests():
    with pytest.raises(ValueError, match="logits must be"):
        SAMPLER.sample(np.zeros((2, 5)), states(SamplingParams()))


@pytest.mark.parametrize("temperature", [1e-50, 1e-30, 1e-8, 5e-6])
def test_a_temperature_that_vanishes_in_float32_samples_greedily(temperature):
    """1e-50 is a valid positive float but 0 in float32: dividing the logits by it gave inf and NaN
    probabilities. Below GREEDY_BELOW a temperature is greedy (argmax), with no NaN anywhere."""
    logits = random_logits(8, 500, seed=3)
    params = SamplingParams(temperature=temperature, seed=1)
    assert params.greedy
    out = SAMPLER.sample(logits, states(*[params] * 8))
    assert (out.token_ids == logits.argmax(axis=1)).all()
