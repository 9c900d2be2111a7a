"""Verification: the target model's logits at each proposed position decide how many of the
proposals a request keeps and which token follows them.

Greedy: a proposal is kept while it is the row's argmax; the first row whose argmax differs (or
the row after the last proposal) gives the next token. The output is the non-speculative one.

Sampling: rejection sampling (Leviathan et al. 2023; Chen et al. 2023) with a point-mass draft,
which both proposers are (prompt lookup, and a draft model decoding greedily). Proposal x at a
row whose target distribution is p is kept with probability p(x); when it is rejected the token
is drawn from p with x removed, renormalised. So each position's token has distribution p
exactly: P(x) = p(x) + 0 and, for y != x, P(y) = (1 - p(x)) p(y) / (1 - p(x)) = p(y).

NOTE: rows are verified one at a time, each after the tokens kept before it were appended to
the request's SamplingState, so repetition, frequency and presence penalties see exactly the
tokens a non-speculative decode would have seen at that position.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kiln.runtime.sampler import SamplingState, apply_penalties, draw, sample_row, target_weights


def verify(rows: np.ndarray, proposed: Sequence[int], state: SamplingState) -> list[int]:
    """The tokens this step commits: the kept proposals, then one more. rows: [k+1, V] raw
    logits at the last committed token and at each of the k proposals. Appends each token
    to `state` (the runner owns it)."""
    if len(rows) != len(proposed) + 1:
        raise ValueError(f"verification needs {len(proposed) + 1} rows of logits, got {len(rows)}")
    if not state.params.greedy or state.penalized:
        return _sequential(rows, proposed, state)
    tokens = _greedy(rows, proposed)
    for t in tokens:
        state.append(t)
    return tokens


def _greedy(rows: np.ndarray, proposed: Sequence[int]) -> list[int]:
    best = rows.argmax(axis=1).tolist()
    kept = 0
    while kept < len(proposed) and best[kept] == proposed[kept]:
        kept += 1
    return list(proposed[:kept]) + [best[kept]]


def _sequential(rows: np.ndarray, proposed: Sequence[int], state: SamplingState) -> list[int]:
    kept: list[int] = []
    for i, row in enumerate(rows):
        row = apply_penalties(row[None, :], [state])[0]
        if i == len(proposed):
            token = int(row.argmax()) if state.params.greedy else sample_row(row, state.params, state.rng)
        else:
            token = _check(row, proposed[i], state)
        state.append(token)
        kept.append(token)
        if i == len(proposed) or token != proposed[i]:
            return kept
    raise AssertionError("unreachable: the row after the last proposal returns")


def _check(row: np.ndarray, proposal: int, state: SamplingState) -> int:
    """The proposal if this row keeps it, else the token to emit instead."""
    if state.params.greedy:
        return int(row.argmax())
    ids, weights = target_weights(row, state.params)
    where = np.flatnonzero(ids == proposal) if ids is not None else [proposal]
    p = weights[where[0]] / weights.sum(dtype=np.float64) if len(where) else 0.0
    if state.rng.random() < p:
        return proposal
    rest = weights.astype(np.float64)
    if len(where):
        rest[where[0]] = 0.0
    if rest.sum() <= 0.0:           # p rounded just below 1: nothing else can be drawn
        return proposal
    pick = draw(rest, state.rng.random())
    return int(pick if ids is None else ids[pick])
