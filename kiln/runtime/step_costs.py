"""What an engine step costs, learnt from the steps run so far, and the prefill budget it implies.

Decode-aware chunked prefill (Sarathi-Serve's idea, with the budget measured rather than
profiled offline): while streams are decoding, a step may spend on prefill only what keeps the
step within the target inter-token latency,

    prefill_budget(d) = (target_itl - decode_seconds(d)) / prefill_seconds_per_token

tokens, at least `min_prefill_chunk` so waiting prompts always progress, and the whole token
budget when nothing is decoding (no stream to protect). Admission control reads the same model to
predict how long a queue of prompts takes to prefill under today's decode load.

Estimates are exponentially weighted: a decode step's time per batch-size bucket (powers of two;
a step's cost is near-flat inside one on both backends), and the prefill cost per token
(StepCostModel.observe says which steps teach which). NOTE: pure arithmetic, no clock and no engine: the
engine core feeds observe() with measured seconds, and tests feed made-up ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.8                     # weight of the old estimate per observation
PRIOR_DECODE_SECONDS = 0.02     # until a decode step of that size was seen: a small model on 2 cores
PRIOR_PREFILL_SECONDS_PER_TOKEN = 1e-3
CALIBRATION_CHUNK = 64          # prefill tokens beside decodes that say something about the token cost


def batch_bucket(num_decodes: int) -> int:
    """The power of two at or above num_decodes (0 for none)."""
    return 0 if num_decodes <= 0 else 1 << (num_decodes - 1).bit_length()


@dataclass(frozen=True)
class StepCosts:
    """An immutable copy of the estimates (the engine snapshot carries one to other threads)."""
    target_itl: float = 0.0                     # 0: prefill chunks bounded only by the token budget
    min_prefill_chunk: int = 32
    max_tokens: int = 512                       # the scheduler's per-step token budget
    decode_seconds_by_bucket: tuple[tuple[int, float], ...] = ()
    prefill_seconds_per_token: float = PRIOR_PREFILL_SECONDS_PER_TOKEN

    def decode_seconds(self, num_decodes: int) -> float:
        """A decode-only step of num_decodes sequences: the nearest bucket seen, scaled linearly
        when extrapolating upwards (conservative: decode cost grows sublinearly in the batch)."""
        if num_decodes <= 0:
            return 0.0
        if not self.decode_seconds_by_bucket:
            return PRIOR_DECODE_SECONDS
        want = batch_bucket(num_decodes)
        below = [(b, s) for b, s in self.decode_seconds_by_bucket if b <= want]
        above = [(b, s) for b, s in self.decode_seconds_by_bucket if b >= want]
        if above:
            return min(above)[1]
        bucket, seconds = max(below)
        return seconds * want / bucket

    def prefill_budget(self, num_decodes: int) -> int:
        """Prefill tokens one step may take while num_decodes streams decode."""
        room = max(self.max_tokens - num_decodes, 0)
        if self.target_itl <= 0 or num_decodes == 0:
            return room
        spare = self.target_itl - self.decode_seconds(num_decodes)
        tokens = int(spare / self.prefill_seconds_per_token) if spare > 0 else 0
        return min(room, max(tokens, self.min_prefill_chunk))

    def step_seconds(self, num_decodes: int, num_prefill_tokens: int) -> float:
        return self.decode_seconds(num_decodes) + num_prefill_tokens * self.prefill_seconds_per_token

    def prefill_seconds(self, num_tokens: int, num_decodes: int) -> float:
        """How long prefilling num_tokens takes while num_decodes streams keep decoding: whole
        steps of the prefill budget, each as long as the model says such a step takes."""
        if num_tokens <= 0:
            return 0.0
        per_step = max(self.prefill_budget(num_decodes), 1)
        full, rest = divmod(num_tokens, per_step)
        seconds = full * self.step_seconds(num_decodes, per_step)
        return seconds + (self.step_seconds(num_decodes, rest) if rest else 0.0)


@dataclass
class StepCostModel:
    """Owned by the scheduler; updated once per step on the engine thread."""
    target_itl: float = 0.0
    min_prefill_chunk: int = 32
    max_tokens: int = 512
    decode_seconds: dict[int, float] = field(default_factory=dict)
    prefill_seconds_per_token: float = PRIOR_PREFILL_SECONDS_PER_TOKEN
    _snapshot: StepCosts | None = None

    def observe(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        """Two coupled estimates: the token cost from steps whose prefill dominates (nothing
        decoding, or a chunk of CALIBRATION_CHUNK tokens or more), the decode step from the
        others, less their prefill share. NOTE: a small chunk's step is mostly fixed costs
        (the engine call, the scheduler, a busy GIL); charged to its few tokens they would
        inflate the token cost, shrink the next chunk and feed on themselves."""
        costs = self.costs()
        if num_prefill_tokens and (num_decodes == 0 or num_prefill_tokens >= CALIBRATION_CHUNK):
            beyond = seconds - costs.decode_seconds(num_decodes)
            per_token = max(beyond, 0.1 * seconds) / num_prefill_tokens
            self.prefill_seconds_per_token = _blend(self.prefill_seconds_per_token, per_token)
        elif num_decodes:
            decode = max(seconds - num_prefill_tokens * costs.prefill_seconds_per_token, 0.5 * seconds)
            bucket = batch_bucket(num_decodes)
            old = self.decode_seconds.get(bucket)
            self.decode_seconds[bucket] = decode if old is None else _blend(old, decode)
        self._snapshot = None

    def costs(self) -> StepCosts:
        if self._snapshot is None:
            self._snapshot = StepCosts(self.target_itl, self.min_prefill_chunk, self.max_tokens,
                                       tuple(sorted(self.decode_seconds.items())),
                                       self.prefill_seconds_per_token)
        return self._snapshot


def _blend(old: float, new: float) -> float:
    return DECAY * old + (1 - DECAY) * new
