"""Admission control: refuse at once (429 + Retry-After) rather than let the queue grow until
every admitted request misses its latency target.

A request counts as waiting from admission until its first token. The predicted TTFT of a new
request is the prompt tokens waiting ahead of it, plus its own, over the measured prefill rate.
"""

from __future__ import annotations

import math
import threading

from kiln.config import ServeConfig
from kiln.runtime.engine_stats import StepReport
from kiln.serving.errors import ApiError


class PrefillRate:
    """Prefill tokens per second over steps that ran a prefill chunk, exponentially weighted.
    The prior weighs as much as one small step, so the start-up warm-up (a prompt of a few
    hundred tokens) already replaces most of it before the first user arrives."""

    PRIOR_TOKENS, PRIOR_SECONDS = 128.0, 0.125      # 1,024 tokens/s: a small model on a few cores
    DECAY = 0.95

    def __init__(self):
        self._tokens, self._seconds = self.PRIOR_TOKENS, self.PRIOR_SECONDS
        self._lock = threading.Lock()

    def observe(self, step: StepReport) -> None:
        """Called on the engine's thread after every step."""
        if step.num_prefill_chunks == 0:
            return
        with self._lock:
            self._tokens = self._tokens * self.DECAY + step.num_scheduled_tokens
            self._seconds = self._seconds * self.DECAY + step.seconds

    @property
    def tokens_per_second(self) -> float:
        with self._lock:
            return self._tokens / self._seconds


class Ticket:
    """An admitted request's place in the waiting count, given back at its first token."""

    def __init__(self, admission: Admission, num_tokens: int):
        self._admission, self.num_tokens = admission, num_tokens

    def release(self) -> None:
        admission, self._admission = self._admission, None
        if admission is not None:
            admission.pending -= 1
            admission.pending_tokens -= self.num_tokens


class Admission:
    def __init__(self, config: ServeConfig, rate: PrefillRate):
        self.config, self.rate = config, rate
        self.pending = 0              # admitted, no first token yet (event-loop thread only)
        self.pending_tokens = 0

    def predicted_ttft(self, num_prompt_tokens: int) -> float:
        return (self.pending_tokens + num_prompt_tokens) / self.rate.tokens_per_second

    def admit(self, num_prompt_tokens: int) -> Ticket:
        """A ticket, or ApiError(429) naming the bound that refused the request."""
        self._check(num_prompt_tokens)
        self.pending += 1
        self.pending_tokens += num_prompt_tokens
        return Ticket(self, num_prompt_tokens)

    def _check(self, n: int) -> None:
        c = self.config
        drain = self.pending_tokens / self.rate.tokens_per_second    # until today's queue is prefilled
        if c.max_waiting is not None and self.pending >= c.max_waiting:
            raise _too_many(f"{self.pending} requests are already waiting (max {c.max_waiting})",
                            "max_waiting", drain)
        if c.max_waiting_tokens is not None and self.pending_tokens + n > c.max_waiting_tokens:
            raise _too_many(f"{self.pending_tokens} prompt tokens are already waiting and this request "
                            f"adds {n} (max {c.max_waiting_tokens})", "max_waiting_tokens", drain)
        ttft = self.predicted_ttft(n)
        if c.ttft_slo is not None and ttft > c.ttft_slo:
            raise _too_many(f"predicted time to first token {ttft:.2f} s exceeds the "
                            f"{c.ttft_slo:g} s objective", "ttft_slo", ttft - c.ttft_slo)


def _too_many(message: str, code: str, retry_after: float) -> ApiError:
    seconds = max(1, math.ceil(retry_after))
    return ApiError(429, f"server busy: {message}; retry in {seconds} s", None, code,
                    headers={"Retry-After": str(seconds)})
