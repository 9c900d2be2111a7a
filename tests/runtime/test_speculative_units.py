"""Speculative decoding's parts without a model: prompt lookup, the adaptive controller, greedy
verification, and the statistical check that rejection sampling leaves each position's
distribution unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from kiln.config import SpeculativeConfig, SpeculativeMethod
from kiln.runtime.request import Request
from kiln.runtime.sampler import SamplingState, target_weights
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative.adaptive import BATCHED_OFF_RATE, MAX_BACKOFF, Acceptance, load_limit
from kiln.runtime.speculative.ngram import NgramIndex, NgramProposer
from kiln.runtime.speculative.speculator import Speculator
from kiln.runtime.speculative.verify import verify


# ---- prompt lookup ----

def test_ngram_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    index = NgramIndex(ngram_min=1, ngram_max=3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # suffix (2, 6, 7) never occurred; (6, 7) last ended at 7, followed by 2, 6, 7
    assert index.propose(tokens, 3) == [2, 6, 7]
    assert index.propose(tokens + [2], 2) == [6, 7]           # (7, 2) ended at 8


def test_ngram_proposes_nothing_without_a_match_and_never_the_suffix_itself():
    index = NgramIndex(ngram_min=2, ngram_max=3)
    assert index.propose([1, 2, 3, 4], 5) == []
    assert index.propose([1, 2, 3, 4, 1], 5) == []             # a 1-gram match is below ngram_min
    assert index.propose([1, 2, 3, 4, 1, 2], 5) == [3, 4, 1, 2]


def test_ngram_proposer_keeps_one_index_per_request_and_forgets_it():
    proposer = NgramProposer(2, 3)
    a = Request("a", [1, 2, 3, 1, 2], SamplingParams())
    b = Request("b", [4, 5, 6], SamplingParams())
    assert proposer.propose([(a, 2), (b, 2)]) == {"a": [3, 1]}
    proposer.forget("a")
    assert "a" not in proposer._indexes and "b" in proposer._indexes


# ---- adaptivity ----

def test_acceptance_shrinks_k_then_pauses_with_doubling_backoff_and_recovers():
    record = Acceptance()
    assert record.proposals(5) == 3                            # the prior: ceil(5 x 0.6)
    record.observe(3, 0)
    assert record.proposals(5) == 3                            # 0.42: fewer tokens, still on
    record.observe(3, 0)
    assert record.proposals(5) == 2                            # 0.29
    record.observe(2, 0)                                       # 0.21: not yet off
    record.observe(2, 0)                                       # 0.15: off for one step
    assert [record.proposals(5) for _ in range(2)] == [0, 1]
    record.observe(1, 0)                                       # still bad: off for two steps
    assert [record.proposals(5) for _ in range(3)] == [0, 0, 1]
    record.observe(1, 1)                                       # a good verification resets the backoff
    assert record.backoff == 0 and record.proposals(5) >= 1
    for _ in range(20):
        record.observe(1, 0)
    assert record.backoff == MAX_BACKOFF


def test_load_limit_turns_speculation_off_for_big_batches():
    assert [load_limit(d, 5, 16) for d in (0, 1, 2, 4, 8, 9, 16)] == [0, 5, 5, 3, 1, 0, 0]
    assert [load_limit(d, 5, 16, max_decodes=1) for d in (1, 2)] == [5, 0]
    assert SpeculativeConfig().max_decodes == 1                  # the default: single streams only


def test_speculator_never_proposes_past_max_tokens_nor_for_logprobs_requests():
    speculator = Speculator(NgramProposer(1, 2), num_speculative_tokens=5, max_step_tokens=16)
    near_end = Request("a", [1, 2, 3, 1, 2], SamplingParams(max_tokens=3))
    near_end.append_output_token(3)
    with_logprobs = Request("b", [1, 2, 3, 1, 2], SamplingParams(max_tokens=9, logprobs=2))
    proposals = speculator.propose([near_end, with_logprobs])
    assert proposals == {"a": [1]}                             # 3 max - 1 output - 1 to sample


def test_speculative_flag_parses():
    assert SpeculativeConfig.parse("ngram", 3) == SpeculativeConfig(num_speculative_tokens=3)
    draft = SpeculativeConfig.parse("draft:/models/small")
    assert draft.method is SpeculativeMethod.DRAFT and str(draft.draft_path) == "/models/small"
    for bad in ("medusa", "draft", "ngram:/x"):
        with pytest.raises(ValueError):
            SpeculativeConfig.parse(bad)


# ---- greedy verification ----

def _rows(best: list[int], vocab: int = 8) -> np.ndarray:
    rows = np.zeros((len(best), vocab), np.float32)
    rows[np.arange(len(best)), best] = 5.0
    return rows


def _state(**params) -> SamplingState:
    return SamplingState.from_params(SamplingParams(**params))


@pytest.mark.parametrize("proposed, expected", [
    ([1, 2, 3], [1, 2, 3, 4]),        # all kept, plus the token after them
    ([1, 5, 3], [1, 2]),              # the first miss ends the step with the row's own token
    ([6, 2, 3], [1]),                 # nothing kept: the step still makes one token
])
def test_greedy_verification_keeps_the_argmax_prefix(proposed, expected):
    state = _state(temperature=0)
    assert verify(_rows([1, 2, 3, 4]), proposed, state) == expected
    assert state.output_counts == {t: expected.count(t) for t in expected}


def test_penalized_greedy_verification_sees_the_tokens_kept_before_each_row():
    """Row 1 prefers token 1 by a little; the repetition penalty on the kept token 1 (row 0)
    must turn it to token 2, as a one-token-per-step decode would."""
    rows = np.zeros((2, 8), np.float32)
    rows[0, 1] = 5.0
    rows[1, 1], rows[1, 2] = 3.0, 2.0
    assert verify(rows, [1], _state(temperature=0, repetition_penalty=2.0)) == [1, 2]
    assert verify(rows, [1], _state(temperature=0)) == [1, 1]


# ---- rejection sampling: the distribution is unchanged ----

TRIALS = 12_000
LOGITS = np.log(np.array([[0.35, 0.25, 0.2, 0.1, 0.06, 0.04],
                          [0.05, 0.1, 0.4, 0.3, 0.1, 0.05]], np.float32))


def _target(row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution plain sampling draws from (the sampler's own filtered weights)."""
    ids, weights = target_weights(row, params)
    probs = np.zeros(len(row))
    probs[np.arange(len(row)) if ids is None else ids] = weights / weights.sum()
    return probs


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=4),
    dict(temperature=1.3, top_p=0.8),
], ids=["plain", "top_k", "top_p"])
@pytest.mark.parametrize("proposal", [0, 3, 5], ids=["likely", "unlikely", "filtered-or-rare"])
def test_rejection_sampling_keeps_each_position_distribution(params, proposal):
    params = SamplingParams(**params, seed=None)
    state = SamplingState.from_params(SamplingParams(**{**params.__dict__, "seed": 7}))
    first = np.zeros(6)
    second = np.zeros(6)           # the token after an accepted first proposal
    for _ in range(TRIALS):
        tokens = verify(LOGITS, [proposal], state)
        first[tokens[0]] += 1
        if len(tokens) == 2:
            second[tokens[1]] += 1
    expected_first = _target(LOGITS[0], params)
    expected_second = _target(LOGITS[1], params)
    _assert_same_distribution(first, expected_first)
    if second.sum() >= 500:
        _assert_same_distribution(second, expected_second)


def _assert_same_distribution(counts: np.ndarray, probs: np.ndarray) -> None:
    support = probs > 0
    assert counts[~support].sum() == 0, "a token the filters remove was emitted"
    probs = probs[support].astype(np.float64)
    p_value = chisquare(counts[support], probs / probs.sum() * counts[support].sum()).pvalue
    assert p_value > 1e-4, (counts, probs)


def test_the_statistical_check_catches_a_biased_verifier():
    """Keeping the proposal every time skews the first position towards it: the same check fails."""
    counts = np.zeros(6)
    counts[3] = TRIALS
    with pytest.raises(AssertionError):
        _assert_same_distribution(counts, np.exp(LOGITS[0]))


def test_runtime_knobs_carry_the_speculative_flags():
    from kiln.config_options import runtime_config

    assert runtime_config().speculative is None
    config = runtime_config(speculative="ngram", num_speculative_tokens="3")   # Triton passes text
    assert config.speculative == SpeculativeConfig(num_speculative_tokens=3)
    with pytest.raises(ValueError, match="needs --speculative"):
        runtime_config(num_speculative_tokens=3)


def test_beside_other_decodes_a_middling_acceptance_pauses():
    alone, batched = Acceptance(), Acceptance()
    alone.observe(2, 1)                                        # 50%: fine when decoding alone
    batched.observe(2, 1, off_rate=BATCHED_OFF_RATE)           # not worth its rows in a batch
    assert alone.proposals(5) == 3 and batched.proposals(5) == 0
    speculator = Speculator(NgramProposer(1, 2), num_speculative_tokens=5, max_step_tokens=16)
    a = Request("a", [1, 2, 1, 2], SamplingParams(max_tokens=20))
    b = Request("b", [3, 4, 3, 4], SamplingParams(max_tokens=20))
    assert set(speculator.propose([a, b])) == {"a", "b"}
    speculator.observe("a", 2, 1)
    speculator.observe("b", 2, 2)
    assert set(speculator.propose([a, b])) == {"b"}
