"""Greedy agreement up to the first near-tie: what two numerically different paths guarantee.

Two paths that compute the same model with different arithmetic (a batch beside other rows or
alone, another thread count, chunked or whole prefill, a prefix-cache hit, speculative
verification, another backend, HF transformers) give logits that differ in the last bits or, with
quantized or bf16 compute, by more. Greedy decoding turns such a difference into another token
only where the top two candidates nearly tie, and after that the sequences legitimately part
(their contexts differ). So, as vLLM's `check_logprobs_close` does: walk the two greedy sequences;
at the first position they differ, require each side's token in the other side's top-k with a
small logprob gap (the other side found it nearly as likely as its own choice), and stop there.

A real bug (a broken cache, a wrong KV slot, a wrong position) yields tokens the other side finds
unlikely within a few steps, and fails here. Bit-exact comparisons (`==`) stay where a path's
arithmetic is identical by construction (the same engine, request and batch shapes; a fake engine).

Per-position top-k entries may be kiln's TokenLogprobs (`CompletionOutput.logprobs`), a mapping
{token: logprob}, or (token, logprob) pairs. Tokens are any hashable value (ids, or strings from an
OpenAI-style API's top_logprobs). Logprobs are of the raw logits, so a logprob gap is a logit gap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

TOP_K = 5
# The largest gap, in nats, between a side's own greedy choice and the other side's token, in its own
# distribution, at the position they part. Where two sides' logits differ by at most d, a flip has a
# gap of at most 2d. Keep it near the path's noise: the tiny test models are near-uniform (their top-5
# span ~0.6 nats), so a loose gap would let a wrong context through.
# fp32 paths: batch shapes, chunking and backends move tiny-llama's logprobs by ~1e-6 here, HF
# parity holds logits within 1e-3 (tests/golden), other CPUs' kernels may differ more.
FP32_GAP = 0.02
# int8/int4 weights or an f16/int8 KV pool on fp32 compute, activations quantized per call (w8a8):
# tiny-llama w8a8 moves by up to 0.054 between a batch and a lone prompt.
QUANT_GAP = 0.2
# bf16 compute with activations quantized to int8 per call (OpenVINO int4 on AVX-512 BF16 parts):
# SmolLM2's logprobs move by up to 0.42 between a batch and a lone prompt; its top-5 span 2-6 nats.
BF16_GAP = 1.0


def top_of(entry) -> dict:
    """One position's top-k as {token: logprob}."""
    if entry is None:
        return {}
    if hasattr(entry, "top"):                     # kiln's TokenLogprobs
        entry = entry.top
    if isinstance(entry, Mapping):
        return dict(entry)
    return {tok: float(lp) for tok, lp in entry}


def _near(own: dict, own_token, other_token, k: int, max_gap: float) -> str | None:
    """Why other_token is no near-tie of own_token in this side's top-k, or None when it is."""
    ranked = sorted(own.items(), key=lambda t: -t[1])[:k]
    top = dict(ranked)
    if other_token not in top:
        return f"{other_token!r} is not in its top-{k} {[t for t, _ in ranked]}"
    best = top.get(own_token, ranked[0][1])
    gap = best - top[other_token]
    if gap > max_gap:
        return f"{other_token!r} is {gap:.3g} nats below its choice {own_token!r} (> {max_gap:g})"
    return None


def assert_greedy_close(a_tokens: Sequence, a_top: Sequence | None, b_tokens: Sequence, b_top: Sequence | None,
                        *, k: int = TOP_K, max_gap: float = FP32_GAP, names: tuple[str, str] = ("a", "b"),
                        same_length: bool = True) -> int | None:
    """Assert two greedy sequences agree up to their first near-tie; return its position (None: equal).

    a_top / b_top: per-position top-k of each side (None for a side computed without logprobs: then
    only the scored side judges the tie, and with neither the sequences must be equal). With
    same_length, sequences equal over their common length must also have the same length.
    """
    a_name, b_name = names
    for t, (a, b) in enumerate(zip(a_tokens, b_tokens)):
        if a == b:
            continue
        if a_top is None and b_top is None:
            raise AssertionError(f"{a_name} and {b_name} part at token {t}: {a!r} vs {b!r} (no logprobs to judge a tie)")
        problems = []
        if a_top is not None:
            why = _near(top_of(a_top[t]), a, b, k, max_gap)
            problems += [f"in {a_name}'s distribution {why}"] if why else []
        if b_top is not None:
            why = _near(top_of(b_top[t]), b, a, k, max_gap)
            problems += [f"in {b_name}'s distribution {why}"] if why else []
        if problems:
            raise AssertionError(f"{a_name} and {b_name} diverge at token {t} ({a!r} vs {b!r}), not a near-tie: "
                                 + "; ".join(problems)
                                 + f"\n{a_name}: {list(a_tokens)}\n{b_name}: {list(b_tokens)}")
        return t
    if same_length:
        assert len(a_tokens) == len(b_tokens), \
            f"{a_name} has {len(a_tokens)} tokens, {b_name} {len(b_tokens)}, equal over the common part"
    return None


def logits_top(row, k: int = TOP_K) -> dict[int, float]:
    """One step's raw logits (a reference's: HF transformers' `output_logits`) as kiln reports
    them: the top-k token ids and their logprobs."""
    import numpy as np

    row = np.asarray(row, dtype=np.float64)
    logprobs = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
    ids = np.argsort(-logprobs, kind="stable")[:k]
    return {int(i): float(logprobs[i]) for i in ids}


def tokens_and_top(x) -> tuple[list, list | None]:
    """A greedy result as (tokens, per-position top-k or None): a CompletionOutput (or anything with
    token_ids and logprobs), a (tokens, top) pair, or a bare token list (unscored)."""
    if hasattr(x, "token_ids"):
        logprobs = getattr(x, "logprobs", None)
        return list(x.token_ids), (list(logprobs) if logprobs else None)
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], (list, tuple)):
        return list(x[0]), (list(x[1]) if x[1] is not None else None)
    return list(x), None


def assert_outputs_close(a, b, **kw) -> int | None:
    """assert_greedy_close on two results in any form tokens_and_top takes."""
    (a_tokens, a_top), (b_tokens, b_top) = tokens_and_top(a), tokens_and_top(b)
    return assert_greedy_close(a_tokens, a_top, b_tokens, b_top, **kw)


def assert_all_close(a_list: Sequence, b_list: Sequence, **kw) -> list[int | None]:
    """assert_outputs_close pairwise over two equally long lists; returns each pair's near-tie position."""
    assert len(a_list) == len(b_list), f"{len(a_list)} results vs {len(b_list)}"
    names = kw.pop("names", ("a", "b"))
    return [assert_outputs_close(a, b, names=(f"{names[0]}[{i}]", f"{names[1]}[{i}]"), **kw)
            for i, (a, b) in enumerate(zip(a_list, b_list))]

