"""A tiny OpenAI-compatible server in this process (Starlette under uvicorn on a loopback thread):
/v1/chat/completions and /v1/completions streaming one word every GAP seconds, or a whole reply
after `whole_delay`; every `refuse_every`-th request refused with 429 + Retry-After. It books
what the load generator's assertions need: arrivals, refusals, streams run to their end, and
streams closed early by a client that hung up."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import uvicorn
from kiln_server import free_port
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

GAP = 0.01


class FakeOpenAI:
    def __init__(self, refuse_every: int = 0, retry_after: str = "1", whole_delay: float = 0.0):
        self.refuse_every, self.retry_after, self.whole_delay = refuse_every, retry_after, whole_delay
        self.arrivals: list[float] = []
        self.refused = self.finished = self.hung_up = 0
        self.app = Starlette(routes=[Route("/v1/chat/completions", self.handle, methods=["POST"]),
                                     Route("/v1/completions", self.handle, methods=["POST"])])

    async def handle(self, request: Request):
        body, chat = await request.json(), request.url.path.endswith("chat/completions")
        self.arrivals.append(time.monotonic())
        if self.refuse_every and len(self.arrivals) % self.refuse_every == 0:
            self.refused += 1
            return JSONResponse({"error": {"message": "busy"}}, 429, headers={"Retry-After": self.retry_after})
        if body.get("stream_options") is not None and not body.get("stream"):    # as vLLM answers it
            return JSONResponse({"error": {"message": "Stream options can only be defined when `stream=True`."}}, 400)
        if not body.get("stream"):
            await asyncio.sleep(self.whole_delay)
            return JSONResponse(_whole(body["max_tokens"], chat))
        return StreamingResponse(self._events(body["max_tokens"], chat), media_type="text/event-stream")

    async def _events(self, n: int, chat: bool):
        done = False
        try:
            for i in range(n):
                await asyncio.sleep(GAP)
                yield _sse(_chunk(chat, [_choice(f"w{i} ", chat, "length" if i == n - 1 else None)]))
            yield _sse(_chunk(chat, [], usage={"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}))
            done = True                     # all sent; the client may close as soon as it reads [DONE]
            yield "data: [DONE]\n\n"
        finally:                            # a client that hung up: Starlette cancels the stream
            self.finished += done
            self.hung_up += not done


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _chunk(chat: bool, choices: list[dict], **more) -> dict:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": "x", "object": kind, "created": 0, "model": "fake", "choices": choices, **more}


def _choice(text: str, chat: bool, finish: str | None) -> dict:
    part = {"delta": {"content": text}} if chat else {"text": text}
    return {"index": 0, "finish_reason": finish, **part}


def _whole(n: int, chat: bool) -> dict:
    text = "".join(f"w{i} " for i in range(n))
    part = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    return {"id": "x", "object": "chat.completion" if chat else "text_completion", "created": 0, "model": "fake",
            "choices": [{"index": 0, "finish_reason": "length", **part}],
            "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}}


class Running:
    """The server on a thread; `url` while it runs, stopped by stop()."""

    def __init__(self, fake: FakeOpenAI):
        self.fake, port = fake, free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(fake.app, host="127.0.0.1", port=port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
