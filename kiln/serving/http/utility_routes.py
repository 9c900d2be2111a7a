"""vLLM's utility endpoints: /tokenize, /detokenize and /version; the API's description at
/openapi.json (generated from the request models in openai/protocol.py) and a page listing it at /docs
(plain HTML: no Swagger UI assets ship offline)."""

from __future__ import annotations

import html
from functools import partial
from importlib.metadata import PackageNotFoundError, version

from pydantic.json_schema import models_json_schema
from starlette.requests import Request as HttpRequest
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from kiln.serving.http.errors import ApiError, bad_request
from kiln.serving.http.http_io import decode_body, ignored_fields_header, read_body
from kiln.serving.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                   parse_body)
from kiln.tokenizer import ChatTemplateError

# (method, path, summary, request model or None): the endpoints /openapi.json and /docs describe.
ENDPOINTS = (
    ("post", "/v1/completions", "Text completion (OpenAI); n, list prompts, echo; SSE with stream", CompletionRequest),
    ("post", "/v1/chat/completions", "Chat through the model's template (OpenAI); tools, structured output",
     ChatCompletionRequest),
    ("get", "/v1/models", "The served model", None),
    ("post", "/tokenize", "A prompt or chat messages -> token ids (vLLM)", TokenizeRequest),
    ("post", "/detokenize", "Token ids -> text (vLLM)", DetokenizeRequest),
    ("get", "/version", "kiln's version", None),
    ("get", "/health", "Liveness: 503 once the engine has faulted", None),
    ("get", "/ready", "Readiness: 200 once the engine has warmed up", None),
    ("get", "/metrics", "Prometheus metrics", None),
    ("get", "/openapi.json", "This API's OpenAPI description", None),
    ("get", "/docs", "A page listing the endpoints", None),
)


def kiln_version() -> str:
    try:
        return version("kiln")
    except PackageNotFoundError:         # run from a source tree that is not installed
        return "unknown"


def utility_routes(server) -> list[Route]:
    spec = openapi(server.model_name)
    page = docs_page(spec)
    return [
        Route("/tokenize", partial(_tokenize, server), methods=["POST"]),
        Route("/detokenize", partial(_detokenize, server), methods=["POST"]),
        Route("/version", server.keyed("/version", partial(_json, {"version": kiln_version()}))),
        Route("/openapi.json", server.keyed("/openapi.json", partial(_json, spec))),
        Route("/docs", server.keyed("/docs", partial(_html, page))),
    ]


def openapi(model_name: str) -> dict:
    models = [m for *_, m in ENDPOINTS if m is not None]
    _, schemas = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    paths: dict = {}
    for method, path, summary, model in ENDPOINTS:
        op = {"summary": summary, "responses": {"200": {"description": "OK"}}}
        if model is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            op["responses"].update({"400": {"description": "invalid request"},
                                    "429": {"description": "admission control; see Retry-After"}})
        paths.setdefault(path, {})[method] = op
    return {"openapi": "3.1.0", "info": {"title": f"kiln serving {model_name}", "version": kiln_version()},
            "paths": paths, "components": {"schemas": schemas.get("$defs", {})}}


def docs_page(spec: dict) -> str:
    rows = "".join(f"<tr><td>{method.upper()}</td><td><code>{html.escape(path)}</code></td>"
                   f"<td>{html.escape(op['summary'])}</td></tr>"
                   for path, ops in spec["paths"].items() for method, op in ops.items())
    title = html.escape(spec["info"]["title"])
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head><body>"
            f"<h1>{title}</h1><p>kiln {html.escape(spec['info']['version'])}. The request bodies' schemas are in "
            f"<a href='/openapi.json'>/openapi.json</a>.</p><table border='1' cellpadding='4'>"
            f"<tr><th>method</th><th>path</th><th>what it does</th></tr>{rows}</table></body></html>")


async def _json(payload, request: HttpRequest) -> Response:
    return JSONResponse(payload)


async def _html(page: str, request: HttpRequest) -> Response:
    return HTMLResponse(page)


async def _tokenize(server, request: HttpRequest) -> Response:
    return await _answer(server, request, TokenizeRequest, _tokenized)


async def _detokenize(server, request: HttpRequest) -> Response:
    return await _answer(server, request, DetokenizeRequest, _detokenized)


async def _answer(server, request: HttpRequest, model, handler) -> Response:
    try:
        key_name = server.check(request)
        raw = await read_body(request, server.config.max_body_bytes)
        options = server.options(key_name)
        with server.preparing(len(raw)):
            body, ignored = await server.off_loop(_parse, server, model, raw, options.strict_api)
            answer = await server.off_loop(handler, server, body, options)
    except ApiError as e:
        return server.rejected(e)
    return JSONResponse(answer, headers=ignored_fields_header(ignored))


def _parse(server, model, raw: bytes, strict: bool):
    body, ignored = parse_body(model, decode_body(raw), strict=strict)
    if body.model is not None and body.model != server.model_name:
        raise ApiError(404, f"the model '{body.model}' does not exist; this server serves "
                       f"'{server.model_name}'", "model", "model_not_found")
    return body, ignored


def _tokenized(server, body: TokenizeRequest, options) -> dict:
    # the chat endpoint's own message rules and bounds: /tokenize costs what a prompt costs
    from kiln.serving.openai.requests import check_chars_fit, message_dicts, rendered_chars

    tok = server.llm.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send one of 'prompt' or 'messages'", "prompt")
    if body.prompt is not None:
        check_chars_fit(len(body.prompt), tok, server.limits, "prompt")
        ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        messages = message_dicts(body.messages)
        check_chars_fit(rendered_chars(messages, body.chat_template_kwargs), tok, server.limits, "messages")
        ids = _chat_ids(tok, messages, body, options)
    return {"count": len(ids), "max_model_len": server.limits.max_model_len, "tokens": ids}


def _chat_ids(tok, messages: list[dict], body: TokenizeRequest, options) -> list[int]:
    """As the chat endpoint tokenizes (so `count` is its prompt_tokens), or without the
    generation prompt when add_generation_prompt is false."""
    try:
        return tok.encode_chat(messages, control_tokens_in_messages=options.control_tokens_in_messages,
                               template_kwargs=body.chat_template_kwargs,
                               add_generation_prompt=body.add_generation_prompt)
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None
    except Exception as e:          # the template cannot render these messages: the client's problem
        raise bad_request(f"the chat template cannot render these messages: {e}", "messages") from None


def _detokenized(server, body: DetokenizeRequest, options) -> dict:
    vocab = server.limits.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise bad_request(f"tokens must be token ids in [0, {vocab})", "tokens", "invalid_value")
    return {"prompt": server.llm.tokenizer.decode(body.tokens, skip_special_tokens=False)}
