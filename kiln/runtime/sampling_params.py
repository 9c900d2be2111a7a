"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20


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
    priority: int = 0                 # lower runs first under the priority policy

    def __post_init__(self):
        # Accept lists from callers; store tuples so the params stay hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for problem in _problems(self):
            raise ValueError(problem)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _problems(p: SamplingParams):
    if p.max_tokens < 1:
        yield f"max_tokens must be at least 1, got {p.max_tokens}"
    if p.temperature < 0:
        yield f"temperature must be >= 0, got {p.temperature}"
    if p.top_k < 0:
        yield f"top_k must be >= 0 (0 disables), got {p.top_k}"
    if not 0 < p.top_p <= 1:
        yield f"top_p must be in (0, 1], got {p.top_p}"
    if not 0 <= p.min_p < 1:
        yield f"min_p must be in [0, 1), got {p.min_p}"
    if p.repetition_penalty <= 0:
        yield f"repetition_penalty must be > 0, got {p.repetition_penalty}"
    if not -2 <= p.presence_penalty <= 2:
        yield f"presence_penalty must be in [-2, 2], got {p.presence_penalty}"
    if not -2 <= p.frequency_penalty <= 2:
        yield f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}"
    if len(p.stop) > MAX_STOP_STRINGS:
        yield f"at most {MAX_STOP_STRINGS} stop strings, got {len(p.stop)}"
    if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in p.stop):
        yield f"stop strings must be 1 to {MAX_STOP_STRING_CHARS} characters"
    if p.logprobs is not None and not 0 <= p.logprobs <= MAX_LOGPROBS:
        yield f"logprobs must be in [0, {MAX_LOGPROBS}], got {p.logprobs}"
