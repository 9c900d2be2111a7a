"""One benchmark: a target, a workload and a sweep of levels; the server watched while each runs."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field

from kiln.bench.loadgen import Level, LevelRun, Limits, run_level
from kiln.bench.observe import ServerView, ttft_disagreement
from kiln.bench.progress import NullProgress
from kiln.bench.records import RequestRecord
from kiln.bench.stats import SLO, Distribution, LevelStats, level_stats
from kiln.bench.text import TextSource, TokenCounter, render
from kiln.bench.workloads import request_specs

TICK_S = 0.2
LAG_WARN_S = 0.025


@dataclass(frozen=True)
class BenchConfig:
    workload: str
    levels: tuple[Level, ...]
    limits: Limits
    seed: int = 0
    slo: SLO = SLO()
    max_tokens: int | None = None        # caps every reply the workload asks for
    metrics_interval: float = 0.5
    ttft_warn: float = 0.25              # relative client/server mean-TTFT gap that earns a warning


@dataclass
class LevelResult:
    run: LevelRun
    stats: LevelStats
    server: ServerView | None
    client_lag: Distribution            # how late the load generator's own event loop ran
    warnings: list[str] = field(default_factory=list)

    @property
    def level(self) -> Level:
        return self.run.level

    def to_json(self) -> dict:
        return {"level": asdict(self.level), "label": self.level.label, "stats": self.stats.to_json(),
                "server": self.server.to_json() if self.server else None,
                "client_lag": asdict(self.client_lag), "warnings": self.warnings,
                "requests": [_record_json(r) for r in self.run.records]}


@dataclass
class BenchResult:
    target: str
    config: BenchConfig
    context_len: int
    exact_prompt_lengths: bool
    levels: list[LevelResult] = field(default_factory=list)

    def to_json(self) -> dict:
        cfg = asdict(self.config)
        return {"target": self.target, "config": cfg, "context_len": self.context_len,
                "exact_prompt_lengths": self.exact_prompt_lengths, "levels": [lv.to_json() for lv in self.levels]}


async def run_bench(target, counter: TokenCounter, config: BenchConfig, progress=NullProgress()) -> BenchResult:
    """Every level of the sweep in order, on one target already prepared (counter from its prepare())."""
    source = TextSource(counter)
    result = BenchResult(target.name, config, target.context_len, counter.exact)
    for level in config.levels:
        result.levels.append(await _run_one(target, source, config, level, progress))
    return result


async def _run_one(target, source: TextSource, config: BenchConfig, level: Level, progress) -> LevelResult:
    specs = request_specs(config.workload, config.seed, target.context_len, config.max_tokens)
    observer, stop = target.observer(config.metrics_interval), asyncio.Event()
    progress.start(level, config.limits.duration)
    watchers = [asyncio.create_task(observer.watch(stop)), asyncio.create_task(_tick(progress, stop))]
    try:
        run = await run_level(target, specs, lambda spec: render(spec, source), level, config.limits,
                              config.seed, progress.record)
    finally:
        stop.set()
        _, lags = await asyncio.gather(*watchers)
        progress.finish()
    stats, view, lag = level_stats(run.records, run.wall_s, config.slo), observer.view(), Distribution.of(lags)
    warnings = [ttft_disagreement(stats.ttft.mean, view, config.ttft_warn), _lag_warning(lag)]
    return LevelResult(run, stats, view, lag, [w for w in warnings if w])


async def _tick(progress, stop: asyncio.Event) -> list[float]:
    """Moves the progress bar; returns how late each tick woke (the client's own event-loop lag)."""
    t0, lags = time.perf_counter(), []
    while not stop.is_set():
        progress.tick(time.perf_counter() - t0)
        before = time.perf_counter()
        try:
            await asyncio.wait_for(stop.wait(), TICK_S)
        except asyncio.TimeoutError:
            lags.append(max(0.0, time.perf_counter() - before - TICK_S))
    return lags


def _lag_warning(lag: Distribution) -> str | None:
    # p95, not p99: with a tick every 0.2 s a short level has few samples, and one GC pause is no trend.
    if lag.p95 is None or lag.p95 <= LAG_WARN_S:
        return None
    return (f"the load generator's event loop ran {lag.p95 * 1e3:.0f} ms late (p95): its timings are "
            "inflated by its own load; use fewer clients or give it a core of its own")


def _record_json(r: RequestRecord) -> dict:
    return {"index": r.index, "prompt_tokens": r.prompt_tokens, "outcome": r.outcome.value,
            "start": round(r.start, 6), "ttft": _round(r.ttft), "e2e": _round(r.e2e),
            "output_tokens": r.output_tokens, "itls": [round(x, 6) for x in r.itls], "error": r.error}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
