"""The sweep as two rich tables: latency percentiles; throughput, goodput, failures and what the
server saw."""

from __future__ import annotations

import math

from rich.console import Group
from rich.table import Table

from kiln.bench.session import BenchResult, LevelResult
from kiln.bench.stats import Distribution

LATENCIES = [("TTFT", "ttft"), ("ITL", "itl"), ("TPOT", "tpot"), ("e2e", "e2e")]


def render_tables(result: BenchResult) -> Group:
    return Group(_latency_table(result), _throughput_table(result), *_warnings(result))


def _latency_table(result: BenchResult) -> Table:
    t = Table(title=f"{result.config.workload} on {result.target}: latency, ms (p50 / p95 / p99 / max)")
    t.add_column("level")
    for name, _ in LATENCIES:
        t.add_column(name, justify="right")
    for lv in result.levels:
        t.add_row(lv.level.label, *(_ms(getattr(lv.stats, key)) for _, key in LATENCIES))
    return t


def _throughput_table(result: BenchResult) -> Table:
    t = Table(title="throughput, failures and the server's view")
    for name in ["level", "requests", "req/s", "out tok/s", "goodput req/s", "timeouts", "errors",
                 "cancelled", "queue p50/max", "batch mean/p95", "spec accepted"]:
        t.add_column(name, justify="left" if name == "level" else "right")
    for lv in result.levels:
        s = lv.stats
        t.add_row(lv.level.label, str(s.num_requests), f"{s.requests_per_s:.2f}", f"{s.output_tokens_per_s:.1f}",
                  _goodput(lv), f"{s.timeout_rate:.1%}", f"{s.error_rate:.1%}", str(s.outcomes["cancelled"]),
                  *_server_cells(lv))
    return t


def _goodput(lv: LevelResult) -> str:
    s = lv.stats
    return "—" if s.goodput is None else f"{s.goodput:.2f} ({s.slo_attainment:.0%})"


def _server_cells(lv: LevelResult) -> tuple[str, str, str]:
    v = lv.server
    queue = v.queue_depth if v else None
    batch = v.batch_size if v else None
    rate = v.acceptance_rate if v else None
    return (f"{queue.p50:g} / {queue.max:g}" if queue else "—",
            f"{batch.mean:.1f} / {batch.p95:g}" if batch else "—",
            f"{v.speculative_accepted:.0f}/{v.speculative_proposed:.0f} ({rate:.0%})" if rate is not None else "—")


def _ms(d: Distribution) -> str:
    if not d.n:
        return "—"
    return " / ".join(f"{x * 1e3:.0f}" if x >= 0.01 else f"{x * 1e3:.1f}" for x in (d.p50, d.p95, d.p99, d.max))


def _warnings(result: BenchResult) -> list[str]:
    lines = [f"[yellow]warning[/] {lv.level.label}: {w}" for lv in result.levels for w in lv.warnings]
    for lv in result.levels:
        lines += [f"[red]{lv.level.label}[/]: {n} × {msg}" for msg, n in lv.stats.top_errors.items()]
        if lv.server and lv.server.admission_refused:
            lines.append(f"{lv.level.label}: the server's admission refused {lv.server.admission_refused:.0f} "
                         f"for their predicted TTFT, {lv.server.admission_refused_unneeded or 0:.0f} of them "
                         "unneeded (the next admitted request's first token came within the bound)")
    if not result.exact_prompt_lengths:
        lines.append("[dim]prompt lengths are estimates (calibrated chars/token); --tokenizer makes them exact[/]")
    return lines


def to_finite(x):
    """inf (a histogram's +Inf bucket) and nan have no JSON spelling: null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: to_finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_finite(v) for v in x]
    return x
