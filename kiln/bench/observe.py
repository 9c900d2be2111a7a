"""What the server saw during a level: queue depth and running requests sampled while it runs,
the batch-size distribution, and the server's own mean TTFT to check the client's against."""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from typing import Awaitable, Callable

from kiln.bench.scrape import (BATCH_SIZE, REFUSED, REFUSED_UNNEEDED, RUNNING, SPEC_ACCEPTED, SPEC_PROPOSED, TTFT,
                               WAITING, Histogram, MetricsSnapshot, parse_metrics)
from kiln.bench.stats import Distribution

# NOTE: client TTFT includes HTTP and tokenization; a gap under this many seconds is not a disagreement.
TTFT_ABSOLUTE_SLACK = 0.01


@dataclass(frozen=True)
class ServerView:
    source: str                            # "/metrics" or "engine (sampled)"
    queue_depth: Distribution | None       # requests waiting, sampled every interval
    running: Distribution | None           # requests running, sampled every interval
    batch_size: Distribution | None        # per engine step (from a histogram: percentiles are bucket bounds)
    server_ttft_mean: float | None
    # speculative decoding during the level: tokens proposed and accepted (None: not reported)
    speculative_proposed: float | None = None
    speculative_accepted: float | None = None
    # kiln's admission during the level: TTFT refusals, and those it later found unneeded
    admission_refused: float | None = None
    admission_refused_unneeded: float | None = None

    @property
    def acceptance_rate(self) -> float | None:
        if not self.speculative_proposed:
            return None
        return self.speculative_accepted / self.speculative_proposed

    def to_json(self) -> dict:
        return asdict(self)


class Observer:
    """Samples a source every `interval` seconds until stopped."""

    source = "none"

    def __init__(self, interval: float):
        self.interval = interval
        self.waiting: list[float] = []
        self.running: list[float] = []

    async def sample(self) -> None:
        pass

    async def watch(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.sample()
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass
        await self.sample()

    def view(self) -> ServerView | None:
        return None

    def _record(self, waiting: float | None, running: float | None) -> None:
        if waiting is not None:
            self.waiting.append(waiting)
        if running is not None:
            self.running.append(running)

    def _distribution(self, samples: list[float]) -> Distribution | None:
        return Distribution.of(samples) if samples else None


class MetricsObserver(Observer):
    """Scrapes Prometheus text; histograms are differenced between the first and the last scrape."""

    source = "/metrics"

    def __init__(self, scrape: Callable[[], Awaitable[str | None]], interval: float):
        super().__init__(interval)
        self.scrape = scrape
        self.first: MetricsSnapshot | None = None
        self.last: MetricsSnapshot | None = None

    async def sample(self) -> None:
        text = await self.scrape()
        if text is None:
            return
        snap = parse_metrics(text)
        self.first = self.first or snap
        self.last = snap
        self._record(snap.value(WAITING), snap.value(RUNNING))

    def view(self) -> ServerView | None:
        if self.last is None:
            return None
        batch, ttft = self._delta(BATCH_SIZE), self._delta(TTFT)
        return ServerView(self.source, self._distribution(self.waiting), self._distribution(self.running),
                          batch.distribution() if batch and batch.count else None, ttft.mean if ttft else None,
                          self._increase(SPEC_PROPOSED), self._increase(SPEC_ACCEPTED),
                          self._increase(REFUSED), self._increase(REFUSED_UNNEEDED))

    def _increase(self, names: tuple[str, ...]) -> float | None:
        after, before = self.last.value(names), self.first.value(names)
        return None if after is None else after - (before or 0.0)

    def _delta(self, names: tuple[str, ...]) -> Histogram | None:
        after, before = self.last.histogram(names), self.first.histogram(names)
        return after.minus(before) if after and before else after


class EngineObserver(Observer):
    """Reads the in-process engine client's snapshot: queue lengths, and the last step's batch
    size (a sample of steps, not every one). Never the engine core: only the client's thread may."""

    source = "engine (sampled)"

    def __init__(self, client, interval: float):
        super().__init__(interval)
        self.client = client
        self.batch_sizes: list[float] = []
        self._last_step = client.snapshot.steps
        self._speculated = self._speculation()

    def _speculation(self) -> tuple[int, int] | None:
        s = self.client.snapshot
        return (s.speculative_proposed, s.speculative_accepted) if s.speculative else None

    async def sample(self) -> None:
        s = self.client.snapshot
        # NOTE: queue lengths as of the engine's last loop iteration (published when it idles too).
        self._record(s.num_waiting, s.num_running)
        if s.steps != self._last_step:     # a new step since the last sample
            if s.last_batch_size:          # a step that scheduled nothing is no batch
                self.batch_sizes.append(s.last_batch_size)
            self._last_step = s.steps

    def view(self) -> ServerView:
        now, then = self._speculation(), self._speculated
        proposed, accepted = (now[0] - then[0], now[1] - then[1]) if now else (None, None)
        return ServerView(self.source, self._distribution(self.waiting), self._distribution(self.running),
                          self._distribution(self.batch_sizes), None, proposed, accepted)


def ttft_disagreement(client_mean: float | None, view: ServerView | None, threshold: float) -> str | None:
    """A warning when the client's and the server's mean TTFT differ by more than `threshold` (relative)."""
    if client_mean is None or view is None or not view.server_ttft_mean:
        return None
    server = view.server_ttft_mean
    gap = abs(client_mean - server)
    if gap > TTFT_ABSOLUTE_SLACK and gap / server > threshold:
        return (f"client mean TTFT {client_mean * 1e3:.1f} ms vs server {server * 1e3:.1f} ms "
                f"({gap / server:.0%} apart, threshold {threshold:.0%})")
    return None
