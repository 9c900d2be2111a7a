"""OpenAI response bodies and SSE chunks, rendered from the subscriptions of a request's choices."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from dataclasses import dataclass, replace
from typing import AsyncIterator

from kiln.runtime.outputs import StreamDelta
from kiln.serving.traffic.flights import Subscription, Usage
from kiln.serving.openai.reasoning import ReasoningStream, split_reasoning
from kiln.serving.openai.tool_formats import call_stream, split_calls
from kiln.serving.openai.tools import ToolCallStream, tool_call
from kiln.tokenizer import Tokenizer
from kiln.serving.http.errors import engine_failure


def usage_body(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def sse(payload) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


@dataclass(frozen=True)
class Echo:
    """A completion's prompt, returned before its output (`echo`)."""
    text: str
    token_ids: tuple[int, ...]


@dataclass
class Choice:
    """One choice of a response: its index, the prompt it samples (list prompts), its deltas."""
    index: int
    prompt_index: int
    sub: Subscription
    echo: Echo | None = None


def total_usage(choices: list[Choice], completion_tokens: int) -> Usage:
    """Each prompt's tokens counted once (its first choice's), however many choices sample it."""
    firsts = {}
    for c in choices:
        firsts.setdefault(c.prompt_index, c.sub.usage)
    return Usage(sum(u.prompt_tokens for u in firsts.values()), completion_tokens,
                 sum(u.cached_tokens for u in firsts.values()))


class Renderer:
    """Renders one response: a completion or a chat completion, whole or as a stream."""

    def __init__(self, kind: str, model: str, tokenizer: Tokenizer, parse_tool_calls: int = 0,
                 echo_only: bool = False, tool_format: str = "hermes", reasoning: str = ""):
        """parse_tool_calls: at most this many tool calls are parsed out of a chat reply (0: none),
        in tool_format's syntax (tool_formats.py). echo_only: `echo` with max_tokens 0: the prompt
        comes back, the sampled token does not. reasoning: "reply" or "opened" splits a <think>
        block into reasoning_content (reasoning.py); "": none."""
        self.kind, self.model, self.tokenizer = kind, model, tokenizer
        self.max_calls, self.echo_only, self.tool_format = parse_tool_calls, echo_only, tool_format
        self.reasoning = reasoning if kind == "chat" else ""
        self._reasoning_streams: dict[int, ReasoningStream] = {}
        self._tool_streams: dict[int, ToolCallStream] = {}
        self.tools = self._tools(0)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id, self.created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"

    def _tools(self, index: int) -> ToolCallStream | None:
        if not self.max_calls:
            return None
        if index not in self._tool_streams:
            self._tool_streams[index] = call_stream(self.tool_format, self.max_calls)
        return self._tool_streams[index]

    # -- whole responses ------------------------------------------------------------------------
    def body(self, deltas: list[StreamDelta], usage: Usage, memo: dict | None = None) -> dict:
        """One choice's response. memo: where a cached response keeps its parsed tool calls (by
        max_calls), so a cache hit does not parse the reply again; each response still gets
        fresh call ids."""
        return self._response([self.choice(0, deltas, memo)], usage)

    def body_of(self, choices: list[Choice], results: list[tuple[list[StreamDelta], dict | None]]) -> dict:
        """Every choice's response: results[i] is (deltas, memo) of choices[i]."""
        bodies = [self.choice(c.index, deltas, memo, c.echo) for c, (deltas, memo) in zip(choices, results)]
        return self._response(bodies, total_usage(choices, sum(self._returned(d) for d, _ in results)))

    def _returned(self, deltas: list[StreamDelta]) -> int:
        return 0 if self.echo_only else sum(len(d.token_ids) for d in deltas)

    def _response(self, choices: list[dict], usage: Usage) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_body(usage)}

    def choice(self, index: int, deltas: list[StreamDelta], memo: dict | None = None,
               echo: Echo | None = None) -> dict:
        output = [] if self.echo_only else deltas
        text = "".join(d.text for d in output)
        finish = deltas[-1].finish_reason if deltas else "abort"
        pairs = self._echo_pairs(echo, deltas) + self._pairs(output)
        choice = {"index": index, "finish_reason": "length" if self.echo_only else finish,
                  "logprobs": self._logprobs(pairs)}
        if self.kind == "chat":
            reasoning, text = split_reasoning(text, self.reasoning == "opened") if self.reasoning else (None, text)
            choice["message"] = {"role": "assistant", "content": text}
            if self.max_calls:
                parsed = memo.get(self.max_calls) if memo is not None else None
                if parsed is None:
                    parsed = split_calls(self.tool_format, text, self.max_calls)
                    if memo is not None:
                        memo[self.max_calls] = parsed
                content, calls = parsed[0], [tool_call(name, args) for name, args in parsed[1]]
                if calls:
                    choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                    choice["finish_reason"] = _tool_finish(finish)
            if reasoning is not None:
                choice["message"]["reasoning_content"] = reasoning
        else:
            choice["text"] = (echo.text if echo is not None else "") + text
        return choice

    # -- streams ----------------------------------------------------------------------------------
    async def stream(self, sub: Subscription, include_usage: bool, continuous_usage: bool = False
                     ) -> AsyncIterator[bytes]:
        async for chunk in self.stream_choices([Choice(0, 0, sub)], include_usage, continuous_usage):
            yield chunk

    async def stream_choices(self, choices: list[Choice], include_usage: bool, continuous_usage: bool = False
                             ) -> AsyncIterator[bytes]:
        """SSE chunks of every choice as they come, then a usage chunk if asked for, then
        [DONE]. An engine error mid-stream is an error event (the status line has gone already).
        continuous_usage: every chunk carries the usage so far (vLLM's continuous_usage_stats)."""
        generated = 0

        def with_usage(chunk: dict) -> dict:
            return {**chunk, "usage": usage_body(total_usage(choices, generated))} if continuous_usage else chunk

        if self.kind == "chat":
            for c in choices:
                yield sse(with_usage(self._chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                  "finish_reason": None})))
        started: set[int] = set()
        try:
            async for c, delta in _merged(choices):
                if c.index not in started:
                    started.add(c.index)
                    if c.echo is not None:
                        # NOTE: on a thread: with prompt logprobs the chunk holds an entry per
                        # top token per prompt position, too much to build on the event loop.
                        yield await asyncio.to_thread(lambda: sse(with_usage(self._echo_chunk(c, delta))))
                generated += 0 if self.echo_only else len(delta.token_ids)
                for chunk in self._delta_chunks(c.index, delta):
                    yield sse(with_usage(chunk))
        except Exception as e:
            yield sse(engine_failure(e).body())
            return
        if include_usage:
            yield sse(self._chunk(None, usage=usage_body(total_usage(choices, generated))))
        yield sse("[DONE]")

    def _delta_chunks(self, index: int, delta: StreamDelta) -> list[dict]:
        if self.echo_only:
            return [self._chunk({"index": index, "text": "", "finish_reason": "length", "logprobs": None})] \
                if delta.finished else []
        if self.reasoning:
            thought, delta = self._reasoning_split(index, delta)
            return thought + self._content_chunks(index, delta)
        return self._content_chunks(index, delta)

    def _reasoning_split(self, index: int, delta: StreamDelta) -> tuple[list[dict], StreamDelta]:
        """The delta's reasoning as reasoning_content chunks, and the delta with its content only."""
        if index not in self._reasoning_streams:
            self._reasoning_streams[index] = ReasoningStream(self.reasoning == "opened")
        stream = self._reasoning_streams[index]
        events = stream.feed(delta.text) + (stream.finish() if delta.finished else [])
        chunks = [self._chunk({"index": index, "delta": {"reasoning_content": text}, "finish_reason": None})
                  for kind, text in events if kind == "reasoning"]
        return chunks, replace(delta, text="".join(text for kind, text in events if kind == "content"))

    def _content_chunks(self, index: int, delta: StreamDelta) -> list[dict]:
        if self.max_calls:
            return self._tool_chunks(delta, index)
        if delta.text or delta.finished:
            return [self._chunk(self._delta_choice(delta, index))]
        return []

    def _echo_chunk(self, c: Choice, first: StreamDelta) -> dict:
        return self._chunk({"index": c.index, "text": c.echo.text, "finish_reason": None,
                            "logprobs": self._logprobs(self._echo_pairs(c.echo, [first]))})

    def _chunk(self, choice: dict | None, usage: dict | None = None) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        choices = [] if choice is None else [{"index": 0, "logprobs": None, **choice}]
        chunk = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    def _delta_choice(self, d: StreamDelta, index: int = 0) -> dict:
        choice = {"index": index, "finish_reason": d.finish_reason if d.finished else None,
                  "logprobs": self._logprobs(self._pairs([d]))}
        if self.kind == "chat":
            choice["delta"] = {"content": d.text} if d.text else {}
        else:
            choice["text"] = d.text
        return choice

    def _tool_chunks(self, d: StreamDelta, index: int = 0) -> list[dict]:
        """Content as it comes, each tool call whole when it closes (OpenAI clients accumulate
        `tool_calls` deltas by index, so one delta per call is a valid stream)."""
        tools = self._tools(index)
        events = tools.feed(d.text) + (tools.finish() if d.finished else [])
        call = tools.num_calls - sum(kind == "call" for kind, _ in events)   # of the first call here
        chunks = []
        for kind, value in events:
            if kind == "content":
                delta = {"content": value}
            else:
                delta, call = {"tool_calls": [{"index": call, **value}]}, call + 1
            chunks.append(self._chunk({"index": index, "delta": delta, "finish_reason": None}))
        if d.finished:
            finish = _tool_finish(d.finish_reason) if tools.num_calls else d.finish_reason
            chunks.append(self._chunk({"index": index, "delta": {}, "finish_reason": finish}))
        return chunks

    # -- logprobs ---------------------------------------------------------------------------------
    @staticmethod
    def _pairs(deltas: list[StreamDelta]) -> list:
        return [(t, lp) for d in deltas for t, lp in zip(d.token_ids, d.logprobs) if lp is not None]

    @staticmethod
    def _echo_pairs(echo: Echo | None, deltas: list[StreamDelta]) -> list:
        """The prompt's (token, logprobs) pairs, the first token's logprobs None (nothing precedes it)."""
        scored = deltas[0].prompt_logprobs if echo is not None and deltas else None
        if scored is None:
            return []
        return [(echo.token_ids[0], None), *zip(echo.token_ids[1:], scored)]

    def _logprobs(self, pairs: list) -> dict | None:
        if not pairs:
            return None
        return self._chat_logprobs(pairs) if self.kind == "chat" else self._completion_logprobs(pairs)

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chat_logprobs(self, pairs) -> dict:
        def entry(token_id, logprob):
            # NOTE: bytes from the token's own bytes, not its text decoded alone (a partial UTF-8
            # character would be U+FFFD's three bytes); clients join them to rebuild the text.
            return {"token": self._token(token_id), "logprob": logprob,
                    "bytes": list(self.tokenizer.token_bytes(token_id))}
        return {"content": [{**entry(t, lp.token_logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                            for t, lp in pairs]}

    def _completion_logprobs(self, pairs) -> dict:
        tokens = [self._token(t) for t, _ in pairs]
        offsets = [0, *itertools.accumulate(len(x) for x in tokens)][:-1]
        return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.token_logprob for _, lp in pairs],
                "top_logprobs": [None if lp is None else {self._token(i): v for i, v in lp.top} for _, lp in pairs],
                "text_offset": offsets}


async def _merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, StreamDelta]]:
    """Every choice's deltas as they come (one choice: its own, without a task)."""
    if len(choices) == 1:
        async for delta in choices[0].sub.deltas():
            yield choices[0], delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice) -> None:
        try:
            async for delta in c.sub.deltas():
                queue.put_nowait((c, delta, None))
            queue.put_nowait((c, None, None))
        except Exception as e:
            queue.put_nowait((c, None, e))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        left = len(choices)
        while left:
            c, delta, error = await queue.get()
            if error is not None:
                raise error
            if delta is None:
                left -= 1
            else:
                yield c, delta
    finally:
        for task in tasks:
            task.cancel()


def _tool_finish(finish: str | None) -> str | None:
    # A reply that ended by itself with calls in it is a tool call; one cut short stays `length`.
    return "tool_calls" if finish == "stop" else finish
