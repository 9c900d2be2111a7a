"""logit_bias in the sampler (OpenAI semantics) and the bounds SamplingParams enforces."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kiln.runtime.sampler import Sampler, SamplingState
from kiln.runtime.sampling_params import SamplingParams


def _sample(logits, **params) -> list[int]:
    state = SamplingState.from_params(SamplingParams(**params))
    return [Sampler().sample(np.asarray([logits], np.float32), [state]).token_ids[0] for _ in range(20)]


def test_logit_bias_moves_greedy_and_sampled_choices():
    logits = [5.0, 1.0, 0.0, -1.0]
    assert _sample(logits, temperature=0) == [0] * 20
    assert _sample(logits, temperature=0, logit_bias={2: 10.0}) == [2] * 20
    # -100 on the favourite and the rest near-equal: the favourite is never drawn.
    assert 0 not in _sample(logits, temperature=1.0, seed=3, logit_bias={0: -100})


def test_logit_bias_leaves_logprobs_raw_and_the_input_untouched():
    logits = np.asarray([[2.0, 1.0, 0.0]], np.float32)
    state = SamplingState.from_params(SamplingParams(temperature=0, logprobs=1, logit_bias={2: 50}))
    out = Sampler().sample(logits, [state])
    assert out.token_ids == [2]
    assert out.logprobs[0].top[0][0] == 0          # the raw model's favourite
    assert logits.tolist() == [[2.0, 1.0, 0.0]]


def test_logit_bias_past_the_row_is_skipped_not_fatal():
    state = SamplingState.from_params(SamplingParams(temperature=0, logit_bias={1: 100, 10_000: 100}))
    assert Sampler().sample(np.zeros((1, 3), np.float32), [state]).token_ids == [1]


def test_logit_bias_is_stored_hashable_and_sorted():
    p = SamplingParams(logit_bias={9: 1, 3: -2.5})
    assert p.logit_bias == ((3, -2.5), (9, 1.0)) and hash(p) == hash(SamplingParams(logit_bias={3: -2.5, 9: 1}))


@pytest.mark.parametrize("bad, words", [
    (dict(temperature=math.nan), "temperature must be a finite"),
    (dict(top_p=math.inf), "top_p must be a finite"),
    (dict(repetition_penalty=1e39), "repetition_penalty must be in"),
    (dict(temperature=1e6), "temperature must be <= 100"),
    (dict(temperature=-1), "temperature must be >= 0"),
    (dict(seed=-1), "seed must be in"),
    (dict(seed=1 << 64), "seed must be in"),
    (dict(top_k=1 << 40), "top_k must be in"),
    (dict(logit_bias={1: 100.5}), "logit_bias values"),
    (dict(logit_bias={1: math.nan}), "logit_bias values"),
    (dict(logit_bias={-1: 1}), "logit_bias token ids"),
    (dict(logit_bias={i: 1 for i in range(1025)}), "logit_bias has 1025"),
])
def test_out_of_range_params_are_refused(bad, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**bad)
