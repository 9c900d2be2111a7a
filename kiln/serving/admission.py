"""Admission control: refuse at once (429 + Retry-After) rather than let the queue grow until
every admitted request misses its latency target.

A request counts as waiting from admission until its first token. Its predicted TTFT is

    seat wait  +  time to prefill what is left of the waiting prompts ahead of it, and its own

both read from the engine's step-cost model (kiln/runtime/step_costs.py), so the decode load
counts: while d streams decode, a step prefills only the chunk that keeps it within the target
inter-token latency, and takes as long as the model says such a step takes. The streams that
will decode meanwhile are today's running ones plus every admitted request still waiting (each
becomes a stream once prefilled). When every seat (max_num_seqs) is taken, the request also waits
for enough running requests to reach their max_tokens (an upper bound: EOS may come sooner).
The prediction leans pessimistic on purpose: a refused request can retry, a late one is lost.

What the model cannot see (the HTTP thread's share of the GIL, attention growing along a long
prompt, the scheduler's order) is learnt back: every admitted request's first token compares the
time it took with the time predicted, and the 90th percentile of that ratio (Calibration)
scales the next predictions.
"""

from __future__ import annotations

import math
import time

from kiln.config import ServeConfig
from kiln.runtime.engine_stats import EngineSnapshot
from kiln.serving.errors import ApiError


class Calibration:
    """A high quantile of realised over predicted TTFT (event-loop thread), by the stochastic
    quantile update: up by STEP * QUANTILE after a ratio above it, down by STEP * (1 - QUANTILE)
    after one below, so it settles where QUANTILE of the ratios fall below. NOTE: a quantile, not
    a mean: a mean-calibrated prediction is late half the time; fixed steps also shrug off an
    outlier (a request stuck behind a hiccup) that would drag a mean."""

    QUANTILE, STEP, LOW, HIGH = 0.9, 0.05, 0.5, 4.0
    MIN_PREDICTED = 0.05        # seconds; shorter predictions are mostly noise to learn from

    def __init__(self):
        self.factor = 1.0

    def observe(self, predicted: float, realised: float) -> None:
        if predicted < self.MIN_PREDICTED:
            return
        above = realised / predicted > self.factor
        self.factor *= 1 + self.STEP * (self.QUANTILE if above else self.QUANTILE - 1)
        self.factor = min(max(self.factor, self.LOW), self.HIGH)


class Ticket:
    """An admitted request's place in the waiting count, given back at its first token (which
    also teaches the calibration) or when it ends without one."""

    def __init__(self, admission: Admission, num_tokens: int, predicted: float):
        self._admission, self.num_tokens, self.predicted = admission, num_tokens, predicted
        self.admitted_at = time.monotonic()

    def first_token(self) -> None:
        if self._admission is not None:
            self._admission.calibration.observe(self.predicted, time.monotonic() - self.admitted_at)
        self.release()

    def release(self) -> None:
        admission, self._admission = self._admission, None
        if admission is not None:
            admission.pending -= 1
            admission.pending_tokens -= self.num_tokens


class Admission:
    def __init__(self, config: ServeConfig, client):
        """`client` is the engine client; its snapshot is read (never written) on each request."""
        self.config, self.client = config, client
        self.pending = 0              # admitted, no first token yet (event-loop thread only)
        self.pending_tokens = 0
        self.calibration = Calibration()

    @property
    def prefill_tokens_per_second(self) -> float:
        """Prefill rate with nothing decoding (the step-cost model's token cost)."""
        return 1.0 / self.client.snapshot.step_costs.prefill_seconds_per_token

    def predicted_ttft(self, num_prompt_tokens: int) -> float:
        return self.calibration.factor * self.modelled_ttft(num_prompt_tokens)

    def modelled_ttft(self, num_prompt_tokens: int) -> float:
        """The step-cost model's TTFT, before calibration."""
        s = self.client.snapshot
        decodes = min(s.num_running + self.pending, max(s.max_num_seqs, 1))
        # The waiting prompts' chunks computed so far are done. NOTE: the snapshot may lag a
        # step behind the tickets; the clamp keeps a stale one from counting work twice as done.
        ahead = max(self.pending_tokens - s.prefilled_tokens, 0)
        prefill = s.step_costs.prefill_seconds(ahead + num_prompt_tokens, decodes)
        return _seat_wait(s, self.pending) + prefill

    def admit(self, num_prompt_tokens: int) -> Ticket:
        """A ticket, or ApiError(429) naming the bound that refused the request."""
        predicted = self._check(num_prompt_tokens)
        self.pending += 1
        self.pending_tokens += num_prompt_tokens
        return Ticket(self, num_prompt_tokens, predicted)

    def _check(self, n: int) -> float:
        """The predicted TTFT, unless a bound refuses the request."""
        c = self.config
        if c.max_waiting is not None and self.pending >= c.max_waiting:
            raise _too_many(f"{self.pending} requests are already waiting (max {c.max_waiting})",
                            "max_waiting", self.predicted_ttft(0))
        if c.max_waiting_tokens is not None and self.pending_tokens + n > c.max_waiting_tokens:
            raise _too_many(f"{self.pending_tokens} prompt tokens are already waiting and this request "
                            f"adds {n} (max {c.max_waiting_tokens})", "max_waiting_tokens", self.predicted_ttft(0))
        ttft = self.predicted_ttft(n)
        if c.ttft_slo and ttft > c.ttft_slo:
            raise _too_many(f"predicted time to first token {ttft:.2f} s exceeds the "
                            f"{c.ttft_slo:g} s objective", "ttft_slo", ttft - c.ttft_slo)
        return ttft


def _seat_wait(s: EngineSnapshot, pending: int) -> float:
    """Until a seat frees for a newcomer behind `pending` others: the k-th shortest remaining
    reply among the running requests, k being how many seats are missing, at a loaded step's
    pace (a full batch's decode step, stretched to the target ITL by prefill chunks)."""
    missing = s.num_running + pending + 1 - max(s.max_num_seqs, 1)
    if missing <= 0 or not s.remaining_tokens:
        return 0.0
    rounds, k = divmod(missing - 1, len(s.remaining_tokens))
    steps = (rounds * s.remaining_tokens[-1]) + s.remaining_tokens[k]
    costs, seats = s.step_costs, s.max_num_seqs
    return steps * max(costs.decode_seconds(seats), costs.target_itl)


def _too_many(message: str, code: str, retry_after: float) -> ApiError:
    seconds = max(1, math.ceil(retry_after))
    return ApiError(429, f"server busy: {message}; retry in {seconds} s", None, code,
                    headers={"Retry-After": str(seconds)})
