"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from kiln.runtime.structured.spec import StructuredOutput

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 64
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_TOP_K = 1 << 31
MAX_SEED = (1 << 63) - 1           # OpenAI's seed is a signed 64-bit integer; numpy refuses negatives
MAX_LOGIT_BIAS_ENTRIES = 1024
LOGIT_BIAS_RANGE = 100.0           # OpenAI: each bias in [-100, 100]

GREEDY_BELOW = 1e-5                   # temperatures below this sample greedily
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0          # 0 means greedy
    top_k: int = 0                    # 0 disables
    top_p: float = 1.0                # (0, 1]
    min_p: float = 0.0                # [0, 1)
    repetition_penalty: float = 1.0   # > 0; 1 disables (HF semantics, over prompt and output)
    presence_penalty: float = 0.0     # OpenAI semantics, over output tokens only
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None       # top-n logprobs per generated token
    # top-n logprobs of every prompt token after the first (vLLM's prompt_logprobs; what echo
    # with logprobs returns). NOTE: such a request computes its whole prompt (no prefix-cache hits).
    prompt_logprobs: int | None = None
    priority: int = 0                 # lower runs first under the priority policy
    # vLLM's: EOS and stop_token_ids cannot end (nor be sampled for) the first min_tokens tokens.
    min_tokens: int = 0
    skip_special_tokens: bool = True  # special tokens' text left out of the output text
    include_stop_str_in_output: bool = False   # the stop string that ended the output stays in it
    # OpenAI semantics: token id -> bias added to its logit before sampling. A mapping from
    # callers; stored as sorted (id, bias) pairs so the params stay hashable.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The output must match this (a JSON Schema, a regex, a grammar ...); None: free text.
    structured: StructuredOutput | None = None
    # A prefix-cache namespace (vLLM's cache_salt): it keys the first block's hash, so requests
    # share cached prefixes only with the same salt (and cached_tokens tells no one else's prompt).
    cache_salt: str | None = None

    def __post_init__(self):
        # Accept lists from callers; store tuples so the params stay hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        for problem in _problems(self):
            raise ValueError(problem)

    @property
    def greedy(self) -> bool:
        # NOTE: a positive temperature below GREEDY_BELOW is greedy too (as vLLM does): divided
        # in float32, 1e-50 is 0 and the logits would turn to inf/NaN.
        return self.temperature < GREEDY_BELOW


def _bias_pairs(bias: Mapping[int, float] | tuple) -> tuple[tuple[int, float], ...]:
    items = bias.items() if isinstance(bias, Mapping) else bias
    return tuple(sorted((int(t), float(b)) for t, b in items))


def _problems(p: SamplingParams):
    yield from _float_problems(p)
    if p.max_tokens < 1:
        yield f"max_tokens must be at least 1, got {p.max_tokens}"
    if not 0 <= p.top_k < MAX_TOP_K:
        yield f"top_k must be in [0, {MAX_TOP_K}) (0 disables), got {p.top_k}"
    if p.seed is not None and not 0 <= p.seed <= MAX_SEED:
        yield f"seed must be in [0, {MAX_SEED}], got {p.seed}"
    if len(p.stop) > MAX_STOP_STRINGS:
        yield f"at most {MAX_STOP_STRINGS} stop strings, got {len(p.stop)}"
    if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in p.stop):
        yield f"stop strings must be 1 to {MAX_STOP_STRING_CHARS} characters"
    if p.logprobs is not None and not 0 <= p.logprobs <= MAX_LOGPROBS:
        yield f"logprobs must be in [0, {MAX_LOGPROBS}], got {p.logprobs}"
    if p.prompt_logprobs is not None and not 0 <= p.prompt_logprobs <= MAX_LOGPROBS:
        yield f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {p.prompt_logprobs}"
    if not 0 <= p.min_tokens <= p.max_tokens:
        yield f"min_tokens must be in [0, max_tokens = {p.max_tokens}], got {p.min_tokens}"
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(t < 0 for t in p.stop_token_ids):
        yield f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} token ids >= 0"
    yield from _logit_bias_problems(p.logit_bias)


def _float_problems(p: SamplingParams):
    for name in _FLOAT_FIELDS:
        if not math.isfinite(getattr(p, name)):
            yield f"{name} must be a finite number, got {getattr(p, name)}"
            return
    if p.temperature < 0:
        yield f"temperature must be >= 0, got {p.temperature}"
    if p.temperature > MAX_TEMPERATURE:
        yield f"temperature must be <= {MAX_TEMPERATURE:g}, got {p.temperature}"
    if not 0 < p.top_p <= 1:
        yield f"top_p must be in (0, 1], got {p.top_p}"
    if not 0 <= p.min_p < 1:
        yield f"min_p must be in [0, 1), got {p.min_p}"
    if not 0 < p.repetition_penalty <= MAX_REPETITION_PENALTY:
        yield f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {p.repetition_penalty}"
    if not -2 <= p.presence_penalty <= 2:
        yield f"presence_penalty must be in [-2, 2], got {p.presence_penalty}"
    if not -2 <= p.frequency_penalty <= 2:
        yield f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}"


def _logit_bias_problems(pairs: tuple[tuple[int, float], ...]):
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        yield f"logit_bias has {len(pairs)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}"
    if any(t < 0 for t, _ in pairs):
        yield "logit_bias token ids must be >= 0"
    if len({t for t, _ in pairs}) != len(pairs):
        yield "logit_bias names a token id more than once"
    if any(not -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE for _, b in pairs):   # NaN fails too
        yield f"logit_bias values must be in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]"
