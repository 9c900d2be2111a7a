"""Seeded workloads: an endless, reproducible stream of request specs per (workload, seed).

Request i draws from its own generator seeded by (workload, seed, i), so the i-th request is the
same whatever order, concurrency or rate the requests are issued in, and a level that issues more
requests than another shares the others' first requests.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, replace
from typing import Callable, Iterator

# NOTE: room for the chat template's tokens around the text, so no request exceeds the context.
TEMPLATE_MARGIN = 32
LONG_PROMPT_CAP = 4096
SHARED_PREFIX_CAP = 1024


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt_tokens: int                  # the request's own text, after any shared prefix
    max_tokens: int
    text_offset: int                    # where its text starts in the corpus (taken modulo its length)
    prefix_tokens: int = 0              # a system prompt every request of the workload shares
    prefix_offset: int = 0
    cancel_after: int | None = None     # content chunks the client reads before hanging up
    json_schema: bool = False           # the reply must match kiln.bench.structured's JSON Schema
    give_up_after: float | None = None  # seconds the client waits before it abandons the request
    stream: bool = True                 # False: the reply asked for whole (no TTFT, no inter-token gaps)
    endpoint: str | None = None         # "chat" or "completions" for this request; None: the target's own


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    draw: Callable[[random.Random, int, int], dict]   # (rng, context_len, seed) -> spec fields


def _chat_lengths(rng: random.Random) -> dict:
    """Mostly short prompts, some medium, a few long; replies from a sentence to a page."""
    size = rng.choices(["short", "medium", "long"], weights=[6, 3, 1])[0]
    lo, hi = {"short": (16, 128), "medium": (128, 512), "long": (512, 1024)}[size]
    return dict(prompt_tokens=rng.randint(lo, hi), max_tokens=rng.randint(16, 256))


def _chat(rng, ctx, seed) -> dict:
    return _chat_lengths(rng)


def _shared_prefix(rng, ctx, seed) -> dict:
    # One long system prompt for all (its corpus offset depends on the seed only): prefix-cache fan-out.
    prefix = min(SHARED_PREFIX_CAP, ctx // 2)
    return dict(prompt_tokens=rng.randint(8, 48), max_tokens=rng.randint(16, 64),
                prefix_tokens=prefix, prefix_offset=random.Random(f"prefix:{seed}").randrange(1 << 31))


def _long_short(rng, ctx, seed) -> dict:
    # A few long prompts among many short ones: their prefill blocks the short requests' decodes.
    if rng.random() < 0.15:
        prompt = rng.randint(int(0.6 * ctx), int(0.8 * ctx))
        return dict(prompt_tokens=min(prompt, LONG_PROMPT_CAP), max_tokens=rng.randint(16, 64))
    return dict(prompt_tokens=rng.randint(16, 64), max_tokens=rng.randint(16, 64))


def _cancel(rng, ctx, seed) -> dict:
    fields = _chat_lengths(rng)
    if rng.random() < 0.3:            # these clients disconnect after reading a few chunks
        fields.update(max_tokens=max(fields["max_tokens"], 64), cancel_after=rng.randint(1, 8))
    return fields


def _json(rng, ctx, seed) -> dict:
    return dict(_chat_lengths(rng), json_schema=True)


def _json_mixed(rng, ctx, seed) -> dict:
    return dict(_chat_lengths(rng), json_schema=rng.random() < 0.5)


def _short(rng, ctx, seed) -> dict:
    # Prefill-bound traffic (classification, routing, scoring): with replies this short nothing
    # decodes for long, and prompts arriving close together could share a prefill step.
    return dict(prompt_tokens=rng.randint(16, 64), max_tokens=rng.randint(1, 4))


SERVING_REPLY_TOKENS = 128


def _serving(rng, ctx, seed) -> dict:
    # The serving side-by-side's (bench/bench_serving.py): distinct chat prompts of about 250
    # tokens, replies of a fixed length (with ignore_eos every server writes all of them).
    return dict(prompt_tokens=rng.randint(200, 300), max_tokens=SERVING_REPLY_TOKENS)


def _system_prompt(rng, ctx, seed) -> dict:
    # Most chat products: a long system prompt (about 1,000 tokens) every request shares, then a
    # short question; replies as in _serving.
    return dict(_shared_prefix(rng, ctx, seed), max_tokens=SERVING_REPLY_TOKENS)


def _max_context(rng, ctx, seed) -> dict:
    max_tokens = rng.randint(16, 32)
    return dict(prompt_tokens=ctx, max_tokens=max_tokens)      # clamped to fill the context exactly


WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    Workload("chat", "chat-like mixed prompt and reply lengths", _chat),
    Workload("shared-prefix", "one long shared system prompt, short user suffixes (prefix-cache fan-out)",
             _shared_prefix),
    Workload("long-short", "15% long prompts among short ones (head-of-line blocking)", _long_short),
    Workload("cancel", "chat-like; 30% of clients disconnect after 1-8 chunks", _cancel),
    Workload("max-context", "prompts that fill the context window", _max_context),
    Workload("short", "short prompts, replies of 1-4 tokens (prefill-bound; the batch wait window's case)", _short),
    Workload("json", "chat-like; every reply constrained to a JSON Schema (structured output)", _json),
    Workload("json-mixed", "chat-like; half the replies constrained to a JSON Schema", _json_mixed),
    Workload("serving", "distinct ~250-token chat prompts, 128-token replies (the serving side-by-side)", _serving),
    Workload("system-prompt", "a ~1,000-token shared system prompt, short questions, 128-token replies",
             _system_prompt),
]}


def request_specs(workload: str | Workload, seed: int, context_len: int, max_tokens_cap: int | None = None
                  ) -> Iterator[RequestSpec]:
    """The workload's requests (a name in WORKLOADS, or a Workload of the caller's), in order, without end."""
    w = workload if isinstance(workload, Workload) else WORKLOADS[workload]
    for i in itertools.count():
        rng = random.Random(f"{w.name}:{seed}:{i}")       # str seeds hash the same in every process
        spec = RequestSpec(index=i, text_offset=rng.randrange(1 << 31), **w.draw(rng, context_len, seed))
        yield fit_context(spec, context_len, max_tokens_cap)


def fit_context(spec: RequestSpec, context_len: int, max_tokens_cap: int | None) -> RequestSpec:
    """Cap the reply, then shorten the prompt so prefix + prompt + reply fit the context."""
    max_tokens = min(spec.max_tokens, max_tokens_cap) if max_tokens_cap else spec.max_tokens
    room = context_len - TEMPLATE_MARGIN - spec.prefix_tokens - max_tokens
    if room < 1:
        raise ValueError(f"a context of {context_len} tokens leaves no room for a prompt with "
                         f"{spec.prefix_tokens} prefix and {max_tokens} reply tokens")
    # A client that would hang up after the reply's end would not hang up at all: keep it inside.
    # (0, hanging up before the first token, stays 0.)
    cancel = spec.cancel_after and max(1, min(spec.cancel_after, max_tokens - 1))
    return replace(spec, max_tokens=max_tokens, prompt_tokens=min(spec.prompt_tokens, room), cancel_after=cancel)
