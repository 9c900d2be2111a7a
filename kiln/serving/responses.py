"""OpenAI response bodies and SSE chunks, rendered from a subscription's deltas."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import AsyncIterator

from kiln.runtime.outputs import StreamDelta
from kiln.serving.flights import Subscription, Usage
from kiln.serving.tools import ToolCallStream, split_tool_calls, tool_call
from kiln.tokenizer import Tokenizer


def usage_body(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def sse(payload) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class Renderer:
    """Renders one response: a completion or a chat completion, whole or as a stream."""

    def __init__(self, kind: str, model: str, tokenizer: Tokenizer, parse_tool_calls: int = 0):
        """parse_tool_calls: at most this many tool calls are parsed out of a chat reply (0: none)."""
        self.kind, self.model, self.tokenizer = kind, model, tokenizer
        self.tools = ToolCallStream(parse_tool_calls) if parse_tool_calls else None
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id, self.created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"

    # -- whole responses ------------------------------------------------------------------------
    def body(self, deltas: list[StreamDelta], usage: Usage, memo: dict | None = None) -> dict:
        """memo: where a cached response keeps its parsed tool calls (by max_calls), so a cache
        hit does not parse the reply again; each response still gets fresh call ids."""
        text = "".join(d.text for d in deltas)
        finish = deltas[-1].finish_reason if deltas else "abort"
        choice = {"index": 0, "finish_reason": finish, "logprobs": self._logprobs(deltas)}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
            if self.tools is not None:
                parsed = memo.get(self.tools.max_calls) if memo is not None else None
                if parsed is None:
                    parsed = split_tool_calls(text, self.tools.max_calls)
                    if memo is not None:
                        memo[self.tools.max_calls] = parsed
                content, calls = parsed[0], [tool_call(name, args) for name, args in parsed[1]]
                if calls:
                    choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                    choice["finish_reason"] = _tool_finish(finish)
        else:
            choice["text"] = text
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage_body(usage)}

    # -- streams ----------------------------------------------------------------------------------
    async def stream(self, sub: Subscription, include_usage: bool, continuous_usage: bool = False
                     ) -> AsyncIterator[bytes]:
        """SSE chunks, then a usage chunk if asked for, then [DONE]. An engine error mid-stream is
        an error event (the status line has gone already). continuous_usage: every chunk carries
        the usage so far (vLLM's continuous_usage_stats)."""
        generated = 0

        def so_far() -> dict | None:
            u = sub.usage
            return usage_body(Usage(u.prompt_tokens, generated, u.cached_tokens)) if continuous_usage else None

        if self.kind == "chat":
            yield sse(self._chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None},
                                  usage=so_far()))
        try:
            async for delta in sub.deltas():
                generated += len(delta.token_ids)
                if self.tools is not None:
                    for chunk in self._tool_chunks(delta):
                        yield sse({**chunk, "usage": so_far()} if continuous_usage else chunk)
                elif delta.text or delta.finished:
                    yield sse(self._chunk(self._delta_choice(delta), usage=so_far()))
        except Exception as e:
            yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
            return
        if include_usage:
            yield sse(self._chunk(None, usage=usage_body(sub.usage)))
        yield sse("[DONE]")

    def _chunk(self, choice: dict | None, usage: dict | None = None) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        choices = [] if choice is None else [{"index": 0, "logprobs": None, **choice}]
        chunk = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    def _delta_choice(self, d: StreamDelta) -> dict:
        choice = {"finish_reason": d.finish_reason if d.finished else None, "logprobs": self._logprobs([d])}
        if self.kind == "chat":
            choice["delta"] = {"content": d.text} if d.text else {}
        else:
            choice["text"] = d.text
        return choice

    def _tool_chunks(self, d: StreamDelta) -> list[dict]:
        """Content as it comes, each tool call whole when it closes (OpenAI clients accumulate
        `tool_calls` deltas by index, so one delta per call is a valid stream)."""
        events = self.tools.feed(d.text) + (self.tools.finish() if d.finished else [])
        index = self.tools.num_calls - sum(kind == "call" for kind, _ in events)   # of the first call here
        chunks = []
        for kind, value in events:
            if kind == "content":
                delta = {"content": value}
            else:
                delta, index = {"tool_calls": [{"index": index, **value}]}, index + 1
            chunks.append(self._chunk({"delta": delta, "finish_reason": None}))
        if d.finished:
            finish = _tool_finish(d.finish_reason) if self.tools.num_calls else d.finish_reason
            chunks.append(self._chunk({"delta": {}, "finish_reason": finish}))
        return chunks

    # -- logprobs ---------------------------------------------------------------------------------
    def _logprobs(self, deltas: list[StreamDelta]) -> dict | None:
        pairs = [(t, lp) for d in deltas for t, lp in zip(d.token_ids, d.logprobs) if lp is not None]
        if not pairs:
            return None
        return self._chat_logprobs(pairs) if self.kind == "chat" else self._completion_logprobs(pairs)

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chat_logprobs(self, pairs) -> dict:
        def entry(token_id, logprob):
            text = self._token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        return {"content": [{**entry(t, lp.token_logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                            for t, lp in pairs]}

    def _completion_logprobs(self, pairs) -> dict:
        tokens = [self._token(t) for t, _ in pairs]
        offsets = [0, *itertools.accumulate(len(x) for x in tokens)][:-1]
        return {"tokens": tokens, "token_logprobs": [lp.token_logprob for _, lp in pairs],
                "top_logprobs": [{self._token(i): v for i, v in lp.top} for _, lp in pairs],
                "text_offset": offsets}


def _tool_finish(finish: str | None) -> str | None:
    # A reply that ended by itself with calls in it is a tool call; one cut short stays `length`.
    return "tool_calls" if finish == "stop" else finish
