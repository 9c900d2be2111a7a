"""Turns engine-core token deltas into text: incremental detokenization and stop strings.

Runs on the engine's thread right after each step, so a stop string finishes its request
before the next step is scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.engine_core import EngineCore, RequestDelta
from kiln.runtime.request import Request, RequestStatus
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


class OutputProcessor:
    def __init__(self, core: EngineCore, tokenizer: Tokenizer):
        self.core, self.tokenizer = core, tokenizer
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._logprobs: dict[str, list] = {}

    def add(self, request: Request) -> None:
        self._detok[request.request_id] = IncrementalDetokenizer(
            self.tokenizer.fast, request.prompt_token_ids, stop=request.sampling_params.stop)
        self._logprobs[request.request_id] = []

    def process(self, delta: RequestDelta) -> StreamDelta:
        r = delta.request
        detok = self._detok[r.request_id]
        text, token_ids = _step(detok, delta.new_token_ids)
        if delta.logprobs is not None:
            self._logprobs[r.request_id].append(delta.logprobs)
        if detok.stopped and not r.is_finished:
            self.core.finish(r.request_id, RequestStatus.FINISHED_STOPPED, stop_reason=detok.stop_reason)
        if len(token_ids) < len(delta.new_token_ids):
            # The stop string came first, whatever ended the request in the step (length, EOS).
            r.drop_output_tail(len(delta.new_token_ids) - len(token_ids))
            r.status, r.stop_reason = RequestStatus.FINISHED_STOPPED, detok.stop_reason
        if r.is_finished and not detok.stopped:
            text += detok.finish()
        return StreamDelta(r.request_id, text, token_ids, r.is_finished, r.finish_reason,
                           [delta.logprobs] if delta.logprobs is not None else [])

    def aborted(self, request: Request) -> StreamDelta:
        return StreamDelta(request.request_id, "", [], True, request.finish_reason)

    def result(self, r: Request) -> CompletionOutput:
        detok = self._detok.pop(r.request_id)
        return CompletionOutput(r.request_id, r.prompt_token_ids, detok.output_text, list(r.output_token_ids),
                                r.finish_reason, r.stop_reason, r.num_cached_tokens,
                                self._logprobs.pop(r.request_id), RequestMetrics.of(r))

    def forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self._logprobs.pop(request_id, None)


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
