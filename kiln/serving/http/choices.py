"""A request's choices: `n` samples of each prompt (completions take a list of prompts), each its
own engine request, opened through Generations (so each passes admission).

The prompt's KV is computed once: the first choice of a prompt goes to the engine at once; its
siblings are admitted with it but reach the engine at its first delta, when the prompt's full
blocks are in the prefix cache, so each sibling computes only the prompt's last, partial block.
Greedy siblings are one engine request: the single-flight share of identical deterministic
requests (Generations) answers them all. With a `seed`, choice j samples with seed + j, so that
the choices differ and stay reproducible.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from starlette.responses import Response

from kiln.runtime.engine_client import EngineError
from kiln.runtime.sampling_params import MAX_SEED, SamplingParams
from kiln.serving.http.errors import ApiError, bad_request, engine_failure
from kiln.serving.traffic.generations import Generations
from kiln.serving.http.http_io import EventStream, ignored_fields_header, rendered_json, until_disconnected
from kiln.serving.openai.requests import PreparedRequest
from kiln.serving.openai.responses import Choice, Echo, Renderer


def open_choices(generations: Generations, prepared: PreparedRequest, tokenizer) -> list[Choice]:
    """Every choice's subscription, in OpenAI's order (prompt i's choice j is index i * n + j).
    Raises what Generations.open raises (429) after closing the choices opened before."""
    choices: list[Choice] = []
    try:
        for p, ids in enumerate(prepared.prompts):
            echo = _echo(prepared, p, ids, tokenizer)
            gate = None
            for j in range(prepared.n):
                one = replace(prepared, prompt_ids=ids, more_prompts=(), n=1, params=_choice_params(prepared.params, j))
                sub = generations.open(one, after=gate)
                if j == 0 and prepared.n > 1:
                    gate = getattr(sub.source, "first_delta", None)    # a cached recording: none needed
                choices.append(Choice(len(choices), p, sub, echo))
    except BaseException:
        for c in choices:
            c.sub.close()
        raise
    return choices


def _choice_params(params: SamplingParams, j: int) -> SamplingParams:
    if j == 0 or params.seed is None:
        return params
    return replace(params, seed=(params.seed + j) % (MAX_SEED + 1))


def _echo(prepared: PreparedRequest, p: int, ids: tuple[int, ...], tokenizer) -> Echo | None:
    if not prepared.echo:
        return None
    text = prepared.prompt_texts[p] if p < len(prepared.prompt_texts) else None
    return Echo(text if text is not None else tokenizer.decode(list(ids), skip_special_tokens=False), ids)


async def generate_choices(server, request, kind: str, prepared: PreparedRequest) -> Response:
    """The endpoint's answer to a request of several choices (n > 1, list prompts) or an echo."""
    try:
        choices = open_choices(server.generations, prepared, server.llm.tokenizer)
    except ApiError as e:
        return server.rejected(e)
    renderer = Renderer(kind, server.model_name, server.llm.tokenizer, prepared.parse_tool_calls, prepared.echo_only,
                        prepared.tool_format, prepared.reasoning)
    headers = ignored_fields_header(prepared.ignored_fields)

    def close() -> None:
        for c in choices:
            c.sub.close()

    if prepared.stream:
        return EventStream(renderer.stream_choices(choices, prepared.include_usage, prepared.continuous_usage),
                           on_close=close, headers=headers)
    try:
        finished, results = await until_disconnected(request.receive, _collect(choices))
        if finished:       # tool calls and logprobs (echo's above all) are CPU work: off the loop
            args = (renderer.body_of, choices, results)
            body = await server.off_loop(rendered_json, *args) if prepared.heavy_body else rendered_json(*args)
    except ValueError as e:          # the engine refused one (a limit the checks missed)
        return server.rejected(bad_request(str(e)))
    except EngineError as e:         # the engine failed mid-step; it serves the next request
        return engine_failure(e).response()
    finally:
        close()
    if not finished:
        return Response(status_code=499)       # nobody is there to read it
    return Response(body, media_type="application/json", headers=headers)


async def _collect(choices: list[Choice]) -> list[tuple[list, dict | None]]:
    async def one(c: Choice):
        return [d async for d in c.sub.deltas()], getattr(c.sub.source, "parsed", None)
    return list(await asyncio.gather(*(one(c) for c in choices)))
