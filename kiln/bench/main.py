"""`kiln bench`: choose the target, run the sweep, print the tables, write JSON and plots."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Callable

from rich.console import Console

from kiln.bench.loadgen import Level, Limits
from kiln.bench.progress import RichProgress
from kiln.bench.report import render_tables, to_finite
from kiln.bench.session import BenchConfig, BenchResult, run_bench
from kiln.bench.stats import SLO
from kiln.bench.workloads import WORKLOADS


def parse_levels(concurrency: str | None, rate: str | None) -> tuple[Level, ...]:
    """'1,4,16' as concurrency levels, or as Poisson rates (req/s); concurrency 1 when neither is given."""
    if concurrency and rate:
        raise ValueError("give --concurrency or --rate, not both")
    if rate:
        return tuple(Level(rate=float(x)) for x in rate.split(","))
    return tuple(Level(concurrency=int(x)) for x in (concurrency or "1").split(","))


def bench_config(workload: str, concurrency: str | None, rate: str | None, duration: float, timeout: float,
                 max_requests: int | None, seed: int, max_tokens: int | None, slo_ttft: float | None,
                 slo_itl: float | None, slo_e2e: float | None, metrics_interval: float,
                 ttft_warn: float) -> BenchConfig:
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    return BenchConfig(workload, parse_levels(concurrency, rate), Limits(duration, timeout, max_requests),
                       seed, SLO(slo_ttft, slo_itl, slo_e2e), max_tokens, metrics_interval, ttft_warn)


def bench_url(url: str, config: BenchConfig, console: Console, *, endpoint: str = "chat",
              temperature: float = 1.0, tokenizer: str | None = None, model: str | None = None,
              api_key: str | None = None, allow_remote: bool = False) -> BenchResult:
    import httpx

    from kiln.bench.target_http import HttpTarget, TargetError, check_loopback

    if not allow_remote:
        check_loopback(url)

    async def go():
        target = HttpTarget(url, endpoint, model, temperature, api_key)
        try:
            try:
                counter = await target.prepare(tokenizer)
            except (httpx.HTTPError, TargetError) as e:
                raise ValueError(f"{url} is not an OpenAI-compatible server I can use: {e}") from None
            return await _sweep(target, counter, config, console)
        finally:
            await target.close()
    return asyncio.run(go())


def bench_engine(artifact: Path, runtime_config, config: BenchConfig, console: Console, *,
                 endpoint: str = "chat", temperature: float = 1.0) -> BenchResult:
    from kiln.bench.target_engine import EngineTarget

    target = EngineTarget.load(artifact, runtime_config, endpoint=endpoint, temperature=temperature)
    console.print(f"[dim]{target.llm.core.plan.describe()}[/]")

    async def go():
        try:
            return await _sweep(target, await target.prepare(), config, console)
        finally:
            await target.close()
    return asyncio.run(go())


def bench_compare(artifact: Path, runtime_config, hf_model: str | None, genai_model: Path | None,
                  config: BenchConfig, console: Console, *, endpoint: str = "chat",
                  temperature: float = 1.0) -> list[BenchResult]:
    from kiln.bench.compare import run_compare
    from kiln.bench.target_engine import EngineTarget

    kiln = EngineTarget.load(artifact, runtime_config, endpoint=endpoint, temperature=temperature)
    return run_compare(kiln, hf_model, genai_model, config, runtime_config.threads, lambda t: RichProgress(console))


async def _sweep(target, counter, config: BenchConfig, console: Console) -> BenchResult:
    progress = RichProgress(console)
    try:
        return await run_bench(target, counter, config, progress)
    finally:
        progress.close()


def publish(results: list[BenchResult], out: Console, json_path: Path | None = None,
            plot: Path | None = None, cdf_plot: Path | None = None, log: Callable[[str], None] = print) -> None:
    """Tables on `out`; JSON ({"runs": [...], "ratios": [...]}) and PNGs where asked."""
    for result in results:
        out.print(render_tables(result))
    ratios = []
    for peer in results[1:]:             # a comparison: results[0] is kiln
        from kiln.bench.compare import ratio_table, ratios_json

        out.print(ratio_table(results[0], peer))
        ratios += ratios_json(results[0], peer)
    if json_path:
        doc = {"runs": [r.to_json() for r in results], "ratios": ratios}
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(to_finite(doc), indent=1, allow_nan=False))
        log(f"wrote {json_path}")
    _plots(results, plot, cdf_plot, log)


def _plots(results: list[BenchResult], plot: Path | None, cdf_plot: Path | None, log) -> None:
    if not (plot or cdf_plot):
        return
    from kiln.bench.plots import cdf_plot as draw_cdf
    from kiln.bench.plots import knee_plot

    if plot:
        log(f"wrote {knee_plot(results, plot)}")
    if cdf_plot:
        log(f"wrote {draw_cdf(results, cdf_plot)}")

