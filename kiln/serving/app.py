"""The Starlette app: OpenAI endpoints, /health, /ready and /metrics over one EngineClient."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from functools import partial

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kiln.config import ServeConfig
from kiln.runtime.engine_client import EngineClient, EngineError
from kiln.runtime.sampling_params import SamplingParams
from kiln.serving.admission import Admission
from kiln.serving.console import console_routes
from kiln.serving.errors import ApiError, bad_request
from kiln.serving.generations import Generations
from kiln.serving.http_io import EventStream, check_api_key, read_json, until_disconnected
from kiln.serving.metrics import ServerMetrics
from kiln.serving.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from kiln.serving.requests import EngineLimits, prepare_chat, prepare_completion
from kiln.serving.response_cache import ResponseCache
from kiln.serving.responses import Renderer

log = logging.getLogger("kiln.serving")

WARM_UP_PROMPT_TOKENS = 256
ENDPOINTS = {"completion": (CompletionRequest, prepare_completion), "chat": (ChatCompletionRequest, prepare_chat)}


class Server:
    """What the endpoints share. The engine client starts with the app; ready after warm-up."""

    def __init__(self, llm, config: ServeConfig, model_name: str):
        self.llm, self.config, self.model_name = llm, config, model_name
        self.metrics = ServerMetrics()
        self.ready = False
        self.client: EngineClient = llm.client
        self.limits = EngineLimits.of(self.client.snapshot, llm.artifact.manifest)
        self.generations: Generations | None = None

    def start(self) -> None:
        c = self.config
        self.client.step_listeners.append(self.metrics.observe_step)
        self.client.publish_prefix_cache()        # admission asks the snapshot's prefix-cache view
        admission = Admission(c, self.client)
        cache = ResponseCache(c.cache_max_entries, c.cache_max_bytes, c.cache_ttl) if c.response_cache else None
        self.generations = Generations(self.client, admission, self.metrics, cache, c.request_timeout)
        self.metrics.watch(self.client, admission, self.generations)

    async def warm_up(self) -> None:
        """One small request through the whole path, so the first user does not pay for it and
        admission control predicts TTFT from a measured prefill rate, not only its prior."""
        ids = (self.llm.tokenizer.encode("Hello world. ") or [0]) * WARM_UP_PROMPT_TOKENS
        ids = ids[:min(WARM_UP_PROMPT_TOKENS, self.limits.max_model_len - 2)]
        request = self.client.make_request(ids, SamplingParams(max_tokens=1, temperature=0), "kiln-warmup")
        async for _ in self.client.stream(request):
            pass
        self.ready = True
        log.info("ready: serving %s", self.model_name)

    def stop(self) -> None:
        self.client.shutdown()
        log.info("stopped: the engine thread has exited")

    def rejected(self, e: ApiError) -> Response:
        reason = {429: e.code, 401: "unauthorized", 503: "not_ready"}.get(e.status, "invalid")
        self.metrics.rejected.labels(reason or "unknown").inc()
        return e.response()

    def check(self, request: HttpRequest) -> None:
        if not self.ready:
            raise ApiError(503, "the engine is still loading; poll /ready", code="not_ready")
        check_api_key(request, self.config.api_key)


def create_app(llm, config: ServeConfig, model_name: str) -> Starlette:
    server = Server(llm, config, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.start()
        warm = asyncio.create_task(server.warm_up())
        warm.add_done_callback(_report_warm_up)
        try:
            yield
        finally:
            warm.cancel()
            server.stop()

    routes = [
        Route("/health", _health),
        Route("/ready", partial(_ready, server)),
        Route("/metrics", partial(_metrics, server)),
        Route("/v1/models", partial(_models, server)),
        Route("/v1/completions", partial(_generate, server, kind="completion"), methods=["POST"]),
        Route("/v1/chat/completions", partial(_generate, server, kind="chat"), methods=["POST"]),
        *console_routes(server),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={Exception: _internal_error})
    app.state.server = server
    return app


def _report_warm_up(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("warm-up failed; /ready stays 503", exc_info=task.exception())


async def _health(request: HttpRequest) -> Response:
    return JSONResponse({"status": "ok"})


async def _ready(server: Server, request: HttpRequest) -> Response:
    if server.ready:
        return JSONResponse({"status": "ready", "model": server.model_name})
    return JSONResponse({"status": "loading"}, status_code=503)


async def _metrics(server: Server, request: HttpRequest) -> Response:
    return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _models(server: Server, request: HttpRequest) -> Response:
    try:
        server.check(request)
    except ApiError as e:
        return server.rejected(e)
    card = {"id": server.model_name, "object": "model", "created": int(time.time()), "owned_by": "kiln",
            "max_model_len": server.limits.max_model_len}
    return JSONResponse({"object": "list", "data": [card]})


async def _generate(server: Server, request: HttpRequest, kind: str) -> Response:
    try:
        prepared = await _prepare(server, request, kind)
        sub = server.generations.open(prepared)
    except ApiError as e:
        return server.rejected(e)
    renderer = Renderer(kind, server.model_name, server.llm.tokenizer, prepared.parse_tool_calls)
    if prepared.stream:
        return EventStream(renderer.stream(sub, prepared.include_usage), on_close=sub.close)
    try:
        finished, deltas = await until_disconnected(request.receive, _collect(sub))
    except ValueError as e:          # the engine refused it (a limit the checks above missed)
        return server.rejected(bad_request(str(e)))
    except EngineError as e:         # the engine failed mid-step; it serves the next request
        return ApiError(500, str(e), code="engine_error").response()
    finally:
        sub.close()
    if not finished:
        return Response(status_code=499)       # nobody is there to read it
    return JSONResponse(renderer.body(deltas, sub.usage))


async def _prepare(server: Server, request: HttpRequest, kind: str):
    server.check(request)
    model_cls, prepare = ENDPOINTS[kind]
    body = parse_body(model_cls, await read_json(request, server.config.max_body_bytes))
    if body.model is not None and body.model != server.model_name:
        raise ApiError(404, f"the model '{body.model}' does not exist; this server serves "
                       f"'{server.model_name}'", "model", "model_not_found")
    return prepare(body, server.llm.tokenizer, server.limits)


async def _collect(sub) -> list:
    return [delta async for delta in sub.deltas()]


async def _internal_error(request, exc) -> Response:
    log.exception("unhandled error", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}").response()
