"""The ingress: kiln serve's OpenAI API (the same validation, errors, streaming) in front of the
replica deployment.

It validates and tokenizes each request exactly as kiln serve does (kiln.serving.http.app.prepare_body),
hashes the prompt's blocks for the router, opens a stream on a replica, and renders the replica's
deltas with kiln serve's renderer. A replica that refuses (429) is passed over once: the request
goes to one other replica before the client gets the 429 and its Retry-After. The chosen replica
is counted in kiln_ingress_requests_total{replica} (on /metrics, behind the API key when one is
set); it is named to the client in the `x-kiln-replica` header only where the operator turns that
on (ScaleOptions.replica_header, a test and benchmark knob): a replica id is Ray's internal name.

The server options that shape a request (--strict-api, --tool-call-parser, --chat-template and its
reasoning mode, the per-key priority ranges, --public-endpoints) apply here exactly as in kiln
serve: the ingress prepares and renders the requests, so it reads them from the same ServeConfig.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kiln.config import ServeConfig
from kiln.contract.artifact import EngineArtifact
from kiln.scale.hedge import HedgePolicy, race
from kiln.scale.messages import portable, refusal_error
from kiln.scale.prefix import prompt_block_hashes
from kiln.scale.remote import RemoteSubscription, ReplicaFailed, ReplicaStream
from kiln.serving.http.app import prepare_body
from kiln.serving.http.errors import ApiError
from kiln.serving.http.http_io import EventStream, RequestGuard, allowed_host_names, check_api_key, keyed_endpoint, \
    ignored_fields_header, read_body, until_disconnected
from kiln.serving.openai.requests import DEFAULT_PRIORITY_RANGE, RequestOptions
from kiln.serving.openai.responses import Renderer
from kiln.tokenizer import Tokenizer

log = logging.getLogger("kiln.scale")

REPLICA_HEADER = "x-kiln-replica"
BUSY_RETRY_AFTER = 1          # seconds, when Serve's own queue is full (no replica could say more)


@dataclass(frozen=True)
class HedgeOptions:
    fraction: float = 0.05
    floor: float = 0.5


class Ingress:
    """What the endpoints share: the replicas' handle, the tokenizer, the books."""

    def __init__(self, replicas, artifact: str, config: ServeConfig, model_name: str,
                 hedge: HedgeOptions | None = None, replica_header: bool = False):
        self.replicas, self.config, self.model_name = replicas, config, model_name
        self.replica_header = replica_header
        self.tokenizer = Tokenizer(EngineArtifact.load(artifact).tokenizer_dir)
        if config.chat_template is not None:        # as kiln serve's Server does
            self.tokenizer.set_chat_template(config.chat_template.read_text(encoding="utf-8"))
        self._priorities = {name: (low, high) for name, low, high in config.key_priorities}
        self.hedging = HedgePolicy(hedge.fraction, hedge.floor) if hedge is not None else None
        self._limits = None
        self.workers = ThreadPoolExecutor(2, thread_name_prefix="kiln-ingress-prepare")
        disable_created_metrics()            # as kiln serve's metrics do
        self.registry = CollectorRegistry()
        self.routed = Counter("kiln_ingress_requests", "Requests the ingress sent, by the replica that "
                              "took them.", ["replica"], registry=self.registry)
        self.retried = Counter("kiln_ingress_retries", "Requests sent to another replica after one "
                               "refused (429) or failed before starting.", registry=self.registry)
        self.refused = Counter("kiln_ingress_refused", "Requests answered 429 after the retry.",
                               registry=self.registry)
        self.registry.register(_HedgeCollector(self))
        self.registry.register(_ReplicaCollector())

    async def limits(self):
        if self._limits is None:                # every replica serves the same artifact
            self._limits = await self.replicas.limits.remote()
        return self._limits

    def options(self, key_name: str | None) -> RequestOptions:
        """What kiln serve's Server.options gives the same key under the same ServeConfig."""
        c = self.config
        salt = f"api-key:{key_name}" if key_name is not None and c.per_key_cache_salt else None
        return RequestOptions(c.allow_control_tokens_in_messages, salt, c.strict_api, c.tool_call_parser,
                              self._priorities.get(key_name, DEFAULT_PRIORITY_RANGE))

    def headers(self, stream: ReplicaStream, prepared=None) -> dict[str, str]:
        headers = dict(ignored_fields_header(prepared.ignored_fields)) if prepared is not None else {}
        if self.replica_header:
            headers[REPLICA_HEADER] = stream.replica_id or ""
        return headers

    async def open(self, prepared, route: tuple[int, ...], avoid: str | None = None,
                   retries: int = 1) -> ReplicaStream:
        """A stream a replica admitted; refused (429) or failing before admission, one other
        replica is tried `retries` times. Raises the last ApiError."""
        error = None
        for attempt in range(retries + 1):
            if attempt:
                self.retried.inc()
            stream = ReplicaStream(self.replicas.options(stream=True).generate.remote(
                prepared, route=route, avoid=avoid))
            try:
                item = await stream.opening()
            except BaseException:               # cancelled (the client left, a hedge race ended)
                stream.cancel()
                raise
            if item[0] == "admitted":
                self.routed.labels(stream.replica_id).inc()
                return stream
            if item[0] == "refused":
                error = refusal_error(item)
                if error.status != 429:
                    raise error
                if self.hedging is not None:
                    self.hedging.refused()
            else:                               # no replica could take it (Serve's queue, a dead replica)
                error = _busy(item[1] if len(item) > 1 else "no replica answered")
            avoid = stream.replica_id or avoid
        self.refused.inc()
        raise error

    async def open_hedge(self, prepared, route, avoid: str | None) -> ReplicaStream | None:
        try:
            return await self.open(prepared, route, avoid, retries=0)
        except ApiError:
            return None

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.workers, partial(fn, *args))


class _HedgeCollector:
    def __init__(self, ingress: Ingress):
        self.ingress = ingress

    def collect(self):
        policy = self.ingress.hedging
        counts = policy.counts if policy is not None else None
        for name, doc in (("sent", "Duplicates sent to a second replica after the hedge delay."),
                          ("won", "Hedges whose duplicate produced the first token."),
                          ("cancelled", "Streams cancelled because the other one produced a token first.")):
            family = CounterMetricFamily(f"kiln_hedges_{name}", doc)
            family.add_metric([], getattr(counts, name) if counts else 0)
            yield family


class _ReplicaCollector:
    """Each replica's engine books, as it last reported them to the router, with a replica label."""

    GAUGES = {"num_running": ("kiln_replica_requests_running", "Requests in the replica's running batch."),
              "num_waiting": ("kiln_replica_requests_waiting", "Requests in the replica's waiting queue."),
              "kv_blocks_used": ("kiln_replica_kv_blocks_used", "KV blocks held by the replica's requests."),
              "kv_blocks_total": ("kiln_replica_kv_blocks_total", "KV blocks in the replica's pool.")}
    COUNTERS = {"prefix_cache_queries": ("kiln_replica_prefix_cache_queries", "Prompt tokens the replica looked up."),
                "prefix_cache_hits": ("kiln_replica_prefix_cache_hits", "Of those, found in its prefix cache.")}

    def collect(self):
        from kiln.scale.router import replica_books

        books = replica_books()
        for kinds, family_of in ((self.GAUGES, GaugeMetricFamily), (self.COUNTERS, CounterMetricFamily)):
            for field, (name, doc) in kinds.items():
                family = family_of(name, doc + " Reported every second.", labels=["replica"])
                for replica, values in sorted(books.items()):
                    if field in values:
                        family.add_metric([replica], values[field])
                yield family


def _busy(reason: str) -> ApiError:
    return ApiError(429, f"server busy: {reason}; retry in {BUSY_RETRY_AFTER} s", code="no_replica",
                    headers={"Retry-After": str(BUSY_RETRY_AFTER)})


def create_ingress_app(ingress: Ingress) -> Starlette:
    routes = [
        Route("/health", keyed_endpoint(ingress.config, "/health", partial(_health, ingress))),
        Route("/ready", keyed_endpoint(ingress.config, "/ready", partial(_ready, ingress))),
        Route("/metrics", keyed_endpoint(ingress.config, "/metrics", partial(_metrics, ingress))),
        Route("/v1/models", partial(_models, ingress)),
        Route("/v1/completions", partial(_generate, ingress, kind="completion"), methods=["POST"]),
        Route("/v1/chat/completions", partial(_generate, ingress, kind="chat"), methods=["POST"]),
    ]
    c = ingress.config
    middleware = [Middleware(RequestGuard, hosts=allowed_host_names(c.host, c.allowed_hosts))]
    return Starlette(routes=routes, middleware=middleware)


async def _health(ingress: Ingress, request: HttpRequest) -> Response:
    return JSONResponse({"status": "ok"})


async def _ready(ingress: Ingress, request: HttpRequest) -> Response:
    try:
        await ingress.limits()
    except Exception:                       # no replica has answered yet
        # NOTE: the exception's text (Ray's actor names, addresses, a traceback's lines) goes to the
        # log, never to the probe's body
        log.warning("/ready: no replica answered", exc_info=True)
        return JSONResponse({"status": "loading", "reason": "no replica has answered yet"}, status_code=503)
    return JSONResponse({"status": "ready", "model": ingress.model_name})


async def _metrics(ingress: Ingress, request: HttpRequest) -> Response:
    return Response(generate_latest(ingress.registry), media_type=CONTENT_TYPE_LATEST)


async def _models(ingress: Ingress, request: HttpRequest) -> Response:
    try:
        check_api_key(request, ingress.config.api_key, ingress.config.api_keys)
    except ApiError as e:
        return e.response()
    limits = await ingress.limits()
    card = {"id": ingress.model_name, "object": "model", "created": int(time.time()), "owned_by": "kiln",
            "max_model_len": limits.max_model_len}
    return JSONResponse({"object": "list", "data": [card]})


async def _generate(ingress: Ingress, request: HttpRequest, kind: str) -> Response:
    c = ingress.config
    try:
        key_name = check_api_key(request, c.api_key, c.api_keys)
        raw = await read_body(request, c.max_body_bytes)
        limits = await ingress.limits()
        prepared = await ingress.off_loop(prepare_body, kind, raw, ingress.tokenizer, limits,
                                          ingress.model_name, ingress.options(key_name))
        _check_single_choice(prepared)
        route = prompt_block_hashes(prepared.prompt_ids, limits.block_size, prepared.params.cache_salt)
        sent = portable(prepared)
        stream = await ingress.open(sent, route)
    except ApiError as e:
        return e.response()
    if ingress.hedging is not None:
        # NOTE: the race stops when the client leaves, and then cancels both streams (race())
        try:
            raced, winner = await until_disconnected(
                request.receive, race(stream, partial(ingress.open_hedge, sent, route), ingress.hedging))
        except BaseException:
            stream.cancel()
            raise
        if not raced:
            return Response(status_code=499)
        stream = winner
    renderer = Renderer(kind, ingress.model_name, ingress.tokenizer, prepared.parse_tool_calls,
                        tool_format=prepared.tool_format, reasoning=prepared.reasoning)
    sub = RemoteSubscription(stream)
    headers = ingress.headers(stream, prepared)
    if prepared.stream:
        return EventStream(renderer.stream(sub, prepared.include_usage),
                           on_close=stream.cancel, headers=headers)
    try:
        finished, deltas = await until_disconnected(request.receive, _collect(sub))
        body = renderer.body(deltas, sub.usage) if finished else None
    except ReplicaFailed as e:              # Ray's own words (actor names, addresses) go to the log only
        log.warning("a replica failed mid-answer: %s", e)
        return ApiError(500, "the replica failed while answering; retry the request", code="engine_error").response()
    finally:
        stream.cancel()                      # a no-op message once the replica has finished
    if not finished:
        return Response(status_code=499)
    return JSONResponse(body, headers=headers)


def _check_single_choice(prepared) -> None:
    # NOTE: getattr: these PreparedRequest fields are kiln serve's (n > 1, list prompts, echo);
    # the ingress streams one replica's single choice.
    if getattr(prepared, "n", 1) > 1 or getattr(prepared, "more_prompts", ()) or getattr(prepared, "echo", False):
        raise ApiError(400, "n > 1, several prompts and echo are served by kiln serve, not yet through "
                       "the Ray Serve ingress", "n", "unsupported_on_ray")


async def _collect(sub: RemoteSubscription) -> list:
    return [delta async for delta in sub.deltas()]
