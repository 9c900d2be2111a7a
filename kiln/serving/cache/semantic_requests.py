"""What a chat request gives the semantic cache, and the server's side of it.

`SemanticResponses` runs on the server's preparation workers (embedding is CPU work, never on
the event loop): it splits a deterministic chat request into its exact key and its last user
turn, embeds the turn and looks it up. The generations layer decides afterwards: an exact-cache
hit or an identical request in flight wins; otherwise a semantic hit is served, and a fresh
answer is stored when it lands. An embedder that fails leaves the request to be served normally.
"""

from __future__ import annotations

import json
import logging
import weakref
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kiln.config import SemanticCacheConfig
from kiln.serving.cache.semantic_cache import Lookup, SemanticCache, SemanticQuery
from kiln.serving.traffic.generations import CACHEABLE_FINISH_REASONS

log = logging.getLogger("kiln.serving")

# Body fields that change how an answer is delivered, not what it is; the last user turn is
# compared semantically; every other field (system prompt, tools, sampling) is part of the key.
# NOTE: `user` (OpenAI's end-user id) is part of the key: an application that names its end users
# gets a tenant per user under its API key, so no user plants an answer for another.
DELIVERY_FIELDS = ("stream", "stream_options", "messages")


@dataclass(frozen=True)
class SemanticRequest:
    query: SemanticQuery
    lookup: Lookup | None          # None: asked not to be served from the cache (Cache-Control)


def split_chat(body: dict, cache_salt: str | None) -> tuple[str, str] | None:
    """(exact key, last user turn) of a chat body, or None when its last message is not a user
    turn with text."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return None
    last = messages[-1]
    question = _text(last.get("content"))
    if last.get("role") != "user" or not question or not question.strip():
        return None
    rest = {k: v for k, v in body.items() if k not in DELIVERY_FIELDS}
    rest["messages"] = messages[:-1]
    rest["kiln.tenant"] = cache_salt
    return json.dumps(rest, sort_keys=True, separators=(",", ":")), question.strip()


def _text(content) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "\n".join(str(p.get("text", "")) for p in content)
    return None                    # images, audio: not a question the embedder can compare


class SemanticResponses:
    def __init__(self, embedder, cache: SemanticCache):
        self.embedder, self.cache = embedder, cache
        self.embedder_failures = 0
        # outcome -> requests; "too_long": the question is longer than the embedder reads
        self.lookups = Counter({"hit": 0, "miss": 0, "guard": 0, "too_long": 0})
        self._stored: weakref.WeakSet = weakref.WeakSet()              # flights already stored

    def prepare(self, raw: bytes, prepared, cache_salt: str | None, bypass: bool) -> SemanticRequest | None:
        """On a worker thread, after the request was prepared (and so validated)."""
        if prepared.kind != "chat" or not prepared.deterministic or getattr(prepared, "n", 1) != 1:
            return None
        parts = split_chat(json.loads(raw), cache_salt)
        if parts is None:
            return None
        key, question = parts
        try:
            embedding = self.embedder.embed_whole(question)
        except Exception:                 # served normally, without the cache
            self.embedder_failures += 1
            log.warning("the semantic cache's embedder failed; serving the request without it", exc_info=True)
            return None
        if embedding is None:             # never looked up nor stored: the embedder saw only its head
            self.lookups["too_long"] += 1
            return None
        query = SemanticQuery(key, question, embedding)
        return SemanticRequest(query, None if bypass else self.cache.lookup(query))

    def open(self, generations, prepared, request: SemanticRequest | None):
        """On the event loop: the semantic hit, unless the exact cache has the answer; otherwise
        the generation (exact cache, a flight to join, or a new one), stored when it lands."""
        if request is None:
            return generations.open(prepared)
        lookup = request.lookup
        if lookup is not None and not _exact_hit(generations, prepared):
            self.lookups[lookup.outcome] += 1
            if lookup.outcome == "hit":
                return SemanticHit(lookup.value.subscribe())
        return StoringSubscription(generations.open(prepared), lambda flight: self._store(request, flight))

    def _store(self, request: SemanticRequest, flight) -> None:
        if flight in self._stored or flight.finish_reason not in CACHEABLE_FINISH_REASONS:
            return
        self._stored.add(flight)
        recording = flight.recording()
        self.cache.put(request.query, recording, recording.nbytes)

    def collect(self):
        """prometheus-client collector: the lookups by outcome, the index's size, embedder failures."""
        lookups = CounterMetricFamily("kiln_semantic_cache_lookups", "Semantic cache lookups by outcome: hit, "
                                      "miss, guard (a close question whose numbers, dates, negations, names, "
                                      "polarity or prepositional slots differ), or too_long (a question longer "
                                      "than the embedder reads: not looked up nor stored).", labels=["outcome"])
        for outcome, n in sorted(self.lookups.items()):
            lookups.add_metric([outcome], n)
        yield lookups
        yield _gauge("kiln_semantic_cache_entries", "Answers in the semantic cache.", len(self.cache))
        yield _gauge("kiln_semantic_cache_bytes", "Their estimated size.", self.cache.nbytes)
        failures = CounterMetricFamily("kiln_semantic_cache_embedder_failures", "Requests served without the "
                                       "semantic cache because the embedder failed.")
        failures.add_metric([], self.embedder_failures)
        yield failures


def _exact_hit(generations, prepared) -> bool:
    return generations.cache is not None and generations.cache.get(prepared.cache_key) is not None


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    family.add_metric([], value)
    return family


class SemanticHit:
    """A subscription to a stored answer, marked for the X-Cache header."""
    cache_kind = "semantic"

    def __init__(self, sub):
        self._sub = sub
        self.source = sub.source

    @property
    def usage(self):
        return self._sub.usage

    def deltas(self):
        return self._sub.deltas()

    def close(self) -> None:
        self._sub.close()


class StoringSubscription(SemanticHit):
    """A generation's subscription that hands its flight to `on_landed` once read to the end."""
    cache_kind = None

    def __init__(self, sub, on_landed):
        super().__init__(sub)
        self._on_landed = on_landed

    async def deltas(self):
        async for delta in self._sub.deltas():
            yield delta
        if hasattr(self.source, "recording"):          # a flight (a stored recording is stored already)
            self._on_landed(self.source)


def load_semantic_responses(config: SemanticCacheConfig) -> SemanticResponses:
    """The embedder and the index of the semantic cache `config` describes. Raises EmbedderError,
    saying how to make one, when the model folder holds no model (`kiln serve` exports the default
    one before it gets here: the export is build-side code, kiln/compiler/export/embedder.py)."""
    from kiln.contract.embedder import default_model_dir
    from kiln.serving.cache.embedder import Embedder

    folder = Path(config.model) if config.model else default_model_dir()
    cache = SemanticCache(config.max_entries, config.max_bytes, config.ttl, config.threshold)
    return SemanticResponses(Embedder(folder), cache)
