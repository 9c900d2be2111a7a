"""The console's routes: the page at `/`, its static files, and three endpoints the page reads.

  GET /                            index.html (no secrets in it: the page asks for the API key)
  GET /console/static/...          the scripts and the stylesheet
  GET /console/api/card            the artifact card (JSON)
  GET /console/api/stats           the dashboard history (JSON)
  GET /console/api/stats/stream    the history, then each new point as it is sampled (SSE)

The /console/api endpoints need the API key when the server has one, like /v1/*.
"""

from __future__ import annotations

import json
from functools import partial
from importlib import resources

from starlette.requests import Request as HttpRequest
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from kiln.serving.console.card import artifact_card
from kiln.serving.console.history import StatsHistory
from kiln.serving.http.errors import ApiError
from kiln.serving.http.http_io import EventStream, check_api_key

STATIC = resources.files("kiln.serving.console") / "static"


def console_routes(server) -> list:
    """The console's routes over a Server (kiln.serving.http.app), or none when --no-console."""
    if not server.config.console:
        return []
    history = StatsHistory(server.metrics.registry)
    return [
        Route("/", _index),
        Mount("/console/static", StaticFiles(packages=[("kiln.serving.console", "static")]), name="console"),
        Route("/console/api/card", partial(_card, server)),
        Route("/console/api/stats", partial(_stats, server, history)),
        Route("/console/api/stats/stream", partial(_stats_stream, server, history)),
    ]


async def _index(request: HttpRequest) -> Response:
    # NOTE: no-store, so a browser never shows a page older than the server's static files.
    return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"), headers={"Cache-Control": "no-store"})


def _refused(server, request: HttpRequest) -> Response | None:
    try:
        check_api_key(request, server.config.api_key, server.config.api_keys)
    except ApiError as e:
        return server.rejected(e)
    return None


async def _card(server, request: HttpRequest) -> Response:
    if (refused := _refused(server, request)) is not None:
        return refused
    card = artifact_card(server.llm.artifact.manifest, server.client.snapshot.kv_plan, server.model_name,
                         server.limits.max_model_len)
    return JSONResponse(card)


async def _stats(server, history: StatsHistory, request: HttpRequest) -> Response:
    if (refused := _refused(server, request)) is not None:
        return refused
    history.ensure_sampling()
    return JSONResponse({"period": history.period, "points": list(history.points)})


async def _stats_stream(server, history: StatsHistory, request: HttpRequest) -> Response:
    if (refused := _refused(server, request)) is not None:
        return refused
    history.ensure_sampling()
    return EventStream(_events(history), on_close=lambda: None)


async def _events(history: StatsHistory):
    points, count = history.since(0)
    yield _event("history", {"period": history.period, "points": points})
    while True:
        points, count = await history.wait(count)
        for p in points:
            yield _event("point", p)


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"
