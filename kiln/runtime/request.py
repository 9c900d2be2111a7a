"""A request's state as the scheduler sees it: tokens, progress and how it ended."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kiln.runtime.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    # NOTE: ordered; every status from FINISHED_STOPPED on is final.
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_TIMEOUT = 6

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status >= RequestStatus.FINISHED_STOPPED


# OpenAI's finish_reason for each final status.
FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_TIMEOUT: "timeout",
}


# The fit rule. NOTE: the last sampled token is never computed (the request ends before it would
# be fed back), so a request of n tokens, prompt and output, holds KV for n - 1 of them at most.
# The scheduler (which requests can ever run) and the server (what to refuse up front) both ask here.
def kv_tokens_held(num_tokens: int) -> int:
    """The most tokens whose KV a request of `num_tokens` tokens ever holds."""
    return num_tokens - 1


def longest_fitting(num_kv_tokens: int) -> int:
    """The longest request (prompt and output tokens) whose KV fits in `num_kv_tokens` slots."""
    return num_kv_tokens + 1


@dataclass
class RequestTimings:
    """Monotonic timestamps the engine core records for latency metrics."""

    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    # NOTE: further end-of-turn ids the model stops on (Gemma's <end_of_turn>, Llama 3's <|eot_id|>)
    extra_eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0      # prompt tokens served by the prefix cache at first scheduling
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    timings: RequestTimings = field(default_factory=RequestTimings)
    # With sampling_params.prompt_logprobs: the logprobs of prompt tokens 1, 2 ... (the first
    # has none), filled chunk by chunk as the prompt is computed (runner.record_prompt_logprobs).
    prompt_logprobs: list = field(default_factory=list)
    # The scheduler lowers this to fit max_model_len; sampling_params stays as the caller sent it.
    max_tokens: int = field(init=False)
    _all_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self):
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.output_token_ids = list(self.output_token_ids)
        self.max_tokens = self.sampling_params.max_tokens
        self._all_token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens. NOTE: a live view; do not mutate it."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def drop_output_tail(self, n: int) -> None:
        """Forget the last n output tokens: a stop string completed before them (they came in
        one step, as accepted proposals). NOTE: only for a request finished, or finished before
        the next step (the output processor's stop string); its KV is gone by then."""
        if n > 0:
            del self.output_token_ids[-n:]
            del self._all_token_ids[-n:]
