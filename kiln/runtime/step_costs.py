"""What an engine step costs, learnt from the steps run so far, and the prefill budget it implies.

Decode-aware chunked prefill (Sarathi-Serve's idea, with the budget measured rather than
profiled offline): while streams are decoding, a step may spend on prefill only what keeps the
step within the target inter-token latency,

    prefill_budget(d) = (step_target(d) - decode_seconds(d)) / prefill_seconds_per_token
    step_target(d)    = min(target_itl, itl_stretch * decode_seconds(d))

tokens, at least `min_prefill_chunk` so waiting prompts always progress, and the whole token
budget when nothing is decoding (no stream to protect). While a prompt is late for its TTFT
objective the scheduler plans on `late()`: a step may take LATE_STEP_FACTOR times target_itl
(or LATE_MIN_STRETCH decode steps, where longer), so the late prompts get a larger share of each
step and every stream still gets its token. The absolute target bounds the ITL a
crowd sees; the stretch bounds how much slower a newcomer's prefill makes a few running streams
(a stretch of two: their tokens come at most twice as far apart while a prompt is prefilled).
Admission control reads the same model to predict how long a queue of prompts takes to prefill
under today's decode load.

Estimates are exponentially weighted: a decode step's time per batch-size bucket (powers of two;
a step's cost is near-flat inside one on both backends), and the prefill cost per token
(StepCostModel says how). NOTE: pure arithmetic, no clock and no engine: the engine core feeds
observe() with measured seconds, and tests feed made-up ones.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace
from typing import Sequence

FORGET = 0.95                   # weight of the past per observation (about the last 20 steps count)
PRIOR_DECODE_SECONDS = 0.02     # until a decode step of that size was seen: a small model on 2 cores
PRIOR_PREFILL_SECONDS_PER_TOKEN = 1e-3
MIN_SPREAD = 2048.0             # tokens^2: chunk sizes must vary this much before a slope is fitted
MIN_SECONDS_PER_TOKEN = 1e-5
MIN_SLOPE_SHARE = 0.25          # the fitted slope's floor, as a fraction of the idle steps' seconds per token
# How much longer than target_itl a step may take while a prompt is late for its TTFT objective:
# at the default target a late step still keeps each stream's gap within the ITL objective the
# serving benchmark holds kiln to, with room for a step that runs slower than predicted.
LATE_STEP_FACTOR = 1.3
# And a late step may always take this multiple of a decode-only step: where the decodes alone
# take most of the late target (long contexts, a large batch), the late prompts would otherwise get
# min_prefill_chunk a step and wait seconds for their first token.
LATE_MIN_STRETCH = 2.0


def batch_bucket(num_decodes: int) -> int:
    """The power of two at or above num_decodes (0 for none)."""
    return 0 if num_decodes <= 0 else 1 << (num_decodes - 1).bit_length()


@dataclass(frozen=True)
class StepCosts:
    """An immutable copy of the estimates (the engine snapshot carries one to other threads)."""
    target_itl: float = 0.0                     # 0: prefill chunks bounded only by the token budget
    min_prefill_chunk: int = 32
    max_tokens: int = 512                       # the scheduler's per-step token budget
    itl_stretch: float = 0.0                    # 0: no bound relative to the decode step
    decode_seconds_by_bucket: tuple[tuple[int, float], ...] = ()
    prefill_seconds_per_token: float = PRIOR_PREFILL_SECONDS_PER_TOKEN
    min_stretch: float = 0.0                    # a step may always take this multiple of the decode step

    def decode_seconds(self, num_decodes: int) -> float:
        """A decode-only step of num_decodes sequences: the nearest bucket seen at or above it;
        above the largest seen, extrapolated (_extrapolated)."""
        if num_decodes <= 0:
            return 0.0
        if not self.decode_seconds_by_bucket:
            return PRIOR_DECODE_SECONDS
        want = batch_bucket(num_decodes)
        above = [(b, s) for b, s in self.decode_seconds_by_bucket if b >= want]
        if above:
            return min(above)[1]
        return self._extrapolated(want)

    def _extrapolated(self, bucket: int) -> float:
        """A bucket past the largest seen: along the line through the two largest (a step is a
        fixed cost, the weights read once, plus a cost per sequence), never below the largest;
        with one bucket seen, in proportion to it. NOTE: proportion alone is the pessimistic
        bound, and it held the auto batch at 32 for good where a step of 32 took over half the
        ITL target (64 never predicted within it, so never run and measured); a bucket run is
        then measured, and its own figure replaces this one."""
        (b0, s0), (b1, s1) = ((0, 0.0), *self.decode_seconds_by_bucket)[-2:]
        slope = max((s1 - s0) / (b1 - b0), 0.0)
        return s1 + slope * (bucket - b1)

    def prefill_budget(self, num_decodes: int) -> int:
        """Prefill tokens one step may take while num_decodes streams decode."""
        room = max(self.max_tokens - num_decodes, 0)
        if self.target_itl <= 0 or num_decodes == 0:
            return room
        spare = self.step_target(num_decodes) - self.decode_seconds(num_decodes)
        tokens = int(spare / self.prefill_seconds_per_token) if spare > 0 else 0
        return min(room, max(tokens, self.min_prefill_chunk))

    def step_target(self, num_decodes: int) -> float:
        """How long a step beside num_decodes streams may take (when the policy is on)."""
        decode = self.decode_seconds(num_decodes)
        target = min(self.target_itl, self.itl_stretch * decode) if self.itl_stretch else self.target_itl
        return max(target, self.min_stretch * decode)

    def late(self) -> StepCosts:
        """These costs as a step is planned while a prompt is late for its TTFT objective: the
        step target LATE_STEP_FACTOR times target_itl, or LATE_MIN_STRETCH decode steps where
        that is longer, without the bound relative to a decode step."""
        return replace(self, target_itl=self.target_itl * LATE_STEP_FACTOR, itl_stretch=0.0,
                       min_stretch=LATE_MIN_STRETCH)

    def step_seconds(self, num_decodes: int, num_prefill_tokens: int) -> float:
        return self.decode_seconds(num_decodes) + num_prefill_tokens * self.prefill_seconds_per_token

    def queue_prefill_seconds(self, prompts: Sequence[int], num_decodes: int, max_decodes: int,
                              horizon: float = math.inf, decode_ends: Sequence[int] | None = None,
                              late_after: float = math.inf) -> float:
        """How long until the last of `prompts` (tokens left to prefill, in the scheduler's
        first-come order) has its first token, while num_decodes streams decode: step by step,
        each step prefilling its budget across prompt boundaries, and each prompt prefilled
        joining the decodes (up to max_decodes seats) from the next step on. decode_ends: the
        decoding streams' tokens left to their max_tokens, ascending (None: they outlast the
        queue); a stream that ends stops taking a share of each step, so a prompt behind a few
        short replies is prefilled at the full budget once they end (measured on a slow CPU:
        3.3 s predicted for 1.1 s realised when this was ignored). late_after: seconds until the
        oldest prompt is late for its TTFT objective; from then on the scheduler plans its steps
        on the late costs (late(): a longer step, a larger prefill budget beside the decodes), and
        so does the walk (without them, a queue behind a full batch was predicted far later than
        it came, and admission refused requests that then came in time). NOTE: a prompt is a decode
        load only once it is prefilled; counting the queue as decoding from the start doubles
        the decode share of every step and halves the budget the prediction assumes. Stops early
        once past `horizon` seconds (admission needs no more than "too late"; a long queue beside
        a full batch is thousands of 16-token steps, tens of ms on the event loop)."""
        left = [n for n in prompts if n > 0]
        ends = list(decode_ends or ())[-num_decodes:] if num_decodes > 0 else []     # the longest count
        seconds, done, decode_steps = 0.0, 0, 0
        joined = len(prompts) - len(left)
        late = self.late()
        while done < len(left) and seconds <= horizon:
            step = late if seconds >= late_after else self
            running = num_decodes - bisect.bisect_right(ends, decode_steps)
            decodes = min(running + joined, max_decodes)
            budget = max(step.prefill_budget(decodes), 1)
            spent, finished = 0, 0
            while done + finished < len(left) and spent < budget:
                take = min(left[done + finished], budget - spent)
                left[done + finished] -= take
                spent += take
                finished += left[done + finished] == 0
            seconds += self.step_seconds(decodes, spent)
            done += finished
            joined += finished
            decode_steps += 1
        return seconds

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
class _Fit:
    """Exponentially weighted means of (prefill tokens, seconds) over one decode bucket's steps,
    and their co-moments (Welford's update, with forgetting)."""
    weight: float = 0.0
    mean_tokens: float = 0.0
    mean_seconds: float = 0.0
    cov: float = 0.0
    var: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.weight = FORGET * self.weight + 1
        d_tokens = tokens - self.mean_tokens
        self.mean_tokens += d_tokens / self.weight
        self.mean_seconds += (seconds - self.mean_seconds) / self.weight
        self.cov = FORGET * self.cov + d_tokens * (seconds - self.mean_seconds)
        self.var = FORGET * self.var + d_tokens * (tokens - self.mean_tokens)


@dataclass
class StepCostModel:
    """Owned by the scheduler; updated once per step on the engine thread.

    A step of d decodes and p prefill tokens is modelled as decode_seconds(bucket(d)) + c * p: a
    linear fit with one intercept per decode bucket and one shared slope c, the slope from how
    step time varies with p inside each bucket. NOTE: a regression, not seconds / tokens: a step's
    fixed costs (the engine call, the scheduler, a busy GIL) are mostly intercept; charged to a
    small chunk's few tokens they would inflate c, shrink the next chunk and feed on themselves.
    Until the chunks have varied enough to fit a slope, c is the tokens' share of idle prefills.
    """
    target_itl: float = 0.0
    min_prefill_chunk: int = 32
    max_tokens: int = 512
    itl_stretch: float = 0.0
    fits: dict[int, _Fit] = field(default_factory=dict)
    _snapshot: StepCosts | None = None

    def observe(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        if num_decodes == 0 and num_prefill_tokens == 0:
            return
        self.fits.setdefault(batch_bucket(num_decodes), _Fit()).add(num_prefill_tokens, seconds)
        self._snapshot = None

    @property
    def prefill_seconds_per_token(self) -> float:
        idle = self._idle_share()
        spread = sum(f.var for f in self.fits.values())
        if spread >= MIN_SPREAD:
            # NOTE: a slope fitted from a few steps can come out near zero or negative (an engine's
            # first call at a new shape is slow: OpenVINO prepares kernels per shape); clamped to
            # 1e-5 s/token, it told admission that 700 queued tokens take 0.07 s, and those
            # requests waited 1-8 s. A token costs at least a fraction of the idle steps' share.
            slope = sum(f.cov for f in self.fits.values()) / spread
            return max(slope, MIN_SLOPE_SHARE * (idle or 0.0), MIN_SECONDS_PER_TOKEN)
        return idle or PRIOR_PREFILL_SECONDS_PER_TOKEN

    def _idle_share(self) -> float | None:
        """Seconds per token of the prefill-only steps (fixed costs included: an upper bound on
        the slope); None before any."""
        idle = self.fits.get(0)
        if idle is not None and idle.mean_tokens > 0:
            return idle.mean_seconds / idle.mean_tokens
        return None

    def costs(self) -> StepCosts:
        if self._snapshot is None:
            c = self.prefill_seconds_per_token
            decode = tuple((b, max(f.mean_seconds - c * f.mean_tokens, 0.0))
                           for b, f in sorted(self.fits.items()) if b > 0)
            self._snapshot = StepCosts(self.target_itl, self.min_prefill_chunk, self.max_tokens,
                                       self.itl_stretch, decode, c)
        return self._snapshot
