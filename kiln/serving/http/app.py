"""The Starlette app: OpenAI endpoints, /health, /ready and /metrics over one EngineClient."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kiln.config import ServeConfig
from kiln.runtime.engine_client import EngineClient, EngineError
from kiln.runtime.sampling_params import SamplingParams
from kiln.serving.traffic.admission import Admission
from kiln.serving.console import console_routes
from kiln.serving.http.errors import ApiError, bad_request, engine_failure
from kiln.serving.http.choices import generate_choices
from kiln.serving.traffic.generations import Generations
from kiln.serving.http.http_io import (EventStream, RequestGuard, allowed_host_names, check_api_key, decode_body,
                                  ignored_fields_header, keyed_endpoint, read_body, rendered_json,
                                  until_disconnected)
from kiln.serving.http.metrics import ServerMetrics
from kiln.serving.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from kiln.serving.traffic.key_budget import KeyBudget
from kiln.serving.openai.requests import (DEFAULT_PRIORITY_RANGE, EngineLimits, RequestOptions, prepare_chat,
                                   prepare_completion)
from kiln.serving.cache.response_cache import ResponseCache
from kiln.serving.openai.responses import Renderer
from kiln.serving.http.utility_routes import utility_routes
from kiln.serving.cache.semantic_requests import load_semantic_responses

log = logging.getLogger("kiln.serving")

# NOTE: short: the warm-up pays the engine's one-time first-call cost (OpenVINO prepares its
# kernels: ~0.17 s on SmolLM2), which does not grow with the prompt, while the prompt's own prefill
# does and delays /ready (256 tokens made a cold start ~0.17 s longer than 64). A first long prompt
# afterwards pays a few hundredths of a second more for its new shapes.
WARM_UP_PROMPT_TOKENS = 64
# Request preparation (JSON decoding, template rendering, tokenizing, grammar compiling) and
# tool-call parsing run on this many worker threads, never on the event loop: /health and the
# streams in flight keep being served while a huge prompt is refused.
PREPARE_WORKERS = 2
# Requests being prepared or queued for a worker: each holds its body (up to --max-body-size), so
# past this many, or past this many bytes of bodies held, a request is refused at once (429,
# Retry-After) rather than queued, and a few clients sending costly bodies cannot hold preparation
# up for everyone or grow memory unbounded. NOTE: bytes bound the memory; a small count bound
# alone refused a crowd of chat clients whose small bodies the workers prepare at once.
MAX_PREPARING = 256
MAX_PREPARING_BYTES = 64 << 20
ENDPOINTS = {"completion": (CompletionRequest, prepare_completion), "chat": (ChatCompletionRequest, prepare_chat)}


class Server:
    """What the endpoints share. The engine client starts with the app; ready after warm-up."""

    def __init__(self, llm, config: ServeConfig, model_name: str):
        self.llm, self.config, self.model_name = llm, config, model_name
        self.metrics = ServerMetrics()
        self.ready = False
        self.client: EngineClient = llm.client
        if config.chat_template is not None:
            llm.tokenizer.set_chat_template(config.chat_template.read_text(encoding="utf-8"))
        self.limits = EngineLimits.of(self.client.snapshot, llm.artifact.manifest)
        self.generations: Generations | None = None
        # --semantic-cache: loaded before serving, so a missing embedding model stops kiln serve
        self.semantic = load_semantic_responses(config.semantic_cache) if config.semantic_cache.enabled else None
        if self.semantic is not None:
            self.metrics.registry.register(self.semantic)
        self.workers = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="kiln-prepare")
        self.num_preparing = 0           # requests inside preparing() (event-loop thread only)
        self.preparing_bytes = 0         # and the bytes of their bodies
        self.key_budget = KeyBudget(None if config.max_key_contexts is None else
                                    config.max_key_contexts * min(self.limits.max_model_len, self.limits.kv_tokens))
        self._priorities = {name: (low, high) for name, low, high in config.key_priorities}

    def start(self) -> None:
        c = self.config
        self.client.step_timeout = c.step_timeout   # the engine watchdog (docs/serving.md, Limits and faults)
        self.client.step_listeners.append(self.metrics.observe_step)
        self.client.publish_prefix_cache()        # admission asks the snapshot's prefix-cache view
        admission = Admission(c.admission, self.client)
        rc = c.response_cache
        cache = ResponseCache(rc.max_entries, rc.max_bytes, rc.ttl) if rc.enabled else None
        self.generations = Generations(self.client, admission, self.metrics, cache, c.request_timeout)
        self.metrics.watch(self.client, admission, self.generations)

    async def warm_up(self) -> None:
        """The warm-up requests through the whole path, one after the other (warm_up_requests);
        ready after the first, so the measured second costs no start-up time (until it ends,
        about a step later, admission predicts from its prior)."""
        for request in warm_up_requests(self.llm, self.limits.max_model_len):
            async for _ in self.client.stream(request):
                pass
            if not self.ready:
                self.ready = True
                log.info("ready: serving %s", self.model_name)

    def stop(self) -> None:
        self.workers.shutdown(wait=False, cancel_futures=True)
        self.client.shutdown()
        log.info("stopped: the engine has shut down")

    def rejected(self, e: ApiError) -> Response:
        reason = {429: e.code, 401: "unauthorized", 503: "not_ready"}.get(e.status, "invalid")
        self.metrics.rejected.labels(reason or "unknown").inc()
        return e.response()

    def check(self, request: HttpRequest) -> str | None:
        """The caller's API key name (None: no keys configured)."""
        if self.client.fault is not None:
            raise ApiError(503, f"the engine has faulted: {self.client.fault}", code="engine_fault")
        if not self.ready:
            raise ApiError(503, "the engine is still loading; poll /ready", code="not_ready")
        return check_api_key(request, self.config.api_key, self.config.api_keys)

    def options(self, key_name: str | None) -> RequestOptions:
        salt = f"api-key:{key_name}" if key_name is not None and self.config.per_key_cache_salt else None
        return RequestOptions(self.config.allow_control_tokens_in_messages, salt, self.config.strict_api,
                              self.config.tool_call_parser, self._priorities.get(key_name, DEFAULT_PRIORITY_RANGE))

    def keyed(self, path: str, endpoint):
        """The endpoint behind the API key (when one is set) unless --public-endpoints names it."""
        return keyed_endpoint(self.config, path, endpoint, self.rejected)

    @contextlib.contextmanager
    def preparing(self, num_bytes: int = 0):
        """A request's place in preparation (its body `num_bytes` long), or ApiError(429) when
        MAX_PREPARING hold one or their bodies would pass MAX_PREPARING_BYTES (one body alone
        always has a place: --max-body-size bounds it)."""
        if self.num_preparing >= MAX_PREPARING or \
                (self.num_preparing and self.preparing_bytes + num_bytes > MAX_PREPARING_BYTES):
            raise ApiError(429, f"server busy: {self.num_preparing} requests ({self.preparing_bytes} bytes) are "
                           f"being prepared (max {MAX_PREPARING}, {MAX_PREPARING_BYTES} bytes); retry in 1 s",
                           code="prepare_queue_full", headers={"Retry-After": "1"})
        self.num_preparing += 1
        self.preparing_bytes += num_bytes
        try:
            yield
        finally:
            self.num_preparing -= 1
            self.preparing_bytes -= num_bytes

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.workers, partial(fn, *args))


def warm_up_requests(llm, max_model_len: int) -> list:
    """Two small requests, so the first user does not pay for the path's first call and admission
    predicts TTFT from a measured prefill rate, not only its prior. NOTE: two, with different
    texts (no prefix-cache hit): the engine's first step pays one-off costs and teaches the
    step-cost model nothing (Scheduler.observe_step); the second is measured."""
    requests = []
    for i, text in enumerate(("Hello world. ", "Good morning. ")):
        ids = (llm.tokenizer.encode(text) or [i]) * WARM_UP_PROMPT_TOKENS
        ids = ids[:min(WARM_UP_PROMPT_TOKENS, max_model_len - 2)]
        requests.append(llm.make_request(ids, SamplingParams(max_tokens=1, temperature=0), f"kiln-warmup-{i}"))
    return requests


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
        Route("/health", server.keyed("/health", partial(_health, server))),
        Route("/ready", server.keyed("/ready", partial(_ready, server))),
        Route("/metrics", server.keyed("/metrics", partial(_metrics, server))),
        Route("/v1/models", partial(_models, server)),
        Route("/v1/completions", partial(_generate, server, kind="completion"), methods=["POST"]),
        Route("/v1/chat/completions", partial(_generate, server, kind="chat"), methods=["POST"]),
        *utility_routes(server),
        *console_routes(server),
    ]
    middleware = [Middleware(RequestGuard, hosts=allowed_host_names(config.host, config.allowed_hosts))]
    if config.cors_origins:
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=list(config.cors_origins),
                                        allow_methods=["GET", "POST"], allow_headers=["*"]))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={Exception: _internal_error})
    app.state.server = server
    return app


def _report_warm_up(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("warm-up failed; /ready stays 503", exc_info=task.exception())


async def _health(server: Server, request: HttpRequest) -> Response:
    """Liveness: 503 once the engine loop has faulted (it died, or a step got stuck), so that an
    orchestrator replaces the process; the loop is never restarted (engine_client.py says why)."""
    if server.client.fault is not None:
        return JSONResponse({"status": "faulted", "reason": server.client.fault}, status_code=503)
    return JSONResponse({"status": "ok"})


async def _ready(server: Server, request: HttpRequest) -> Response:
    if server.client.fault is not None:
        return JSONResponse({"status": "faulted", "reason": server.client.fault}, status_code=503)
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
    """The request's answer, its tokens reserved against its key's budget until the answer ends
    (a stream's last byte, or the whole body)."""
    try:
        key_name, prepared, semantic = await _prepare(server, request, kind)
        release = server.key_budget.charge(key_name, prepared.reserved_tokens)
    except ApiError as e:
        return server.rejected(e)
    response = None
    try:
        response = await _answer(server, request, kind, prepared, semantic)
        return response
    finally:
        if isinstance(response, EventStream):
            response.add_on_close(release)
        else:
            release()


async def _answer(server: Server, request: HttpRequest, kind: str, prepared, semantic) -> Response:
    try:
        if prepared.n > 1 or prepared.more_prompts or prepared.echo:
            return await generate_choices(server, request, kind, prepared)
        sub = server.semantic.open(server.generations, prepared, semantic) if semantic else \
            server.generations.open(prepared)
    except ApiError as e:
        return server.rejected(e)
    renderer = Renderer(kind, server.model_name, server.llm.tokenizer, prepared.parse_tool_calls,
                        tool_format=prepared.tool_format, reasoning=prepared.reasoning)
    headers = ignored_fields_header(prepared.ignored_fields)
    if getattr(sub, "cache_kind", None):
        headers = {**headers, "X-Cache": sub.cache_kind}
    if prepared.stream:
        return EventStream(renderer.stream(sub, prepared.include_usage, prepared.continuous_usage),
                           on_close=sub.close, headers=headers)
    try:
        finished, deltas = await until_disconnected(request.receive, _collect(sub))
        if finished:
            args = (renderer.body, deltas, sub.usage, getattr(sub.source, "parsed", None))
            body = await server.off_loop(rendered_json, *args) if prepared.heavy_body else rendered_json(*args)
    except ValueError as e:          # the engine refused it (a limit the checks above missed)
        return server.rejected(bad_request(str(e)))
    except EngineError as e:         # the engine failed mid-step; it serves the next request
        return engine_failure(e).response()
    finally:
        sub.close()
    if not finished:
        return Response(status_code=499)       # nobody is there to read it
    return Response(body, media_type="application/json", headers=headers)


async def _prepare(server: Server, request: HttpRequest, kind: str):
    key_name = server.check(request)
    raw = await read_body(request, server.config.max_body_bytes)
    options = server.options(key_name)
    with server.preparing(len(raw)):
        prepared = await server.off_loop(_prepare_body, server, kind, raw, options)
        semantic = None
        if server.semantic is not None:           # embedding is CPU work: off the loop too
            bypass = "no-cache" in request.headers.get("cache-control", "").lower()
            semantic = await server.off_loop(server.semantic.prepare, raw, prepared, options.cache_salt, bypass)
    return key_name, prepared, semantic


def _prepare_body(server: Server, kind: str, raw: bytes, options: RequestOptions):
    return prepare_body(kind, raw, server.llm.tokenizer, server.limits, server.model_name, options)


def prepare_body(kind: str, raw: bytes, tokenizer, limits: EngineLimits, model_name: str,
                 options: RequestOptions):
    """On a worker thread: the body's bytes -> a PreparedRequest, or an ApiError. NOTE: public,
    for the Ray Serve ingress (kiln/scale), which validates exactly as this server does."""
    model_cls, prepare = ENDPOINTS[kind]
    body, ignored = parse_body(model_cls, decode_body(raw), strict=options.strict_api)
    if body.model is not None and body.model != model_name:
        raise ApiError(404, f"the model '{body.model}' does not exist; this server serves "
                       f"'{model_name}'", "model", "model_not_found")
    prepared = prepare(body, tokenizer, limits, options)
    return replace(prepared, ignored_fields=ignored) if ignored else prepared


async def _collect(sub) -> list:
    return [delta async for delta in sub.deltas()]


async def _internal_error(request, exc) -> Response:
    log.exception("unhandled error", exc_info=exc)
    return ApiError(500, "internal error; the server log has the details").response()
