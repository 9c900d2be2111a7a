"""Turns engine-core token deltas into text: incremental detokenization and stop strings.

Runs on the engine's thread right after each step. It never touches the engine core: when a
stop string ends a request the engine still runs, process() says so and its caller (the engine
client) finishes the request before the next step is scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.request import FINISH_REASONS, Request, RequestStatus
from kiln.runtime.step_io import RequestDelta
from kiln.tokenizer import Tokenizer


@dataclass
class RequestMetrics:
    queue_time: float | None = None      # arrival -> first scheduled
    ttft: float | None = None            # arrival -> first token
    inter_token_latencies: list[float] = field(default_factory=list)
    e2e: float | None = None

    @classmethod
    def of(cls, r: Request) -> "RequestMetrics":
        t = r.timings
        since = (lambda x: None if x is None else x - r.arrival_time)
        itl = [b - a for a, b in zip(t.token_times, t.token_times[1:])]
        return cls(since(t.first_scheduled_time), since(t.first_token_time), itl, since(t.finished_time))


@dataclass
class StreamDelta:
    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)
    # The first delta of a request that asked for prompt logprobs: those of prompt tokens 1, 2 ...
    prompt_logprobs: list | None = None


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    logprobs: list
    metrics: RequestMetrics
    prompt_logprobs: list | None = None     # with SamplingParams.prompt_logprobs (token 0 has none)
    index: int = 0                          # the sequence's index (vLLM's CompletionOutput.index)

    # NOTE: vLLM's shapes, so code ported from it runs: a RequestOutput holds its sequences in
    # `outputs` (kiln samples one per request: this output itself) and says `finished`.
    @property
    def outputs(self) -> list[CompletionOutput]:
        return [self]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._logprobs: dict[str, list] = {}
        self._sent_prompt_logprobs: set[str] = set()

    def add(self, request: Request) -> None:
        p = request.sampling_params
        self._detok[request.request_id] = IncrementalDetokenizer(
            self.tokenizer.fast, request.prompt_token_ids, skip_special_tokens=p.skip_special_tokens,
            stop=p.stop, include_stop=p.include_stop_str_in_output)
        self._logprobs[request.request_id] = []

    def process(self, delta: RequestDelta) -> tuple[StreamDelta, str | None]:
        """The step's text for one request, and the stop string that ended it if the engine still
        runs it: the caller must then finish it (FINISHED_STOPPED, that stop reason)."""
        r = delta.request
        detok = self._detok[r.request_id]
        text, token_ids = _step(detok, delta.new_token_ids)
        if delta.logprobs is not None:
            self._logprobs[r.request_id].append(delta.logprobs)
        stop = detok.stop_reason if detok.stopped and not r.is_finished else None
        if len(token_ids) < len(delta.new_token_ids):
            _drop_tail(r, len(delta.new_token_ids) - len(token_ids), stop, detok.stop_reason)
        finished = r.is_finished or stop is not None
        if finished and not detok.stopped:
            text += detok.finish()
        reason = FINISH_REASONS[RequestStatus.FINISHED_STOPPED] if stop is not None else r.finish_reason
        prompt_lps = None
        if r.sampling_params.prompt_logprobs is not None and r.request_id not in self._sent_prompt_logprobs:
            self._sent_prompt_logprobs.add(r.request_id)
            prompt_lps = list(r.prompt_logprobs)
        return StreamDelta(r.request_id, text, token_ids, finished, reason,
                           [delta.logprobs] if delta.logprobs is not None else [], prompt_lps), stop

    def aborted(self, request: Request) -> StreamDelta:
        return StreamDelta(request.request_id, "", [], True, request.finish_reason)

    def result(self, r: Request) -> CompletionOutput:
        detok = self._detok.pop(r.request_id)
        return CompletionOutput(r.request_id, r.prompt_token_ids, detok.output_text, list(r.output_token_ids),
                                r.finish_reason, r.stop_reason, r.num_cached_tokens,
                                self._logprobs.pop(r.request_id), RequestMetrics.of(r),
                                list(r.prompt_logprobs) if r.sampling_params.prompt_logprobs is not None else None)

    def forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self._logprobs.pop(request_id, None)
        self._sent_prompt_logprobs.discard(request_id)


def _drop_tail(r: Request, n: int, stop: str | None, stop_reason: str | None) -> None:
    """The stop string came first, n tokens before the step's last, whatever ended the request
    in the step (length, EOS). NOTE: when the engine still runs it (`stop` set), the caller
    finishes it right after, with that stop reason."""
    r.drop_output_tail(n)
    if stop is None:
        r.status, r.stop_reason = RequestStatus.FINISHED_STOPPED, stop_reason


def _step(detok: IncrementalDetokenizer, token_ids: list[int]) -> tuple[str, list[int]]:
    """Detokenize a step's tokens; several (accepted proposals) go one at a time when stop
    strings are set, so a stop ends the output at the token that completed it, as it would
    without speculation. Returns the text and the tokens kept."""
    if len(token_ids) == 1 or not detok.stop_matcher.stops:
        return detok.step(token_ids), token_ids
    text = ""
    for i, token in enumerate(token_ids):
        text += detok.step([token])
        if detok.stopped:
            return text, token_ids[:i + 1]
    return text, token_ids
