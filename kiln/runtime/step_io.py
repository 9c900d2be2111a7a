"""What one engine step passes along: the scheduler's plan (SchedulerOutput), the runner's samples
(RunnerOutput) and what the scheduler's update() made of them (UpdateOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.runtime.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int                 # proposed tokens included
    proposed: tuple[int, ...] = ()      # guessed next tokens, computed after the request's own

    # Read before update(): request.num_computed_tokens is still this chunk's start.
    @property
    def samples_token(self) -> bool:
        """True when the chunk reaches the end of the known tokens, so a token is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens >= self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)   # freed since the last step
    num_running: int = 0
    num_waiting: int = 0


@dataclass
class RunnerOutput:
    # One token per request whose chunk reached the end of its tokens; none mid-prefill.
    # With proposals it is the token after the accepted ones.
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, object] = field(default_factory=dict)
    num_accepted: dict[str, int] = field(default_factory=dict)   # kept proposals (a prefix of them)


@dataclass
class StepBudget:
    """What is left of this step's token budget, and of the prefill share within it."""
    tokens: int
    prefill_tokens: int

    @property
    def prefill(self) -> int:
        return min(self.tokens, self.prefill_tokens)

    def spend(self, n: int, decode: bool) -> None:
        self.tokens -= n
        if not decode:
            self.prefill_tokens -= n


@dataclass
class StepStats:
    num_running: int = 0
    num_waiting: int = 0
    num_scheduled_tokens: int = 0
    batch_size: int = 0
    num_prefill_chunks: int = 0
    num_preempted: int = 0
    num_decodes: int = 0            # sequences that got their next token's one new token
    num_proposed_tokens: int = 0    # proposals those decodes verify
    num_prefill_tokens: int = 0
    prefill_budget: int = 0         # the prefill tokens this step was allowed
    batch_wait_seconds: float | None = None   # how long the batch wait window held this step's prompts


@dataclass
class RequestDelta:
    """What one step produced for one request."""
    request: Request
    new_token_ids: list[int]
    logprobs: object | None = None

    @property
    def finished(self) -> bool:
        return self.request.is_finished


@dataclass
class UpdateOutput:
    """What update() did: the tokens each request gained (in schedule order; none for a request
    mid-prefill) and the requests it finished (EOS, a stop token, length)."""
    deltas: list[RequestDelta] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
