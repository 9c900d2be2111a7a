"""Workloads are seeded: the same seed gives the same requests, in any order they are drawn."""

from __future__ import annotations

import itertools

import pytest

from kiln.bench.loadgen import poisson_arrivals
from kiln.bench.text import ExactCounter, RatioCounter, TextSource, render
from kiln.bench.workloads import TEMPLATE_MARGIN, WORKLOADS, RequestSpec, fit_context, request_specs


def first(workload, seed, n=50, context=2048, cap=None) -> list[RequestSpec]:
    return list(itertools.islice(request_specs(workload, seed, context, cap), n))


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_same_seed_same_requests_different_seed_different(workload):
    assert first(workload, 0) == first(workload, 0)
    assert first(workload, 0) != first(workload, 1)
    assert first(workload, 0)[:10] == first(workload, 0, n=10)      # a prefix of a longer run


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_every_request_fits_the_context(workload):
    for spec in first(workload, 3, n=200, context=512):
        assert spec.prefix_tokens + spec.prompt_tokens + spec.max_tokens + TEMPLATE_MARGIN <= 512
        assert spec.prompt_tokens >= 1 and spec.max_tokens >= 1


def test_workload_shapes():
    shared = first("shared-prefix", 0)
    assert len({(s.prefix_offset, s.prefix_tokens) for s in shared}) == 1 and shared[0].prefix_tokens == 1024
    assert all(s.prompt_tokens <= 48 for s in shared)
    cancels = [s.cancel_after for s in first("cancel", 0, n=400) if s.cancel_after is not None]
    assert 0.2 < len(cancels) / 400 < 0.4 and all(1 <= k <= 8 for k in cancels)
    assert all(s.prompt_tokens + s.max_tokens + TEMPLATE_MARGIN == 2048 for s in first("max-context", 0))
    lengths = [s.prompt_tokens for s in first("long-short", 0, n=400)]
    assert sum(n > 1000 for n in lengths) > 20 and sum(n <= 64 for n in lengths) > 300


def test_max_tokens_cap_and_a_context_too_small():
    assert all(s.max_tokens <= 8 for s in first("chat", 0, cap=8))
    cut = [s for s in first("cancel", 0, n=200, cap=4) if s.cancel_after is not None]
    assert cut and all(s.cancel_after < s.max_tokens for s in cut)      # still hang up early
    with pytest.raises(ValueError, match="no room"):
        fit_context(RequestSpec(0, 10, 64, 0, prefix_tokens=100), context_len=128, max_tokens_cap=None)


def test_poisson_arrivals_are_seeded_and_near_the_rate():
    a = poisson_arrivals(10.0, 60.0, seed=0)
    assert a == poisson_arrivals(10.0, 60.0, seed=0) != poisson_arrivals(10.0, 60.0, seed=1)
    assert 500 < len(a) < 700 and a == sorted(a) and a[-1] < 60.0
    assert len(poisson_arrivals(10.0, 60.0, seed=0, max_requests=7)) == 7


def test_rendered_text_has_the_asked_token_count():
    from kiln.compiler.export.presets import byte_level_tokenizer

    counter = ExactCounter(byte_level_tokenizer())               # one token per byte
    source = TextSource(counter)
    for spec in first("shared-prefix", 0, n=5, context=1024):
        prompt = render(spec, source)
        assert spec.prompt_tokens - 20 < counter.count(prompt.user) <= spec.prompt_tokens   # within a word
        assert spec.prefix_tokens - 20 < counter.count(prompt.system) <= spec.prefix_tokens
    assert render(first("chat", 0, n=1)[0], source).system is None
    assert source.text(0, 1) != ""                               # a word, even over a tiny budget


def test_ratio_counter_stays_under_its_estimate():
    words = ["abcd"] * 100                                      # 5 characters each with the space
    assert RatioCounter(chars_per_token=5.0, safety=1.0).words_for(words, 10) == 10
    assert RatioCounter(chars_per_token=5.0, safety=0.9).words_for(words, 10) == 9
