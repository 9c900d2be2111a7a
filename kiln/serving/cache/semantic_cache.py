"""The semantic response cache (opt-in, `--semantic-cache`): a stored answer for a question that
means the same as one answered before.

A chat request splits in two (semantic_requests.py): an exact key (the system prompt, tools,
sampling parameters, the tenant and every turn but the last user one) and the last user turn's
text. Only entries under the same exact key are compared, so a different system prompt, tool
list, sampling parameter or earlier turn never shares an answer. Among those, the entry whose
question embedding is closest by cosine, at or above `threshold`, and whose question passes the
guards (semantic_guards.py: numbers, dates, negations, named entities, polarity and
prepositional slots agree) is a hit.
Candidates above the threshold that all fail a guard count as a guard rejection.

The index is bounded in entries and bytes (least recently used out first) and each entry lives
`ttl` seconds. Lookups scan the entries of one exact key: the bound keeps that scan small.
Any thread may call it (the server calls it from its preparation workers): one lock.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Hashable

import numpy as np

from kiln.config import SemanticCacheConfig
from kiln.serving.cache.semantic_guards import QuestionFeatures, features

DEFAULT_THRESHOLD = SemanticCacheConfig.threshold    # docs/benchmarks.md, semantic response cache
ENTRY_OVERHEAD_BYTES = 300


@dataclass(frozen=True)
class SemanticQuery:
    exact_key: Hashable
    question: str
    embedding: np.ndarray          # unit length
    features: QuestionFeatures = field(default=None)

    def __post_init__(self):
        if self.features is None:
            object.__setattr__(self, "features", features(self.question))


@dataclass
class Lookup:
    value: object | None           # the stored answer on a hit
    outcome: str                   # "hit", "miss" or "guard"
    similarity: float = 0.0        # the best candidate's cosine
    guard: str | None = None       # the feature that turned the best candidate down


@dataclass
class _Entry:
    query: SemanticQuery
    value: object
    nbytes: int
    stored_at: float


class SemanticCache:
    def __init__(self, max_entries: int, max_bytes: int, ttl: float, threshold: float = DEFAULT_THRESHOLD,
                 guards: bool = True, clock: Callable[[], float] = time.monotonic):
        if not -1 <= threshold <= 1:
            raise ValueError(f"the semantic cache's threshold is a cosine in [-1, 1], got {threshold}")
        if max_entries < 1 or max_bytes < 1 or ttl <= 0:
            raise ValueError("the semantic cache needs max_entries, max_bytes and ttl above 0")
        self.max_entries, self.max_bytes, self.ttl = max_entries, max_bytes, ttl
        self.threshold, self.guards, self.clock = threshold, guards, clock
        self._entries: OrderedDict[int, _Entry] = OrderedDict()      # id -> entry, LRU first
        self._by_key: dict[Hashable, set[int]] = {}
        self._ids = 0
        self._lock = threading.Lock()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, query: SemanticQuery) -> Lookup:
        with self._lock:
            candidates = self._candidates(query)
            if not candidates:
                return Lookup(None, "miss", 0.0)
            best, first_guard = candidates[0][0], None
            for similarity, entry_id, entry in candidates:
                guard = query.features.disagreement(entry.query.features) if self.guards else None
                if guard is None:
                    self._entries.move_to_end(entry_id)
                    return Lookup(entry.value, "hit", similarity)
                first_guard = first_guard or guard
            return Lookup(None, "guard", best, first_guard)

    def _candidates(self, query: SemanticQuery) -> list[tuple[float, int, _Entry]]:
        """Live entries of the query's exact key at or above the threshold, closest first."""
        now, found = self.clock(), []
        for entry_id in list(self._by_key.get(query.exact_key, ())):
            entry = self._entries[entry_id]
            if now - entry.stored_at > self.ttl:
                self._drop(entry_id)
                continue
            similarity = float(np.dot(query.embedding, entry.query.embedding))
            if similarity >= self.threshold:
                found.append((similarity, entry_id, entry))
        found.sort(key=lambda c: -c[0])
        return found

    def put(self, query: SemanticQuery, value: object, value_nbytes: int) -> None:
        nbytes = value_nbytes + query.embedding.nbytes + 4 * len(query.question) + ENTRY_OVERHEAD_BYTES
        if nbytes > self.max_bytes:
            return
        with self._lock:
            self._ids += 1
            self._entries[self._ids] = _Entry(query, value, nbytes, self.clock())
            self._by_key.setdefault(query.exact_key, set()).add(self._ids)
            self.nbytes += nbytes
            while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
                self._drop(next(iter(self._entries)))

    def check_invariants(self) -> None:
        """For tests: the bounds hold, the byte count is the entries' sum, and the per-key index
        names exactly the live entries."""
        with self._lock:
            assert len(self._entries) <= self.max_entries and self.nbytes <= self.max_bytes
            assert self.nbytes == sum(e.nbytes for e in self._entries.values())
            assert sorted(i for ids in self._by_key.values() for i in ids) == sorted(self._entries)
            assert all(self._by_key.values())

    def _drop(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self.nbytes -= entry.nbytes
        ids = self._by_key[entry.query.exact_key]
        ids.discard(entry_id)
        if not ids:
            del self._by_key[entry.query.exact_key]
