"""Exact-match cache of finished deterministic generations: LRU, bounded in entries and bytes,
each entry living at most `ttl` seconds. Keys are PreparedRequest.cache_key (prompt ids and
sampling params), so requests that differ only in how they are rendered share an entry."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Hashable

from kiln.serving.flights import Recording


class ResponseCache:
    def __init__(self, max_entries: int, max_bytes: int, ttl: float,
                 clock: Callable[[], float] = time.monotonic):
        self.max_entries, self.max_bytes, self.ttl, self.clock = max_entries, max_bytes, ttl, clock
        self._entries: OrderedDict[Hashable, tuple[float, Recording]] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> Recording | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        stored_at, recording = entry
        if self.clock() - stored_at > self.ttl:
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return recording

    def put(self, key: Hashable, recording: Recording) -> None:
        if recording.nbytes > self.max_bytes:
            return                        # would evict everything else and still not fit
        if key in self._entries:
            self._drop(key)
        self._entries[key] = (self.clock(), recording)
        self.nbytes += recording.nbytes
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: Hashable) -> None:
        _, recording = self._entries.pop(key)
        self.nbytes -= recording.nbytes
