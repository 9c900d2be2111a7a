"""Admission control: predict each request's time to first token against the objective
(ttft_slo). A request predicted within ttft_refuse_factor times the objective is admitted and
queues, as a vLLM-like server queues everything; past that multiple, or past a queue bound
(max_waiting, max_waiting_tokens), it is refused at once (429 + Retry-After) rather than let the
queue grow until every admitted request misses its target. Past the multiple, a refusal also
needs evidence (Audit.trusted): until requests predicted past the bound have lately taken past it,
such a request is admitted and its first token says whether the prediction came true. The strict
mode (a factor of 1) refuses on the prediction alone. NOTE: why a multiple and not the
objective itself by default: refusing at the objective turned away 42 of 48 requests of a
closed-loop benchmark at concurrency 8 (200-token prompts) on a server that served all of them
within 6 s; benchmarks and clients do not retry 429s. A factor of 1 is the strict mode.

A request counts as waiting from admission until its first token. Its predicted TTFT is

    seat wait  +  time to prefill what is left of the waiting prompts ahead of it, and its own

where a prompt's leading tokens already in the prefix cache count as done (the engine computes
only the uncached tail; the engine snapshot's view of the prefix cache, PrefixCacheView, answers
before admission),

both read from the engine's step-cost model (kiln/runtime/step_costs.py), so the decode load
counts: while d streams decode, a step prefills only the chunk that keeps it within the target
inter-token latency, and takes as long as the model says such a step takes. The streams that
decode meanwhile are today's decoding ones, joined by each waiting prompt once it is prefilled
(StepCosts.queue_prefill_seconds walks the queue in first-come order, as the scheduler does).
NOTE: a running request still prefilling is both in the engine's running count and among the
waiting tickets; it is counted once, as a prompt. When every seat (max_num_seqs) is taken, the
request also waits for enough running requests to reach their max_tokens (an upper bound: EOS
may come sooner).

What the model cannot see (the HTTP thread's share of the GIL, attention growing along a long
prompt, the step in flight when a request arrives) is learnt back: every admitted request's first
token compares the time it took with the time predicted, and the 90th percentile of that ratio
(Calibration) scales the next predictions. The calibration can correct a model that is wrong by a
constant factor, not one whose error depends on the load: a prediction too pessimistic under load
would refuse requests that would have met the objective (the double-counted decode load did
this: at 16 chat clients a third of the requests got 429).
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence

from kiln.config import AdmissionConfig
from kiln.runtime.engine_stats import EngineSnapshot
from kiln.runtime.scheduler import LATE_SHARE
from kiln.serving.http.errors import ApiError

# DEBUG: one line per decision and per first token (predicted vs realised), to check the predictor.
log = logging.getLogger("kiln.serving.traffic.admission")


# The quantile of realised over predicted TTFT a refusal is judged on (Admission._refusal_ttft):
# refused only where three in four first tokens of such predictions would have come later.
REFUSAL_QUANTILE = 0.25


class Calibration:
    """A quantile of realised over predicted TTFT (event-loop thread), by the stochastic quantile
    update: up by STEP * quantile after a ratio above it, down by STEP * (1 - quantile) after one
    below, so it settles where `quantile` of the ratios fall below. NOTE: a quantile, not a mean:
    a mean-calibrated prediction is late half the time; fixed steps also shrug off an outlier (a
    request stuck behind a hiccup) that would drag a mean."""

    QUANTILE, STEP, LOW, HIGH = 0.9, 0.05, 0.25, 4.0
    RELAX = 0.9                 # the factor after a refusal proved unneeded (Audit)
    MIN_PREDICTED = 0.05        # seconds; shorter predictions are mostly noise to learn from

    def __init__(self, quantile: float = QUANTILE):
        self.quantile = quantile
        self.factor = 1.0

    def relax(self) -> None:
        self.factor = max(self.factor * self.RELAX, self.LOW)

    def observe(self, predicted: float, realised: float) -> None:
        if predicted < self.MIN_PREDICTED:
            return
        above = realised / predicted > self.factor
        self.factor *= 1 + self.STEP * (self.quantile if above else self.quantile - 1)
        self.factor = min(max(self.factor, self.LOW), self.HIGH)


class Audit:
    """Each admission decision checked against what then happened (event-loop thread).

    An admitted request is late when its first token came after the objective. A refused request
    never runs, so what it would have waited is read off the request admitted next: it queued
    behind the same work. A refusal is unneeded when that request's first token came within the
    refusal's own bound; the calibration then relaxes (Calibration.relax): admitted requests alone
    pull a pessimistic prediction down slowly, and each unneeded refusal is a user turned away."""

    VERDICTS, MIN_VERDICTS, TRUST = 8, 4, 0.75

    def __init__(self):
        self.admitted_on_time = self.admitted_late = self.refused = self.refused_unneeded = 0
        self._open: list[float] = []     # the bounds of refusals since the last admission
        # Whether requests predicted past the refusal bound really took past it: refusals judged
        # by the next admission, and requests admitted while the predictor was not trusted yet.
        self._verdicts: deque[bool] = deque(maxlen=self.VERDICTS)

    def trusted(self) -> bool:
        """Whether a prediction past the bound has lately come true often enough to refuse on."""
        n = len(self._verdicts)
        return n >= self.MIN_VERDICTS and sum(self._verdicts) >= self.TRUST * n

    def shadow(self, realised: float, bound: float) -> None:
        """A request predicted past the bound but admitted (the predictor not trusted): did it take past it?"""
        self._verdicts.append(realised > bound)

    def refusal(self, bound: float) -> None:
        self.refused += 1
        self._open.append(bound)

    def take_open(self) -> list[float]:
        """At an admission: the refusals made since the previous one, for its first token to judge."""
        taken, self._open = self._open, []
        return taken

    def judge(self, refusal_bounds: list[float], realised: float, objective: float, calibration: Calibration) -> None:
        if objective:
            late = realised > objective
            self.admitted_late += late
            self.admitted_on_time += not late
        for bound in refusal_bounds:
            needed = realised > bound
            self._verdicts.append(needed)
            if not needed:
                self.refused_unneeded += 1
                calibration.relax()


class Ticket:
    """An admitted request's place among the waiting, given back at its first token (which also
    teaches the calibration) or when it ends without one."""

    def __init__(self, admission: Admission, num_tokens: int, num_cached: int, predicted: float,
                 refusals_before: list[float]):
        self._admission, self.num_tokens, self.num_cached = admission, num_tokens, num_cached
        self.predicted, self.admitted_at = predicted, time.monotonic()
        self._refusals_before = refusals_before     # the refusal bounds this request's first token judges
        self.shadow_bound: float | None = None      # admitted though predicted past this bound

    def first_token(self) -> None:
        admission = self._admission
        if admission is not None:
            realised = time.monotonic() - self.admitted_at
            log.debug("first token: predicted %.3f s, realised %.3f s", self.predicted, realised)
            admission.calibration.observe(self.predicted, realised)
            admission.refusal_calibration.observe(self.predicted, realised)
            admission.audit.judge(self._refusals_before, realised, admission.config.ttft_slo,
                                  admission.refusal_calibration)
            if self.shadow_bound is not None:
                admission.audit.shadow(realised, self.shadow_bound)
        self.release()

    def release(self) -> None:
        admission, self._admission = self._admission, None
        if admission is not None:
            del admission.waiting[self]


class Admission:
    def __init__(self, config: AdmissionConfig, client, cached_prefix: Callable[[Sequence[int]], int] | None = None):
        """`client` is the engine client; its snapshot is read (never written) on each request.
        `cached_prefix(token_ids, salt)`: a prompt's leading tokens the prefix cache holds (by default
        what the snapshot's prefix-cache view says)."""
        self.config, self.client = config, client
        self.cached_prefix = cached_prefix or self._snapshot_prefix
        # Admitted, no first token yet, in admission order (event-loop thread only).
        self.waiting: dict[Ticket, None] = {}
        self.calibration = Calibration()
        self.refusal_calibration = Calibration(REFUSAL_QUANTILE)
        self.audit = Audit()

    def _snapshot_prefix(self, token_ids: Sequence[int], salt: str | None = None) -> int:
        return self.client.snapshot.prefix_cache.cached_prefix_tokens(token_ids, salt)

    @property
    def pending(self) -> int:
        return len(self.waiting)

    @property
    def pending_tokens(self) -> int:
        return sum(t.num_tokens for t in self.waiting)

    @property
    def prefill_tokens_per_second(self) -> float:
        """Prefill rate with nothing decoding (the step-cost model's token cost)."""
        return 1.0 / self.client.snapshot.step_costs.prefill_seconds_per_token

    def predicted_ttft(self, num_prompt_tokens: int, num_cached: int = 0, horizon: float = math.inf) -> float:
        """Calibrated; a prediction past `horizon` seconds may stop early (still past it)."""
        factor = self.calibration.factor
        return factor * self.modelled_ttft(num_prompt_tokens, num_cached, horizon / factor)

    def modelled_ttft(self, num_prompt_tokens: int, num_cached: int = 0, horizon: float = math.inf) -> float:
        """The step-cost model's TTFT, before calibration."""
        s = self.client.snapshot
        decoding = max(s.num_running - s.num_prefilling, 0)
        prompts = _left_to_prefill([(t.num_tokens, t.num_cached) for t in self.waiting], s.prefilled_tokens)
        prompts.append(num_prompt_tokens - num_cached)
        seats = _seat_wait(s, max(self.pending - s.num_prefilling, 0))
        return seats + s.step_costs.queue_prefill_seconds(prompts, decoding, max(s.max_num_seqs, 1),
                                                          horizon - seats, decode_ends=s.remaining_tokens,
                                                          late_after=self._until_late() - seats)

    def _until_late(self) -> float:
        """Seconds until the oldest waiting request (or a newcomer, when none waits) is late for
        the objective, when the scheduler turns to its late steps (LATE_SHARE, StepCosts.late)."""
        if not self.config.ttft_slo:
            return math.inf
        oldest = next(iter(self.waiting), None)
        waited = time.monotonic() - oldest.admitted_at if oldest is not None else 0.0
        return LATE_SHARE * self.config.ttft_slo - waited

    def admit_prompt(self, token_ids: Sequence[int], cache_salt: str | None = None) -> Ticket:
        """cache_salt: the request's prefix-cache salt. NOTE: the prediction must count only the
        blocks the request will really hit: blocks cached under another salt would make admission
        (a 429 or not) answer what the prefix cache refuses to tell."""
        return self.admit(len(token_ids), self.cached_prefix(token_ids, cache_salt))

    def admit(self, num_prompt_tokens: int, num_cached: int = 0) -> Ticket:
        """A ticket, or ApiError(429) naming the bound that refused the request."""
        predicted, shadow_bound = self._check(num_prompt_tokens, num_cached)
        ticket = Ticket(self, num_prompt_tokens, num_cached, predicted, self.audit.take_open())
        ticket.shadow_bound = shadow_bound
        self.waiting[ticket] = None
        return ticket

    def _check(self, n: int, cached: int) -> tuple[float, float | None]:
        """The predicted TTFT, and the refusal bound it passed where the request is admitted all
        the same (the predictor not trusted yet), unless a bound refuses the request."""
        c = self.config
        if c.max_waiting is not None and self.pending >= c.max_waiting:
            raise _too_many(f"{self.pending} requests are already waiting (max {c.max_waiting})",
                            "max_waiting", self.predicted_ttft(0))
        if c.max_waiting_tokens is not None and self.pending_tokens + n > c.max_waiting_tokens:
            raise _too_many(f"{self.pending_tokens} prompt tokens are already waiting and this request "
                            f"adds {n} (max {c.max_waiting_tokens})", "max_waiting_tokens", self.predicted_ttft(0))
        limit = c.ttft_slo * c.ttft_refuse_factor
        ttft = self.predicted_ttft(n, cached, horizon=limit or math.inf)
        # NOTE: the calibrated prediction first: within the bound, the model's own (never higher
        # once the factor is above one) is too, and is not computed a second time.
        past = (bool(c.ttft_slo) and ttft > limit and self._refusal_ttft(ttft, n, cached, limit) > limit
                and self._measured())
        refused = past and (c.ttft_refuse_factor == 1 or self.audit.trusted())
        if log.isEnabledFor(logging.DEBUG):
            self._trace(n, cached, ttft, refused)
        if not refused:
            return ttft, limit if past else None
        self.audit.refusal(limit)
        bound = f"the {c.ttft_slo:g} s objective" if c.ttft_refuse_factor == 1 else \
            f"{c.ttft_refuse_factor:g} x the {c.ttft_slo:g} s objective"
        raise _too_many(f"predicted time to first token {ttft:.2f} s exceeds {bound}", "ttft_slo", ttft - limit)

    def _refusal_ttft(self, predicted: float, n: int, cached: int, limit: float) -> float:
        """The prediction a refusal is judged on: the model's, scaled by a low quantile of its
        errors (refusal_calibration, REFUSAL_QUANTILE), which may lower it, never raise it. NOTE:
        the queue's prediction takes a high quantile so that it is seldom late; a refusal on it
        turned away requests that most often came in time (under a closed-loop crowd the next
        admitted request proved most refusals unneeded: docs/results/2026-12-06-serving-fourth-round.md).
        A refusal is a user lost, a late first token is not: refuse only what even a quick outcome
        would not bring within the bound."""
        low = min(self.refusal_calibration.factor, 1.0)
        if low >= self.calibration.factor:
            return predicted
        return low * self.modelled_ttft(n, cached, (limit or math.inf) / low)

    def _measured(self) -> bool:
        """Whether the prediction rests on measured step costs. NOTE: until the engine has timed a
        step with streams decoding, any prediction with a decode in it (a stream decoding now, or
        a waiting prompt that will decode beside the next) uses the prior step cost
        (PRIOR_DECODE_SECONDS), which can be many times a small model's (a tiny model's cold
        server had its first burst predicted seconds late). A refusal needs
        evidence, so such a request is admitted; the queue bounds still hold. An idle server with
        nothing waiting predicts from the prefill rate alone."""
        s = self.client.snapshot
        return bool(s.step_costs.decode_seconds_by_bucket) or (s.num_running == 0 and not self.waiting)

    def _trace(self, n: int, cached: int, ttft: float, refused: bool) -> None:
        s = self.client.snapshot
        decoding = max(s.num_running - s.num_prefilling, 0)
        costs = s.step_costs
        verdict = "refuse" if refused else "queue (past the objective)" if ttft > self.config.ttft_slo > 0 else "admit"
        log.debug("%s %d tokens (%d cached): predicted %.3f s (x%.2f); running %d (%d prefilling), "
                  "waiting %d with %d tokens (%d prefilled); model: %.2f ms/prefill token, decode step "
                  "%.1f ms, prefill budget %d", verdict, n, cached, ttft,
                  self.calibration.factor, s.num_running, s.num_prefilling, self.pending,
                  self.pending_tokens, s.prefilled_tokens, 1e3 * costs.prefill_seconds_per_token,
                  1e3 * costs.decode_seconds(decoding), costs.prefill_budget(decoding))


def _left_to_prefill(prompts: list[tuple[int, int]], prefilled: int) -> list[int]:
    """The waiting prompts' tokens still to compute, from (prompt tokens, cached at admission):
    the engine prefills first come first, so the tokens it computed so far (prefix hits
    included) belong to the oldest. NOTE: the snapshot may lag a step behind the tickets; the
    clamp keeps a stale one from counting work twice as done."""
    left = []
    for n, cached in prompts:
        done = min(n, prefilled)
        prefilled -= done
        left.append(n - max(done, cached))
    return left


def _seat_wait(s: EngineSnapshot, num_ahead: int) -> float:
    """Until a seat frees for a newcomer behind `num_ahead` waiting requests that hold no seat yet,
    at a full batch's decode pace: the running requests free their seats as they reach
    max_tokens (s.remaining_tokens), each request ahead takes the first seat free and keeps it
    for as long as the longest running reply (its own length is unknown until it runs), and the
    newcomer takes the first seat free after them. Since that reply is the longest, a seat retaken
    frees after every seat free now: the seats go round in order, max_num_seqs at a time. NOTE: the
    model before this one counted a round per running request: behind one running 64-token reply
    and 7 waiting requests (4 seats) it counted 320 decode steps where the seats free after 128,
    and a closed-loop benchmark's burst got a 429 past the refuse multiple. NOTE: not at the
    target ITL: the prefill chunks that stretch a step are the waiting prompts', which
    queue_prefill_seconds counts already; counting them here too predicted first tokens many
    times later than they came."""
    seats = max(s.max_num_seqs, 1)
    frees = [0] * max(seats - len(s.remaining_tokens), 0) + list(s.remaining_tokens)   # ascending
    reply = s.remaining_tokens[-1] if s.remaining_tokens else 0
    rounds, k = divmod(num_ahead, seats)
    return (rounds * reply + frees[k]) * s.step_costs.decode_seconds(seats)


def _too_many(message: str, code: str, retry_after: float) -> ApiError:
    seconds = max(1, math.ceil(retry_after))
    return ApiError(429, f"server busy: {message}; retry in {seconds} s", None, code,
                    headers={"Retry-After": str(seconds)})
