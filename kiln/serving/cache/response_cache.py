"""Exact-match cache of finished deterministic generations: LRU, bounded in entries and bytes,
each entry living at most `ttl` seconds. Keys are PreparedRequest.cache_key (prompt ids and
sampling params), so requests that differ only in how they are rendered share an entry."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Hashable

from kiln.serving.traffic.flights import Recording

# A rough size of what a key holds beside its prompt ids: the sampling params' own fields, and a
# compiled constraint's matcher (its grammar and token masks), which the key keeps alive.
PARAMS_BYTES = 400
COMPILED_CONSTRAINT_BYTES = 64 << 10


def key_nbytes(key) -> int:
    """What a cache key costs to hold: (prompt ids, SamplingParams) keys count their ids and their
    params (stop strings, logit bias, a constraint's source and compiled matcher); any other key 200."""
    if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], tuple)):
        return 200
    ids, params = key
    n = 64 + 8 * len(ids) + PARAMS_BYTES
    n += sum(50 + 4 * len(s) for s in getattr(params, "stop", ()) or ())
    n += 40 * len(getattr(params, "logit_bias", ()) or ())
    structured = getattr(params, "structured", None)
    if structured is not None:
        n += 100 + 4 * len(structured.source)
        if structured.compiled is not None:
            n += COMPILED_CONSTRAINT_BYTES + 16 * len(structured.source)
    return n


class ResponseCache:
    def __init__(self, max_entries: int, max_bytes: int, ttl: float,
                 clock: Callable[[], float] = time.monotonic):
        self.max_entries, self.max_bytes, self.ttl, self.clock = max_entries, max_bytes, ttl, clock
        self._entries: OrderedDict[Hashable, tuple[float, Recording, int]] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> Recording | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        stored_at, recording, _ = entry
        if self.clock() - stored_at > self.ttl:
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return recording

    def put(self, key: Hashable, recording: Recording) -> None:
        nbytes = recording.nbytes + key_nbytes(key)      # the key (prompt ids, a matcher) counts too
        if nbytes > self.max_bytes:
            return                        # would evict everything else and still not fit
        if key in self._entries:
            self._drop(key)
        self._entries[key] = (self.clock(), recording, nbytes)
        self.nbytes += nbytes
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: Hashable) -> None:
        _, _, nbytes = self._entries.pop(key)
        self.nbytes -= nbytes
