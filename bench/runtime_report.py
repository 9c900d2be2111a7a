"""bench_runtime.py's results: the ratio rows against the targets, tables, agreement and JSON."""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass

from peers import Run
from rich.table import Table
from runtime_console import console
from runtime_kiln import KilnRun
from runtime_workloads import Sizes, median


@dataclass
class Row:
    metric: str
    kiln: float
    peer_name: str
    peer: float | None
    unit: str                     # "tok/s", "ms" or "%"
    target: float                 # on the ratio kiln/peer, or on kiln's value where there is no peer
    higher_is_better: bool
    cases: tuple                  # ((precision, batch, phase), ...): what to profile if it misses

    @property
    def ratio(self) -> float | None:
        return self.kiln / self.peer if self.peer else None

    @property
    def met(self) -> bool:
        value = self.ratio if self.peer is not None else self.kiln
        return value >= self.target if self.higher_is_better else value <= self.target


def rows_for(precision: str, results: dict) -> list[Row]:
    k, g = f"kiln {precision}", f"onnxruntime-genai {precision}"
    single, batch, ttft = results["single"], results["batch"], results["ttft"]
    dec, agg = Run.decode_tokens_per_s, Run.aggregate_tokens_per_s
    rows = []
    if "HF transformers" in single:
        rows.append(Row(f"decode tok/s, 1 stream, {precision}", median(single[k], dec), "HF transformers",
                        median(single["HF transformers"], dec), "tok/s", 3.0, True, ((precision, 1, "decode"),)))
    rows += [
        Row(f"decode tok/s, 1 stream, {precision}", median(single[k], dec), g, median(single[g], dec),
            "tok/s", 1.0, True, ((precision, 1, "decode"),)),
        Row(f"aggregate tok/s, 32 streams, {precision}", median(batch[k], agg), g, median(batch[g], agg),
            "tok/s", 1.2, True, ((precision, 32, "prefill"), (precision, 32, "decode"))),
        Row(f"TTFT, 512-token prompt, {precision}", 1e3 * median(ttft[k], lambda r: r.first_token_s), g,
            1e3 * median(ttft[g], lambda r: r.first_token_s), "ms", 1.0, False, ((precision, 1, "prefill"),)),
        Row(f"Python overhead / decode step, B=32, {precision}", 100 * median(batch[k], lambda r: r.decode.overhead),
            "", None, "%", 15.0, False, ((precision, 32, "python"),)),
    ]
    return rows


def print_table(rows: list[Row]) -> None:
    table = Table(title="kiln vs peers (median of repetitions; same weights, greedy, same threads)")
    for col in ("metric", "kiln", "peer", "peer value", "ratio", "target", "met?"):
        table.add_column(col, justify="left" if col in ("metric", "peer") else "right")
    for r in rows:
        ratio = f"{r.ratio:.2f}×" if r.ratio is not None else "—"
        sign = "≥" if r.higher_is_better else "≤"
        target = f"{sign} {r.target:g}%" if r.peer is None else f"{sign} {r.target:g}×"
        met = "[green]yes[/]" if r.met else "[red]no[/]"
        peer_value = _fmt(r.peer, r.unit) if r.peer is not None else "—"
        table.add_row(r.metric, _fmt(r.kiln, r.unit), r.peer_name or "—", peer_value, ratio, target, met)
    console.print(table)


def phase_split(results: dict) -> list[dict]:
    """Where the 32-stream runs' time went: steps that prefill (kiln's also decode the requests
    already prefilled), then decoding alone, per step. Medians over the repetitions."""
    out = []
    for precision, res in results.items():
        for name, runs in res["batch"].items():
            out.append({"precision": precision, "system": name,
                        "prefill_phase_s": statistics.median(_prefill_phase(r) for r in runs),
                        "decode_ms_per_step": statistics.median(_decode_step_ms(r) for r in runs),
                        "total_s": statistics.median(r.total_s for r in runs)})
    return out


def _prefill_phase(r: Run) -> float:
    return r.total_s - r.decode.wall_s if isinstance(r, KilnRun) else r.first_token_s


def _decode_step_ms(r: Run) -> float:
    if isinstance(r, KilnRun):
        return 1e3 * r.decode.wall_s / max(r.decode.steps, 1)
    return 1e3 * (r.total_s - r.first_token_s) / max(len(r.token_ids[0]) - 1, 1)


def print_phases(phases: list[dict]) -> None:
    table = Table(title="32 streams: where each run's time goes (median)")
    for col in ("precision", "system", "prefill phase s", "decode ms/step (B=32)", "total s"):
        table.add_column(col, justify="left" if col in ("precision", "system") else "right")
    for p in phases:
        table.add_row(p["precision"], p["system"], f"{p['prefill_phase_s']:.2f}", f"{p['decode_ms_per_step']:.1f}",
                      f"{p['total_s']:.2f}")
    console.print(table)


def _fmt(value: float, unit: str) -> str:
    return f"{value:.1f} %" if unit == "%" else f"{value:,.1f} {unit}"


def agreement(results: dict) -> dict[str, int]:
    """Single stream: greedy tokens each system shares with the first kiln run before they differ.

    Checks that everyone did the same work; quantized engines may part early (near-ties)."""
    singles = {name: runs[-1].token_ids[0] for res in results.values() for name, runs in res["single"].items()}
    ref = singles[next(n for n in singles if n.startswith("kiln"))]
    return {name: next((i for i, (a, b) in enumerate(zip(ref, toks)) if a != b), min(len(ref), len(toks)))
            for name, toks in singles.items()}


def print_agreement(same: dict[str, int], n: int) -> None:
    ref = next(iter(same))
    parts = ", ".join(f"{name} {k}" for name, k in same.items() if name != ref)
    console.print(f"greedy tokens (of {n}) matching {ref} before the first difference: {parts}")


def to_json(args, sizes: Sizes, rows: list[Row], results: dict, load: tuple, profiles: dict) -> dict:
    def run_dict(r: Run) -> dict:
        d = {"first_token_s": r.first_token_s, "total_s": r.total_s, "new_tokens": sum(map(len, r.token_ids))}
        if isinstance(r, KilnRun):
            d["decode_steps"] = {**asdict(r.decode), "overhead": r.decode.overhead,
                                 "core_overhead": r.decode.core_overhead}
        return d

    return {"mode": "quick" if args.quick else "full", "sizes": asdict(sizes), "threads": args.threads,
            "machine": {"cpus": os.cpu_count(), "load_avg_start": load[0], "load_avg_end": load[1]},
            "rows": [{**asdict(r), "ratio": r.ratio, "met": r.met} for r in rows],
            "runs": {p: {w: {name: [run_dict(r) for r in runs] for name, runs in by.items()}
                         for w, by in res.items()} for p, res in results.items()},
            "greedy_agreement_tokens": agreement(results),
            "unverified_kiln_builds": {p.name: p.read_text() for p in sorted(args.cache.glob("kiln-*.UNVERIFIED"))},
            "batch_phases": phase_split(results),
            "profiles": profiles}
