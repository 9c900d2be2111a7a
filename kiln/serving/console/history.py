"""A few minutes of dashboard points, sampled from the server's registry once a period.

The sampler is an asyncio task on the server's loop, started by the first viewer (a server nobody
watches samples nothing) and kept afterwards, so a reloaded page finds its history. Viewers wait
for the next point on one shared event; each point is computed once, whoever watches.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from kiln.serving.console.stats import Scrape, point, scrape

PERIOD_S = 1.0
HISTORY_POINTS = 300          # five minutes at one point a second
WINDOW_PERIODS = 10           # percentiles and hit rates over the last ten seconds

log = logging.getLogger("kiln.serving.console")


class StatsHistory:
    def __init__(self, registry, period: float = PERIOD_S, points: int = HISTORY_POINTS,
                 window: int = WINDOW_PERIODS):
        self.registry, self.period, self.window = registry, period, window
        self.points: deque[dict] = deque(maxlen=points)
        self._scrapes: deque[Scrape] = deque(maxlen=window + 1)
        self._count = 0                   # points taken so far (a point's sequence number + 1)
        self._task: asyncio.Task | None = None
        self._changed: asyncio.Event | None = None

    def ensure_sampling(self) -> None:
        """Start the sampler on the running loop (once)."""
        if self._task is None or self._task.done():
            self._changed = asyncio.Event()
            self.take()
            self._task = asyncio.create_task(self._sample_forever())

    def take(self, now: float | None = None) -> dict | None:
        """Scrape once; returns the new point (None for the very first scrape, which has no past)."""
        s = scrape(self.registry, now)
        self._scrapes.append(s)
        if len(self._scrapes) < 2:
            return None
        p = point(s, self._scrapes[-2], self._scrapes[0])
        self.points.append(p)
        self._count += 1
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()
        return p

    def since(self, count: int) -> tuple[list[dict], int]:
        """Points taken after the first `count` (those still held), and the count to ask with next."""
        missed = min(self._count - count, len(self.points))
        return (list(self.points)[len(self.points) - missed:] if missed > 0 else []), self._count

    async def wait(self, count: int) -> tuple[list[dict], int]:
        """Like since(), waiting for at least one new point first."""
        while self._count <= count:
            await self._changed.wait()
        return self.since(count)

    async def _sample_forever(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            try:
                self.take()
            except Exception:          # a collector that fails once must not end the dashboard
                log.exception("console: sampling the metrics failed; trying again next period")
