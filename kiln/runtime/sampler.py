"""Token sampling over a batch of logits, one independent random stream per request.

Order of operations for a row, as in HF transformers' generate():
penalties (repetition, then frequency and presence) → logit bias → grammar mask → temperature → top-k → top-p → min-p → draw.

NOTE: seeded sampling is batch-invariant. A sampled row reads only its own logits and its own
generator, goes through the same per-row code whatever else is in the batch, and consumes exactly
one `rng.random()` per token (inverse CDF). Greedy rows consume none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.structured.grammar import Guide, fill_masks

# Large candidate sets are narrowed to a head of the distribution before any partition or sort;
# the head is found from a strided sample of the row, so a 49k vocabulary is scanned only by
# vectorised comparisons. Full-vocabulary partition and sort remain the (exact) fallback.
HEAD_STRIDE = 16
NUCLEUS_HEADS = (256, 4096)     # head sizes tried, in order, before sorting everything
DRAW_BLOCK = 256


class TokenLogprobs(NamedTuple):
    token_logprob: float
    top: list[tuple[int, float]]      # (token id, logprob), most likely first


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


@dataclass(eq=False)
class SamplingState:
    """A request's sampling state; created once per request and owned by the caller.

    The caller appends each token it accepts; the sampler never does, so a discarded sample
    (an aborted or preempted request) leaves no trace in the penalties.
    """

    params: SamplingParams
    rng: np.random.Generator
    prompt_token_ids: np.ndarray                       # unique ids, for the repetition penalty
    output_counts: dict[int, int] = field(default_factory=dict)
    guide: Guide | None = None                          # the grammar a constrained request follows
    # Token ids that may not be sampled while fewer than params.min_tokens were (EOS, stop ids).
    min_tokens_banned: np.ndarray | None = None
    num_output: int = 0
    _arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_params(cls, params: SamplingParams, prompt_token_ids: Sequence[int] = (),
                    eos_token_ids: Sequence[int] = ()) -> SamplingState:
        """eos_token_ids: the ids that end the request (with params.stop_token_ids, what
        min_tokens bans until enough tokens came)."""
        # default_rng(None) draws fresh OS entropy: unseeded requests are not reproducible.
        prompt = np.unique(np.asarray(prompt_token_ids, dtype=np.int64))
        banned = None
        if params.min_tokens:
            ends = (*(() if params.ignore_eos else eos_token_ids), *params.stop_token_ids)
            banned = np.unique(np.asarray(ends, dtype=np.int64)) if ends else None
        return cls(params, np.random.default_rng(params.seed), prompt, guide=_guide(params),
                   min_tokens_banned=banned)

    def append(self, token_id: int) -> None:
        self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1
        self.num_output += 1
        self._arrays = None
        if self.guide is not None:
            self.guide.accept(token_id)

    @property
    def penalized(self) -> bool:
        """Whether this row's logits change before temperature (penalties, a logit bias, a grammar)."""
        p = self.params
        return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                or bool(p.logit_bias) or self.guide is not None or self.bans_ends)

    @property
    def bans_ends(self) -> bool:
        """Whether EOS and the stop ids are banned now (min_tokens not reached)."""
        return self.min_tokens_banned is not None and self.num_output < self.params.min_tokens

    def seen_tokens(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(prompt ∪ output ids, output ids, their counts), cached until the next append."""
        if self._arrays is None:
            output = np.fromiter(self.output_counts, dtype=np.int64, count=len(self.output_counts))
            counts = np.fromiter(self.output_counts.values(), dtype=np.float32, count=len(output))
            self._arrays = (np.union1d(self.prompt_token_ids, output), output, counts)
        return self._arrays


def _guide(params: SamplingParams) -> Guide | None:
    if params.structured is None:
        return None
    if params.structured.compiled is None:
        raise ValueError("structured output must be bound to the tokenizer first (GrammarCompiler.bind; "
                         "LLM.make_request does it)")
    return Guide(params.structured.compiled)


class Sampler:
    def sample(self, logits: np.ndarray, requests: Sequence[SamplingState]) -> SamplerOutput:
        """Pick one token per row of `logits` [N, V]; row i belongs to requests[i].

        Logprobs, where a request asks for them, are the log-softmax of the raw model logits:
        before penalties, temperature and filtering (vLLM's default, "raw_logprobs").
        """
        logits = np.asarray(logits, dtype=np.float32)
        _check_batch(logits, requests)
        penalized = apply_penalties(logits, requests)
        token_ids = np.empty(len(requests), dtype=np.int64)
        greedy = [i for i, state in enumerate(requests) if state.params.greedy]
        if greedy:
            # An all-greedy batch (the common decode case) needs no gather of its rows.
            rows = penalized if len(greedy) == len(requests) else penalized[greedy]
            token_ids[greedy] = rows.argmax(axis=1)
        for i, state in enumerate(requests):
            if not state.params.greedy:
                token_ids[i] = _sample_row(penalized[i], state.params, state.rng)
        return SamplerOutput(token_ids.tolist(), _logprobs(logits, requests, token_ids))


def _check_batch(logits: np.ndarray, requests: Sequence[SamplingState]) -> None:
    if logits.ndim != 2 or logits.shape[0] != len(requests):
        raise ValueError(f"logits must be [N, V] with N = {len(requests)} requests, got {logits.shape}")


# ---- penalties: touch only the tokens a request has seen ----

def apply_penalties(logits: np.ndarray, requests: Sequence[SamplingState]) -> np.ndarray:
    """Penalized logits. The input is never modified; it is returned as is when no row is penalized."""
    rows = [i for i, state in enumerate(requests) if state.penalized]
    if not rows:
        return logits
    guides = [requests[i].guide for i in rows if requests[i].guide is not None]
    if guides:
        fill_masks(guides)
    out = logits.copy()
    for i in rows:
        _penalize(out[i], requests[i])
    return out


def _penalize(row: np.ndarray, state: SamplingState) -> None:
    p = state.params
    if p.repetition_penalty != 1.0:
        # HF semantics: over prompt and output; shrinks positive logits, pushes negative ones down.
        seen = state.seen_tokens()[0]
        values = row[seen]
        penalty = np.float32(p.repetition_penalty)
        row[seen] = np.where(values > 0, values / penalty, values * penalty)
    if p.frequency_penalty or p.presence_penalty:
        _, output, counts = state.seen_tokens()
        # OpenAI semantics: output tokens only; frequency scales with the count, presence does not.
        row[output] -= counts * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty)
    if p.logit_bias:
        _add_bias(row, p.logit_bias)
    if state.bans_ends:
        banned = state.min_tokens_banned
        row[banned[banned < len(row)]] = -np.inf
    if state.guide is not None:
        # NOTE: the mask comes last, so no penalty or bias can bring back a token it forbids.
        np.putmask(row, state.guide.forbidden(len(row)), -np.inf)     # faster than a boolean-index store


def _add_bias(row: np.ndarray, bias: tuple[tuple[int, float], ...]) -> None:
    ids = np.fromiter((t for t, _ in bias), np.int64, len(bias))
    values = np.fromiter((b for _, b in bias), np.float32, len(bias))
    # NOTE: the server checks ids against the vocabulary; an id past this row (Python API) is
    # skipped rather than failing the whole batch's step.
    inside = ids < len(row)
    row[ids[inside]] += values[inside]


# ---- one sampled row: filter, then draw once ----

def sample_row(row: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token from one penalized row, as sample() draws it (speculative verification's bonus token)."""
    return _sample_row(row, params, rng)


def target_weights(row: np.ndarray, params: SamplingParams) -> tuple[np.ndarray | None, np.ndarray]:
    """The distribution sample() draws from: candidate ids (None: the whole vocabulary, in
    order) and unnormalised probabilities, after temperature, top-k, top-p and min-p."""
    return _filtered_weights(row, params)


def draw(weights: np.ndarray, u: float) -> int:
    """The index of `weights` (unnormalised) that inverse-CDF sampling picks at u in [0, 1)."""
    return _draw(weights, u)


def _sample_row(row: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    ids, weights = _filtered_weights(row, params)
    pick = _draw(weights, rng.random())
    return pick if ids is None else int(ids[pick])


def _draw(weights: np.ndarray, u: float) -> int:
    """Inverse CDF at u ∈ [0, 1): the index whose slice of the cumulative weight holds u · total.

    Two levels, blocks then tokens, so a full vocabulary is summed rather than cumsummed.
    """
    starts = np.arange(0, len(weights), DRAW_BLOCK)
    block_cdf = np.cumsum(np.add.reduceat(weights, starts, dtype=np.float64))
    target = u * block_cdf[-1]
    block = _invert(block_cdf, target)
    below = block_cdf[block - 1] if block else 0.0
    start = int(starts[block])
    cdf = np.cumsum(weights[start:start + DRAW_BLOCK], dtype=np.float64)
    return start + _invert(cdf, target - below)


def _invert(cdf: np.ndarray, target: float) -> int:
    index = int(np.searchsorted(cdf, target, side="right"))
    if index < len(cdf):
        return index
    # Rounding put the target at or past the total: take the last index with weight, never a
    # zero-weight (masked or filtered) one at the end.
    return int(np.searchsorted(cdf, cdf[-1], side="left"))


def _filtered_weights(row: np.ndarray, params: SamplingParams) -> tuple[np.ndarray | None, np.ndarray]:
    """Candidate token ids (None: the whole vocabulary, in order) and unnormalised probabilities."""
    ids = _top_k_ids(row, params.top_k)
    logits = row if ids is None else row[ids]
    weights = np.exp((logits - logits.max()) / np.float32(params.temperature))
    if params.top_p < 1.0:
        ids, weights = _top_p(ids, weights, params.top_p)
    if params.min_p > 0.0:
        ids, weights = _min_p(ids, weights, params.min_p)
    return ids, weights


def _top_k_ids(row: np.ndarray, top_k: int) -> np.ndarray | None:
    if top_k == 0 or top_k >= len(row):
        return None
    if top_k == 1:
        return np.array([row.argmax()])     # same tie-break as greedy
    return _largest(row, top_k)


def _top_p(ids: np.ndarray | None, weights: np.ndarray, top_p: float):
    """Keep the smallest most-likely set whose mass reaches top_p (at least one token)."""
    target = top_p * weights.sum(dtype=np.float64)
    order = _descending(weights, target)
    kept = weights[order]
    count = int(np.searchsorted(np.cumsum(kept, dtype=np.float64), target, side="left")) + 1
    order = order[:count]
    return (order if ids is None else ids[order]), kept[:count]


def _descending(weights: np.ndarray, mass: float) -> np.ndarray:
    """Indices of the largest weights, most likely first, covering at least `mass`."""
    for size in NUCLEUS_HEADS:
        if size * 4 < len(weights):
            head = _head(weights, size)
            # The head is every weight above a threshold: a prefix of the full sorted order.
            if weights[head].sum(dtype=np.float64) >= mass:
                return head[np.argsort(-weights[head])]
    return np.argsort(-weights)


def _min_p(ids: np.ndarray | None, weights: np.ndarray, min_p: float):
    keep = np.flatnonzero(weights >= min_p * weights.max())
    return (keep if ids is None else ids[keep]), weights[keep]


def _largest(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, in no particular order."""
    if k >= len(values):
        return np.arange(len(values))
    head = _head(values, k)
    return head[np.argpartition(values[head], -k)[-k:]]


def _head(values: np.ndarray, size: int) -> np.ndarray:
    """Indices of all values above a threshold: at least `size` of them, about twice that many.

    The threshold is read off a strided sample; when it would keep fewer than `size`, every index.
    """
    sample = values[::HEAD_STRIDE]
    rank = min(len(sample), 2 * size // HEAD_STRIDE + 8)
    threshold = np.partition(sample, len(sample) - rank)[len(sample) - rank]
    head = np.flatnonzero(values >= threshold)
    return head if len(head) >= size else np.arange(len(values))


# ---- logprobs of the raw logits ----

def _logprobs(logits: np.ndarray, requests: Sequence[SamplingState], token_ids: np.ndarray):
    return [
        None if state.params.logprobs is None
        else rows_logprobs(logits[i:i + 1], [int(token_ids[i])], state.params.logprobs)[0]
        for i, state in enumerate(requests)
    ]


def _ranked(raw: np.ndarray, token_id: int, n: int, log_norm: float) -> TokenLogprobs:
    n = min(n, len(raw))
    ranked = sorted(_largest(raw, n).tolist(), key=lambda t: (-raw[t], t)) if n else []
    top = [(t, float(raw[t]) - log_norm) for t in ranked]
    return TokenLogprobs(float(raw[token_id]) - log_norm, top)


def rows_logprobs(raw: np.ndarray, token_ids, n: int) -> list[TokenLogprobs]:
    """The logprob of each row's token and the n most likely tokens, from a [rows, vocab] block of raw
    logits, the normalisers in one pass over the block (a prompt's rows are scored together: a
    Python loop over the vocabulary per row held the engine thread, and every other stream, for the
    whole prompt)."""
    raw = np.asarray(raw, dtype=np.float32)
    if not len(raw):
        return []
    peak = raw.max(axis=1, keepdims=True)
    log_norms = peak[:, 0].astype(np.float64) + np.log(np.exp(raw - peak).sum(axis=1, dtype=np.float64))
    return [_ranked(row, int(t), n, float(norm)) for row, t, norm in zip(raw, token_ids, log_norms)]
