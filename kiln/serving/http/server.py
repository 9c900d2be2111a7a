"""`kiln serve`: load the artifact, then run the app under uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path

from kiln.config import RuntimeConfig, ServeConfig
from kiln.logs import configure_logging
from kiln.serving.http.errors import ApiError


DRAIN_TIMEOUT = 5.0      # seconds the streams in flight get to finish after SIGTERM (--drain-timeout)


def run_server(artifact: Path, runtime: RuntimeConfig, config: ServeConfig, announce=print,
               drain_timeout: float | None = None) -> None:
    configure_logging(config.log_level)
    loading = _start_loading(artifact, runtime.with_ttft_target(config.admission.ttft_slo), config)
    import uvicorn

    from kiln.serving.http.app import create_app

    llm = loading.result()               # logs the KV plan it sized; raises what loading raised
    model_name = config.served_model_name or Path(artifact).resolve().name
    app = BodyDeadline(create_app(llm, config, model_name), config.body_timeout)
    base = f"http://{config.host}:{config.port}"
    console = f"; console at {base}/" if config.console else ""
    announce(f"serving '{model_name}' on {base}/v1{console} (ready once /ready says so)")
    # Access logs off: one line per request costs the engine's thread GIL time under load.
    # NOTE: uvicorn's limit_concurrency counts open connections (idle keep-alive ones too) and
    # requests in flight; past it every new request gets 503. It has no body-read timeout of its
    # own: BodyDeadline is that.
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=drain_timeout or DRAIN_TIMEOUT, limit_concurrency=config.limit_concurrency,
                timeout_keep_alive=config.keep_alive_timeout)


def _start_loading(artifact: Path, runtime: RuntimeConfig, config: ServeConfig) -> Future:
    """The engine loads on a thread while this one imports the HTTP stack (starlette, uvicorn,
    pydantic, llguidance: most of a second): in its own process by default (engine_process.py),
    else in this one (the engine's compile or import and the checksums run mostly outside the
    GIL). NOTE: the engine's module is imported here first, so the two threads never import the
    same modules at once."""
    if config.engine_process:
        from kiln.runtime.engine_process import EngineProcess as load
        load = partial(load, log_level=config.log_level)
    else:
        from kiln.runtime.llm import LLM as load
    pool = ThreadPoolExecutor(1, thread_name_prefix="kiln-load")
    loading = pool.submit(load, artifact, runtime)
    pool.shutdown(wait=False)
    return loading


class BodyDeadline:
    """ASGI middleware: a request's whole body must arrive within `seconds` of its headers, or
    reading it raises ApiError(408) (and the connection closes), so a client that trickles its
    body a byte at a time (slow loris) holds a connection for `seconds` at most. The endpoints
    turn the ApiError into the response; the receive() calls after the body (disconnect
    watching) are not timed."""

    def __init__(self, app, seconds: float | None):
        self.app, self.seconds = app, seconds

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.seconds:
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline, seconds = loop.time() + self.seconds, self.seconds
        body_done = False

        async def timed_receive():
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                raise ApiError(408, f"the request body did not arrive within {seconds:g} s (--body-timeout)",
                               code="request_timeout", headers={"Connection": "close"}) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, timed_receive, send)
