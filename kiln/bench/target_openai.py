"""Any OpenAI-compatible server through the official `openai` client: the requests an application
makes (streamed with usage, or whole replies), its errors turned into the load generator's.

The client never retries (max_retries=0): a retry inside it would hide a refusal, and backing off
after a 429 is the load generator's to do (loadgen.RetryAfter). `openai` is a dev dependency, so it
is imported when a target is made. The timeout is `openai.Timeout`, the class of whichever HTTP
library this release of the client runs on (httpx for 1.x/2.x, httpx2 for 3.x): another library's
Timeout is refused by 3.x.
"""

from __future__ import annotations

from typing import AsyncIterator

from kiln.bench import structured
from kiln.bench.records import Chunk, TargetError
from kiln.bench.text import Prompt
from kiln.bench.workloads import RequestSpec


class OpenAITarget:
    def __init__(self, url: str, model: str, endpoint: str = "chat", temperature: float = 1.0,
                 api_key: str | None = None, ignore_eos: bool = True):
        import openai

        self.name, self.model, self.endpoint, self.temperature = url, model, endpoint, temperature
        self.ignore_eos = ignore_eos
        self.client = openai.AsyncOpenAI(base_url=f"{url.rstrip('/')}/v1", api_key=api_key or "unused",
                                         max_retries=0, timeout=openai.Timeout(None, connect=10.0))

    async def stream(self, prompt: Prompt, spec: RequestSpec) -> AsyncIterator[Chunk]:
        import openai

        try:
            reply = await self._create(prompt, spec)
        except openai.APIStatusError as e:
            raise TargetError.refusal(e.status_code, e.message, e.response.headers.get("retry-after")) from None
        if not spec.stream:
            yield _whole(reply)
            return
        async with reply as events:            # leaving early closes the connection: a hang-up
            yield Chunk(status=200)
            async for event in events:
                yield _event(event)

    async def close(self) -> None:
        await self.client.close()

    def _create(self, prompt: Prompt, spec: RequestSpec):
        endpoint = spec.endpoint or self.endpoint
        kw = dict(model=self.model, max_tokens=spec.max_tokens, temperature=self.temperature,
                  extra_body=self._extra_body(spec, endpoint) or None)
        if spec.stream:
            kw.update(stream=True, stream_options={"include_usage": True})
        if endpoint == "chat":
            return self.client.chat.completions.create(messages=prompt.as_messages(), **kw)
        return self.client.completions.create(prompt=prompt.as_text(), **kw)

    def _extra_body(self, spec: RequestSpec, endpoint: str) -> dict:
        extra = {"ignore_eos": True} if self.ignore_eos else {}
        return extra | structured.http_fields(endpoint) if spec.json_schema else extra


def _text(choice) -> str:
    """A completion choice's text, a chat chunk's delta or a chat reply's message."""
    if hasattr(choice, "text"):
        return choice.text or ""
    part = choice.delta if hasattr(choice, "delta") else choice.message
    return (part.content if part else None) or ""


def _event(event) -> Chunk:
    usage = event.usage.completion_tokens if event.usage else None
    if not event.choices:
        return Chunk(usage_tokens=usage)
    choice = event.choices[0]
    return Chunk(text=_text(choice), usage_tokens=usage, finish_reason=choice.finish_reason)


def _whole(reply) -> Chunk:
    choice = reply.choices[0]
    usage = reply.usage.completion_tokens if reply.usage else None
    return Chunk(text=_text(choice), usage_tokens=usage, status=200, finish_reason=choice.finish_reason)
