"""Any OpenAI-compatible server, measured from the client: completions or chat completions over
httpx, raw SSE (`stream_options.include_usage`, so token counts are the server's) or whole replies.
A refusal is a TargetError with its status and Retry-After; a stream must end with data: [DONE]."""

from __future__ import annotations

import ipaddress
import json
from typing import AsyncIterator
from urllib.parse import urlsplit

import httpx

from kiln.bench import structured
from kiln.bench.records import Chunk, TargetError
from kiln.bench.text import Prompt, RatioCounter, TokenCounter, corpus_words, exact_counter
from kiln.bench.workloads import RequestSpec

CALIBRATION_CHARS = 2000
DEFAULT_CONTEXT = 2048

__all__ = ["HttpTarget", "TargetError", "check_loopback"]


def check_loopback(url: str) -> None:
    """The load generator is for one's own servers: refuse another host unless told otherwise."""
    host = urlsplit(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"{url} is not a loopback address; pass --allow-remote to load another host")


def _cut_chars(words, max_chars: int) -> str:
    text = ""
    for word in words:
        if len(text) + len(word) + 1 > max_chars:
            return text
        text = f"{text} {word}" if text else word
    return text


class HttpTarget:
    def __init__(self, url: str, endpoint: str = "chat", model: str | None = None, temperature: float = 1.0,
                 api_key: str | None = None, ignore_eos: bool = True):
        self.url, self.endpoint, self.model, self.temperature = url.rstrip("/"), endpoint, model, temperature
        self.ignore_eos = ignore_eos
        self.name = url
        self.context_len = DEFAULT_CONTEXT
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No connection cap and no pool timeout: a queue inside the client would pass for server latency.
        self.client = httpx.AsyncClient(base_url=self.url, headers=headers,
                                        timeout=httpx.Timeout(None, connect=10.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    def path(self, endpoint: str | None = None) -> str:
        return "/v1/chat/completions" if (endpoint or self.endpoint) == "chat" else "/v1/completions"

    async def discover(self) -> None:
        """The served model's id and context length from /v1/models (vLLM and kiln report max_model_len)."""
        r = await self.client.get("/v1/models")
        if r.status_code != 200:
            raise TargetError(f"GET {self.url}/v1/models answered {r.status_code}: {r.text[:200]}")
        card = r.json()["data"][0]
        self.model = self.model or card["id"]
        self.context_len = int(card.get("max_model_len") or DEFAULT_CONTEXT)

    async def prepare(self, tokenizer_dir: str | None = None) -> TokenCounter:
        """Model id and context from the server; exact counts from a local tokenizer when given,
        otherwise a ratio calibrated on the server (either way a first request warms it up)."""
        await self.discover()
        counter = await self.calibrate()
        if tokenizer_dir is None:
            return counter
        return exact_counter(tokenizer_dir)

    def observer(self, interval: float):
        from kiln.bench.observe import MetricsObserver

        return MetricsObserver(self.metrics_text, interval)

    async def calibrate(self) -> RatioCounter:
        """Characters per token from the server's usage count of a corpus sample (also a warm-up)."""
        # NOTE: at most half the context in characters fits even a byte-level tokenizer.
        text = _cut_chars(corpus_words(), min(CALIBRATION_CHARS, self.context_len // 2))
        body = _unstreamed(self._body(Prompt(None, text), max_tokens=1))
        r = await self.client.post(self.path(), json=body)
        if r.status_code != 200:
            raise TargetError(f"calibration request answered {r.status_code}: {r.text[:200]}")
        return RatioCounter(len(text) / r.json()["usage"]["prompt_tokens"])

    async def stream(self, prompt: Prompt, spec: RequestSpec) -> AsyncIterator[Chunk]:
        body = self._request_body(prompt, spec)
        if not spec.stream:
            yield await self._whole(spec, body)
            return
        async with self.client.stream("POST", self.path(spec.endpoint), json=body) as r:
            if r.status_code != 200:
                raise TargetError.refusal(r.status_code, (await r.aread()).decode(errors="replace"),
                                          r.headers.get("retry-after"))
            yield Chunk(status=r.status_code)
            async for line in r.aiter_lines():
                data = line[5:].strip() if line.startswith("data:") else None
                if data == "[DONE]":
                    return
                if data is not None:
                    yield self._chunk(json.loads(data))
        raise TargetError("the stream ended before data: [DONE]")

    async def _whole(self, spec: RequestSpec, body: dict) -> Chunk:
        r = await self.client.post(self.path(spec.endpoint), json=body)
        if r.status_code != 200:
            raise TargetError.refusal(r.status_code, r.text, r.headers.get("retry-after"))
        reply = r.json()
        choice = reply["choices"][0]
        text = choice.get("text") or (choice.get("message") or {}).get("content") or ""
        return Chunk(text=text, usage_tokens=(reply.get("usage") or {}).get("completion_tokens"),
                     status=r.status_code, finish_reason=choice.get("finish_reason"))

    async def metrics_text(self) -> str | None:
        try:
            r = await self.client.get("/metrics")
        except httpx.HTTPError:
            return None
        return r.text if r.status_code == 200 else None

    async def close(self) -> None:
        await self.client.aclose()

    def _request_body(self, prompt: Prompt, spec: RequestSpec) -> dict:
        endpoint = spec.endpoint or self.endpoint
        body = self._body(prompt, spec.max_tokens, endpoint)
        if not spec.stream:
            body = _unstreamed(body)
        return body | structured.http_fields(endpoint) if spec.json_schema else body

    def _body(self, prompt: Prompt, max_tokens: int, endpoint: str | None = None) -> dict:
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": self.temperature,
                "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            # vLLM's and kiln's extension (others ignore it): reply lengths stay the workload's.
            body["ignore_eos"] = True
        if (endpoint or self.endpoint) == "chat":
            return {**body, "messages": prompt.as_messages()}
        return {**body, "prompt": prompt.as_text()}

    def _chunk(self, obj: dict) -> Chunk:
        if "error" in obj:
            raise TargetError(f"error event: {obj['error'].get('message', obj['error'])}")
        usage = (obj.get("usage") or {}).get("completion_tokens")
        choices = obj.get("choices") or [{}]
        text = choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""
        return Chunk(text=text, usage_tokens=usage, finish_reason=choices[0].get("finish_reason"))


def _unstreamed(body: dict) -> dict:
    """A body asking for the whole reply: no stream_options, which vLLM refuses without stream."""
    return {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
