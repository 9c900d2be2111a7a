"""PNG figures of a sweep: the knee (throughput against tail latency) and latency CDFs.

matplotlib's Figure is used without pyplot, so no GUI backend or global state is involved (Agg).
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from kiln.bench.session import BenchResult, LevelResult
from kiln.bench.stats import SERVED


def knee_plot(results: list[BenchResult], path: Path) -> Path:
    """Output tokens/s against p99 TTFT and p99 ITL, one line per target, points labelled by level."""
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, key, title in ((axes[0], "ttft", "p99 TTFT"), (axes[1], "itl", "p99 inter-token latency")):
        for result in results:
            _knee_line(ax, result, key)
        ax.set(xlabel="output tokens/s", ylabel=f"{title} (ms)", title=f"{title} vs throughput")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{results[0].config.workload}: where latency turns up (the knee)")
    return _save(fig, path)


def _knee_line(ax, result: BenchResult, key: str) -> None:
    points = [(lv.stats.output_tokens_per_s, getattr(lv.stats, key).p99, lv.level.label)
              for lv in result.levels if getattr(lv.stats, key).p99 is not None]
    if not points:
        return
    xs, ys, labels = zip(*points)
    ax.plot(xs, [y * 1e3 for y in ys], marker="o", label=result.target)
    for x, y, label in points:
        ax.annotate(label, (x, y * 1e3), textcoords="offset points", xytext=(4, 4), fontsize=7)


def cdf_plot(results: list[BenchResult], path: Path) -> Path:
    """Empirical CDFs of TTFT, inter-token latency and e2e latency, one line per level (and target)."""
    fig = Figure(figsize=(14, 4.5), layout="constrained")
    axes = fig.subplots(1, 3)
    for ax, (title, values) in zip(axes, _CDF_PANELS):
        for result in results:
            for lv in result.levels:
                _cdf_line(ax, values(lv), _line_label(result, lv, len(results)))
        ax.set(xlabel=f"{title} (ms)", ylabel="fraction of samples", title=f"{title} CDF", ylim=(0, 1.02))
        _log_if_spread(ax)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    return _save(fig, path)


_CDF_PANELS = [
    ("TTFT", lambda lv: [r.ttft for r in lv.run.records if r.outcome in SERVED and r.ttft is not None]),
    ("inter-token latency", lambda lv: [g for r in lv.run.records if r.outcome in SERVED for g in r.itls]),
    ("e2e latency", lambda lv: [r.e2e for r in lv.run.records if r.e2e is not None]),
]


def _cdf_line(ax, values: list[float], label: str) -> None:
    if not values:
        return
    xs = sorted(v * 1e3 for v in values)
    ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def _log_if_spread(ax) -> None:
    """Tails over two decades would squash the body of the CDF into the left edge: log x."""
    xs = [x for line in ax.lines for x in line.get_xdata() if x > 0]
    if xs and max(xs) / min(xs) > 100:
        ax.set_xscale("log")


def _line_label(result: BenchResult, lv: LevelResult, num_targets: int) -> str:
    return lv.level.label if num_targets == 1 else f"{result.target}: {lv.level.label}"


def _save(fig: Figure, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
