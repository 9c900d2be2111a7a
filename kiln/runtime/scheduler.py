"""In-flight batching: each step, every request's num_computed_tokens catches up with its token
count under one token budget. There is no prefill or decode phase: a chunked prefill is just a
smaller count, a decode a count of one, and a prefix-cache hit raises num_computed_tokens.

Speculative decoding (a Speculator, optional): a decode may carry proposed tokens, which the
step computes after its last token; update() keeps the accepted ones and rolls the rejected
ones' KV back (num_computed_tokens, and blocks that hold only rejected slots)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Callable

from kiln.config import AUTO_BATCH_FLOOR, SchedulerConfig, SchedulingPolicy
from kiln.runtime.batch_wait import BatchWaitWindow
from kiln.runtime.kv_manager import KVCacheManager
from kiln.runtime.request import Request, RequestStatus, kv_tokens_held
from kiln.runtime.speculative.speculator import Speculator
from kiln.runtime.step_costs import StepCostModel, StepCosts
from kiln.runtime.step_io import (RequestDelta, RunnerOutput, ScheduledRequest, SchedulerOutput, StepBudget,
                                  StepStats, UpdateOutput)

LATE_SHARE = 0.5      # a prompt is late once it has waited this share of target_ttft for its first token


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 speculator: Speculator | None = None, clock: Callable[[], float] = time.monotonic):
        if config.max_num_seqs == 0:     # auto, unresolved (the engine core resolves it from the artifact)
            config = replace(config, max_num_seqs=AUTO_BATCH_FLOOR)
        self.config = config
        self.kv = kv_manager
        self.speculator = speculator
        self.clock = clock                          # the requests' arrival_time clock
        self.requests: dict[str, Request] = {}      # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []            # oldest admission first
        self.num_preemptions = 0
        self.last_step_stats = StepStats()
        self._finished_ids: list[str] = []
        self.step_costs = StepCostModel(config.target_itl, config.min_prefill_chunk,
                                        config.max_num_batched_tokens, config.itl_stretch)
        self._first_step_seen = False
        self.batch_wait = BatchWaitWindow(config.batch_wait, config.batch_wait_batch or config.max_num_seqs)

    # -- admission ----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self._check_fits(request)
        limit = self.config.max_model_len
        # Generation ends with "length" at max_model_len.
        request.max_tokens = min(request.max_tokens, limit - request.num_prompt_tokens)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _check_fits(self, request: Request) -> None:
        n, limit = request.num_prompt_tokens, self.config.max_model_len
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if n == 0:
            raise ValueError("the prompt is empty; at least one token is needed")
        if n >= limit:
            raise ValueError(f"the prompt has {n} tokens but max_model_len is {limit}: "
                             f"at most {limit - 1} fit, leaving room for one generated token")
        max_len = kv_tokens_held(min(n + request.max_tokens, limit))
        blocks = -(-max_len // self.kv.block_size)
        if blocks > self.kv.num_blocks:
            raise ValueError(f"the request can grow to {max_len} tokens ({blocks} KV blocks) but "
                             f"the KV cache holds {self.kv.num_blocks} blocks; lower max_tokens")

    # -- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._take_finished_ids())
        prefill_budget = self._step_costs_now().prefill_budget(self._num_decodes())
        budget = StepBudget(self.config.max_num_batched_tokens, prefill_budget)
        self._schedule_running(out, budget, self._proposals())
        held = self.batch_wait.hold(self.waiting, self._num_decodes(), prefill_budget)
        if not out.preempted_request_ids and not held:
            self._schedule_waiting(out, budget)
        return self._finish_schedule(out, prefill_budget)

    def _step_costs_now(self) -> StepCosts:
        """The step costs this step is planned on: while a prompt is late for its TTFT objective,
        with the late step target (StepCosts.late): the decodes go on, and the prompts get the
        larger prefill budget a longer step leaves. NOTE: a late prompt used to get prefill-only
        steps of the whole budget; each burst of late prompts then stalled every decoding stream
        for the whole burst, and the streams it prefilled together ended together, so under a
        closed-loop crowd every burst brought the next (docs/results has the run)."""
        costs = self.step_costs.costs()
        return costs.late() if self._a_prompt_is_late() else costs

    def _take_finished_ids(self) -> list[str]:
        ids, self._finished_ids = self._finished_ids, []
        return ids

    def _finish_schedule(self, out: SchedulerOutput, prefill_budget: int) -> SchedulerOutput:
        out.num_running, out.num_waiting = len(self.running), len(self.waiting)
        self._record_stats(out, prefill_budget)
        return out

    def observe_step(self, seconds: float) -> None:
        """The last scheduled step took `seconds`: refine the step-cost model. NOTE: not the
        engine's first step: it pays one-off costs (kernels prepared, first allocations: several
        times a warm step's cost per token on OpenVINO), and learnt as the prefill rate it made
        admission refuse the first burst of requests, predicted far later than they came."""
        if not self._first_step_seen:
            self._first_step_seen = True
            return
        s = self.last_step_stats
        self.step_costs.observe(s.num_decodes, s.num_prefill_tokens, seconds)

    def _a_prompt_is_late(self) -> bool:
        """Whether a prompt has waited LATE_SHARE of target_ttft for its first token."""
        if not self.config.target_ttft:
            return False
        since = self.clock() - self.config.target_ttft * LATE_SHARE
        return any(r.arrival_time <= since for r in self.waiting) or \
            any(r.arrival_time <= since for r in self.running if r.num_output_tokens == 0)

    def _num_decodes(self) -> int:
        return sum(1 for r in self.running if _is_decode(r))

    def _proposals(self) -> dict[str, list[int]]:
        if self.speculator is None:
            return {}
        return self.speculator.propose([r for r in self.running if _is_decode(r)])

    def _schedule_running(self, out: SchedulerOutput, budget: StepBudget, proposals: dict[str, list[int]]) -> None:
        """Running requests in admission order: each decode, and prefill chunks within the
        prefill budget. NOTE: the prefill budget leaves room in the token budget for every decode
        (StepCosts.prefill_budget), so a prefill earlier in the order never starves one; a
        decode's proposals take only what the decodes after it leave."""
        decodes_left = self._num_decodes()
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            request = self.running[i]
            decode = _is_decode(request)
            proposed = ()
            if decode:
                decodes_left -= 1
                proposed = self._fit_proposals(request, proposals.get(request.request_id, ()),
                                               budget.tokens - 1 - decodes_left)
            n = 1 + len(proposed) if decode else self._chunk(request.num_tokens - request.num_computed_tokens,
                                                               budget.prefill)
            if n > 0:
                if not self._allocate_or_preempt(request, n, out):
                    break
                self._add(out, request, n, proposed)
                budget.spend(n, decode)
            i += 1

    def _fit_proposals(self, request: Request, proposed, room: int) -> tuple[int, ...]:
        """The proposals that fit the budget left and the free KV blocks. NOTE: never worth a
        preemption: without room they are dropped, and the decode goes on alone."""
        proposed = tuple(proposed[:max(room, 0)])
        if proposed and not self.kv.allocate_slots(request, 1 + len(proposed)):
            return ()
        return proposed

    def _allocate_or_preempt(self, request: Request, n: int, out: SchedulerOutput) -> bool:
        """Free-and-requeue the newest running requests until `request` fits; False if it was
        the newest itself. NOTE: running requests before `request` are already scheduled and
        are older, so a victim is never a request scheduled this step."""
        while not self.kv.allocate_slots(request, n):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_request_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    @property
    def batch_limit(self) -> int:
        """The most sequences that may run now: max_num_seqs, and with itl_bounds_batch, past
        AUTO_BATCH_FLOOR only as many as a decode step predicted within target_itl can carry."""
        cap, c = self.config.max_num_seqs, self.config
        if not c.itl_bounds_batch or not c.target_itl or cap <= AUTO_BATCH_FLOOR:
            return cap
        costs = self.step_costs.costs()
        n = AUTO_BATCH_FLOOR
        while n < cap and costs.decode_seconds(n + 1) <= c.target_itl:
            n += 1
        return n

    def _schedule_waiting(self, out: SchedulerOutput, budget: StepBudget) -> None:
        limit = self.batch_limit
        while self.waiting and len(self.running) < limit and budget.prefill > 0:
            request = self._next_waiting()
            if self._shares_a_prefix_in_progress(request):
                break       # next step: the blocks it would compute are cached by then (or closer)
            hits, num_hit = self._computed_blocks(request)
            n = self._chunk(request.num_tokens - num_hit, budget.prefill)
            if not self.kv.allocate_slots(request, n, hits):
                break       # the KV-capacity check: wait for blocks to free up
            self.waiting.remove(request)
            self._admit(request, num_hit)
            self._add(out, request, n)
            budget.spend(n, decode=False)

    def _shares_a_prefix_in_progress(self, request: Request) -> bool:
        """Whether a running request is computing the prompt blocks `request` would compute next
        (both begin with the same system prompt): it waits a step and hits them in the cache."""
        if not self.config.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return False
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        return bool(prefilling) and self.kv.computed_by_another(request, prefilling)

    def _computed_blocks(self, request: Request):
        # NOTE: prompt logprobs need every prompt position computed: no prefix-cache hits.
        if not self.config.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        return self.kv.get_computed_blocks(request)

    def _next_waiting(self) -> Request:
        if self.config.policy is SchedulingPolicy.PRIORITY:
            return min(self.waiting, key=lambda r: (r.sampling_params.priority, r.arrival_time))
        return self.waiting[0]

    def _admit(self, request: Request, num_hit: int) -> None:
        if request.status == RequestStatus.WAITING:
            request.num_cached_tokens = num_hit
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _chunk(self, num_remaining: int, budget: int) -> int:
        cap = self.config.long_prefill_token_threshold or num_remaining
        return min(num_remaining, budget, cap)

    @staticmethod
    def _add(out: SchedulerOutput, request: Request, n: int, proposed: tuple[int, ...] = ()) -> None:
        out.scheduled.append(ScheduledRequest(request, n, proposed))
        out.num_scheduled_tokens += n

    def _record_stats(self, out: SchedulerOutput, prefill_budget: int) -> None:
        prefills = sum(1 for s in out.scheduled
                       if s.request.num_computed_tokens < s.request.num_prompt_tokens)
        decodes = sum(1 for s in out.scheduled if s.num_new_tokens == 1 + len(s.proposed) and _is_decode(s.request))
        proposed = sum(len(s.proposed) for s in out.scheduled)
        self.last_step_stats = StepStats(
            num_running=out.num_running, num_waiting=out.num_waiting,
            num_scheduled_tokens=out.num_scheduled_tokens, batch_size=len(out.scheduled),
            num_prefill_chunks=prefills, num_preempted=len(out.preempted_request_ids),
            num_decodes=decodes, num_proposed_tokens=proposed,
            num_prefill_tokens=out.num_scheduled_tokens - decodes - proposed,
            prefill_budget=prefill_budget, batch_wait_seconds=self.batch_wait.last_wait)

    # -- results ------------------------------------------------------------------------------

    def update(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> UpdateOutput:
        """Advance each scheduled request by its chunk, append sampled tokens and retire the
        requests that finished; returns the tokens each request gained and those finished."""
        result = UpdateOutput()
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            if request.is_finished:     # aborted while its step ran
                continue
            new, status = self._append(request, self._advance(scheduled, runner_output))
            self.kv.cache_computed_blocks(request)
            if new:
                result.deltas.append(RequestDelta(request, new, runner_output.logprobs.get(request.request_id)))
            if status is not None:
                self.finish_request(request.request_id, status)
                result.finished.append(request)
        return result

    def _append(self, request: Request, tokens: list[int]) -> tuple[list[int], RequestStatus | None]:
        """Append the step's tokens up to the first that ends the request; returns the tokens
        appended and the final status (None: the request goes on)."""
        for i, token in enumerate(tokens):
            request.append_output_token(token)
            status = self._stop_status(request, token)
            if status is not None:
                return tokens[:i + 1], status
        return tokens, None

    def _advance(self, scheduled: ScheduledRequest, runner_output: RunnerOutput) -> list[int]:
        """Count the step's computed tokens, less rejected proposals (whose KV is rolled back);
        return the tokens to append (none mid-prefill)."""
        request, proposed = scheduled.request, scheduled.proposed
        accepted = runner_output.num_accepted.get(request.request_id, 0) if proposed else 0
        request.num_computed_tokens += scheduled.num_new_tokens - (len(proposed) - accepted)
        if proposed:
            self.kv.trim(request)
            if self.speculator is not None:
                self.speculator.observe(request.request_id, len(proposed), accepted)
        token = runner_output.sampled_token_ids.get(request.request_id)
        if token is None or request.num_computed_tokens < request.num_tokens:
            return []       # mid-prefill: nothing is sampled
        return list(proposed[:accepted]) + [token]

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        may_end = request.num_output_tokens > params.min_tokens     # NOTE: `token` is appended already
        if token in params.stop_token_ids and may_end:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if (token == request.eos_token_id or token in request.extra_eos_token_ids) and not params.ignore_eos \
                and may_end:
            return RequestStatus.FINISHED_STOPPED
        if (request.num_output_tokens >= request.max_tokens
                or request.num_tokens >= self.config.max_model_len):
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, request_id: str, status: RequestStatus,
                       stop_reason: int | str | None = None) -> None:
        """Retire a request in any state; its blocks return to the pool at once. Unknown ids
        (already finished, never added) are ignored."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"{status.name} is not a final status")
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        if self.speculator is not None:
            self.speculator.forget(request_id)
        request.status = status
        if stop_reason is not None:
            request.stop_reason = stop_reason
        self._finished_ids.append(request_id)

    def abort(self, request_id: str) -> None:
        self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    # -- queries ------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)


def _is_decode(request: Request) -> bool:
    """Read before update(): one new token left, the last sampled one (or a prompt's last)."""
    return request.num_tokens - request.num_computed_tokens == 1
