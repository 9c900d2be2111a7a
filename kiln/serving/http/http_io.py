"""HTTP plumbing the endpoints share: a size-capped JSON body, bearer-token checks, and work that
is cancelled the moment its client disconnects (whatever ASGI spec version the server speaks)."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
from typing import Awaitable, Callable, TypeVar

from starlette.requests import Request as HttpRequest
from starlette.responses import StreamingResponse

from kiln.serving.http.errors import ApiError, bad_request

T = TypeVar("T")
log = logging.getLogger("kiln.serving")

MAX_JSON_DEPTH = 64      # a JSON Schema or a tool's parameters nest a few levels; nothing needs more


async def read_json(request: HttpRequest, max_bytes: int):
    return decode_body(await read_body(request, max_bytes))


async def read_body(request: HttpRequest, max_bytes: int) -> bytes:
    """The body's bytes, refused (413) past max_bytes before more are read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
    return bytes(body)


def decode_body(body: bytes):
    """The body's JSON, checked (CPU work: the server runs it off the event loop)."""
    try:
        data = json.loads(body, parse_constant=_refuse_constant)
    except ValueError as e:          # JSONDecodeError, UnicodeDecodeError and NaN / Infinity
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise _too_deep() from None
    check_json_values(data)
    return data


def decode_json(text: str, what: str, param: str | None = None):
    """A JSON document sent inside a string field, held to the body's rules (depth, numbers,
    Unicode): 400 naming `param` rather than a RecursionError deep in a decoder."""
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise _too_deep(what, param) from None
    except ValueError as e:
        raise bad_request(f"{what} is not valid JSON: {e}", param, "invalid_json") from None
    try:
        check_json_values(data)
    except ApiError as e:
        raise bad_request(f"{what}: {e.message}", param, e.code) from None
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


def _too_deep(what: str = "the request body", param: str | None = None) -> ApiError:
    return bad_request(f"{what} nests deeper than {MAX_JSON_DEPTH} levels", param, "invalid_json")


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body exceeds {max_bytes} bytes", code="request_too_large")


def keyed_endpoint(config, path: str, endpoint, rejected: Callable[[ApiError], object] = ApiError.response):
    """`endpoint` behind the API key (when config sets one) unless config.public_endpoints names
    `path`; a refusal is answered by `rejected` (kiln serve counts it in its metrics). config is a
    ServeConfig: kiln serve's server and the Ray ingress key their endpoints the same way."""
    if path in config.public_endpoints:
        return endpoint

    async def checked(request: HttpRequest):
        try:
            check_api_key(request, config.api_key, config.api_keys)
        except ApiError as e:
            return rejected(e)
        return await endpoint(request)
    return checked


def check_api_key(request: HttpRequest, api_key: str | None,
                  api_keys: tuple[tuple[str, str], ...] = ()) -> str | None:
    """The name of the caller's key (None when no key is configured); 401 without a valid one.
    api_key is the single shared key (named "default"); api_keys are (name, key) pairs."""
    keys = ((("default", api_key),) if api_key is not None else ()) + tuple(api_keys)
    if not keys:
        return None
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    sent = token.strip().encode()
    found = None
    for name, key in keys:
        # NOTE: constant-time comparison, every key compared, so timings tell nothing of any key.
        if hmac.compare_digest(sent, key.encode()) and found is None:
            found = name
    if scheme.lower() != "bearer" or found is None:
        raise ApiError(401, "a valid API key is needed: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")
    return found


def read_api_key_file(path) -> tuple[tuple[str, str], ...]:
    """`name key [priority=LOW:HIGH]` lines (blank lines and # comments skipped) -> ((name, key), ...)."""
    return tuple((name, key) for name, key, _ in _api_key_lines(path))


def read_api_key_grants(path) -> tuple[tuple[str, int, int], ...]:
    """The priority ranges an --api-key-file grants: ((name, lowest, highest), ...) for the keys
    whose line ends with `priority=LOW:HIGH`."""
    return tuple((name, *grant) for name, _, grant in _api_key_lines(path) if grant is not None)


def _api_key_lines(path):
    from pathlib import Path

    lines, names, seen = [], set(), set()
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) not in (2, 3):
            raise ValueError(f"{path}:{number}: expected 'name key [priority=LOW:HIGH]', got {len(parts)} fields")
        name, key = parts[:2]
        if name in names or key in seen:
            raise ValueError(f"{path}:{number}: the name or key is given twice")
        names.add(name), seen.add(key)
        lines.append((name, key, _priority_grant(parts[2], f"{path}:{number}") if len(parts) == 3 else None))
    if not lines:
        raise ValueError(f"{path} holds no 'name key' lines")
    return lines


def _priority_grant(field: str, where: str) -> tuple[int, int]:
    """`priority=LOW:HIGH` -> (LOW, HIGH): the `priority` values the key may send."""
    name, _, value = field.partition("=")
    low, _, high = value.partition(":")
    try:
        grant = int(low), int(high)
    except ValueError:
        grant = None
    if name != "priority" or grant is None or grant[0] > grant[1] or max(map(abs, grant)) > 1 << 31:
        raise ValueError(f"{where}: the third field must be priority=LOW:HIGH (integers, LOW <= HIGH), "
                         f"got {field!r}")
    return grant


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def allowed_host_names(bind_host: str, allowed: tuple[str, ...] | None) -> frozenset[str] | None:
    """The Host header names served (None: any). Default: the loopback names when bound to a
    loopback address (a web page's DNS-rebinding name is refused), any name otherwise."""
    if allowed is not None:
        return None if "*" in allowed else frozenset(h.lower() for h in allowed)
    return frozenset((*LOOPBACK_HOSTS, bind_host)) if is_loopback(bind_host) else None


def _host_name(header: str) -> str:
    header = header.strip().lower()
    if header.startswith("["):                       # [::1]:8000
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class RequestGuard:
    """ASGI middleware: a Host allow-list (421 otherwise) and JSON-only POST bodies (415), so a
    web page cannot drive a local server with a form or a text/plain fetch."""

    def __init__(self, app, hosts: frozenset[str] | None):
        self.app, self.hosts = app, hosts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            error = None
            if self.hosts is not None and _host_name(headers.get("host", "")) not in self.hosts:
                error = ApiError(421, "this server does not answer to that Host name (see --allowed-hosts)",
                                 code="host_not_allowed")
            elif scope["method"] == "POST":
                media = headers.get("content-type", "").split(";")[0].strip().lower()
                if media != "application/json":
                    error = ApiError(415, "POST bodies must be JSON: send 'Content-Type: application/json'",
                                     code="unsupported_media_type")
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


IGNORED_FIELDS_HEADER = "X-Kiln-Ignored-Fields"
_warned_fields: set[str] = set()
MAX_WARNED_FIELDS = 1024


def ignored_fields_header(fields: tuple[str, ...]) -> dict[str, str]:
    """The response header naming the unknown body fields a request's answer ignored; each name
    is logged once at warning (then at debug: a benchmark sends the same field every request)."""
    if not fields:
        return {}
    new = [f for f in fields if f not in _warned_fields]
    if len(_warned_fields) < MAX_WARNED_FIELDS:          # a client inventing names cannot grow it
        _warned_fields.update(new)
    level = logging.WARNING if new else logging.DEBUG
    safe = [_header_safe(f) for f in fields]              # no newline reaches the log either
    log.log(level, "ignored unknown request fields: %s (--strict-api refuses them)", ", ".join(safe))
    # NOTE: a field name is any JSON string; a header value may hold only visible ASCII and
    # spaces (h11 drops the connection otherwise), so everything else is escaped.
    return {IGNORED_FIELDS_HEADER: ",".join(safe)[:1024]}


def _header_safe(name: str) -> str:
    return "".join(c if " " <= c <= "~" and c != "," else f"\\u{ord(c):04x}" for c in name)


def json_bytes(body) -> bytes:
    """A response body as JSONResponse writes it (CPU work for a large body: off the loop)."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


def rendered_json(render: Callable, *args) -> bytes:
    """render(*args) as JSON bytes: a body built and written in one call on a worker thread."""
    return json_bytes(render(*args))


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

    def __init__(self, content, on_close: Callable[[], None], headers: dict[str, str] | None = None):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self.on_close = on_close

    def add_on_close(self, fn: Callable[[], None]) -> None:
        """Call fn too when the stream ends."""
        first = self.on_close

        def both() -> None:
            try:
                first()
            finally:
                fn()
        self.on_close = both

    async def __call__(self, scope, receive, send) -> None:
        try:
            await until_disconnected(receive, self.stream_response(send))
        except OSError:
            pass                      # the socket went away mid-write: the same as a disconnect
        finally:
            self.on_close()
