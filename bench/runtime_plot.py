"""bench_runtime.py's figure: one panel per metric, one bar per system, kiln's bars apart in colour."""

from __future__ import annotations

from pathlib import Path

from bench.runtime_report import METRICS, Summary

COLORS = {"kiln": "tab:red", "artifact": "tab:red", "genai": "tab:blue", "openvino": "tab:purple", "hf": "tab:gray",
          "llamacpp": "tab:green"}


def plot(summaries: list[Summary], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")                 # NOTE: no display on these machines
    import matplotlib.pyplot as plt

    ok = [s for s in summaries if s.error is None]
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 0.45 * len(ok) + 1.6), sharey=True)
    names = [s.name for s in ok]
    colors = [COLORS[s.system.split(":")[0]] for s in ok]
    for ax, (metric, (label, unit)) in zip(axes, METRICS.items()):
        values = [s.metrics.get(metric, 0.0) for s in ok]
        ax.barh(names, values, color=colors)
        ax.set_title(f"{label} ({unit}{', lower is better' if unit == 'ms' else ''})", fontsize=10)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:,.0f}", va="center", fontsize=8)
        ax.margins(x=0.25)
    axes[0].invert_yaxis()
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
