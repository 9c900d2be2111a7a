"""HTTP plumbing the endpoints share: a size-capped JSON body, bearer-token checks, and work that
is cancelled the moment its client disconnects (whatever ASGI spec version the server speaks)."""

from __future__ import annotations

import asyncio
import hmac
import json
import math
from typing import Awaitable, Callable, TypeVar

from starlette.requests import Request as HttpRequest
from starlette.responses import StreamingResponse

from kiln.serving.errors import ApiError, bad_request

T = TypeVar("T")

MAX_JSON_DEPTH = 64      # a JSON Schema or a tool's parameters nest a few levels; nothing needs more


async def read_json(request: HttpRequest, max_bytes: int):
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
    try:
        data = json.loads(body, parse_constant=_refuse_constant)
    except ValueError as e:          # JSONDecodeError, UnicodeDecodeError and NaN / Infinity
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise _too_deep() from None
    check_json_values(data)
    return data


def _refuse_constant(name: str):
    # Python's json accepts NaN and Infinity by default; JSON (RFC 8259) has no such numbers.
    raise ValueError(f"{name} is not a JSON number")


def check_json_values(data) -> None:
    """Refuse what json.loads lets through: nesting deeper than MAX_JSON_DEPTH, numbers that
    overflow to infinity (1e999) and strings with unpaired surrogates ("\\ud800"), which no
    tokenizer can encode. Iterative, so a hostile body cannot exhaust the stack here."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key)
                stack.append((item, depth + 1))
        elif isinstance(value, str):
            _check_text(value)
        elif isinstance(value, float) and not math.isfinite(value):
            raise bad_request("the request body has a number too large for a double", code="invalid_json")


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("the request body has a string that is not valid Unicode "
                          "(an unpaired surrogate escape such as \\ud800)", code="invalid_json") from None


def _too_deep() -> ApiError:
    return bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body exceeds {max_bytes} bytes", code="request_too_large")


def check_api_key(request: HttpRequest, api_key: str | None) -> None:
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # NOTE: constant-time comparison, so the key cannot be guessed byte by byte from timings.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError(401, "a valid API key is needed: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


async def until_disconnected(receive, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run `work`; if the client disconnects first, cancel it. Returns (finished, result)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(receive))
    finished = False
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finished = task.done()
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    return (True, task.result()) if finished else (False, None)


async def _disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """text/event-stream that stops the moment its client disconnects and then always calls
    on_close, even if the stream never started."""

    def __init__(self, content, on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await until_disconnected(receive, self.stream_response(send))
        except OSError:
            pass                      # the socket went away mid-write: the same as a disconnect
        finally:
            self.on_close()
