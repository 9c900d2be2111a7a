"""Build benchmark for SmolLM2: build time per quant mode, artifact size relative to fp32,
perplexity of each artifact on the fixed text (tests/data/perplexity.txt), and the per-pass report.

    .venv/bin/python -m bench.bench_build [--modes none,int8,int4] [--out bench/.cache/build]

Targets (from the build issue): build <= 120 s per mode; size int8 <= 35 %, int4 <= 22 % of fp32;
perplexity int8 within +1 %, int4 within +10 % of fp32. Printed as ratios, never asserted.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kiln.contract.artifact import EngineArtifact
from kiln.compiler.build import build
from kiln.config import BuildConfig
from kiln.compiler.progress import rich_stage
from kiln.compiler.eval import PERPLEXITY_TEXT, text_token_ids
from kiln.compiler.eval.sequence import artifact_perplexity
from kiln.contract.quant import QuantMode

console = Console()
TARGETS = {"none": (1.0, 0.0), "int8": (0.35, 0.01), "int4": (0.22, 0.10)}   # size ratio, ppl delta


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(mode: str, out_root: Path) -> dict:
    console.rule(f"build --quant {mode}")
    t0 = time.perf_counter()
    path = build(BuildConfig(source="smollm2-135m", out=out_root / mode, quant=QuantMode(mode), force=True),
                 rich_stage)
    seconds = time.perf_counter() - t0
    art = EngineArtifact.load(path)
    ids = text_token_ids(art.tokenizer_dir, PERPLEXITY_TEXT)
    with console.status("perplexity …"):
        ppl = artifact_perplexity(art, ids)
    return {"mode": mode, "build_seconds": seconds, "bytes": folder_bytes(path), "perplexity": ppl,
            "tokens": len(ids), "passes": art.manifest.passes}


def summary_table(results: list[dict]) -> Table:
    base = next(r for r in results if r["mode"] == "none")
    t = Table(title=f"SmolLM2-135M builds (perplexity over {base['tokens']} tokens)")
    for col in ("quant", "build s", "size MB", "size / fp32", "target", "perplexity", "Δ ppl", "target"):
        t.add_column(col, justify="right")
    for r in results:
        size_target, ppl_target = TARGETS[r["mode"]]
        ratio, delta = r["bytes"] / base["bytes"], r["perplexity"] / base["perplexity"] - 1
        t.add_row(r["mode"], f"{r['build_seconds']:.0f}", f"{r['bytes'] / 1e6:.1f}", f"{ratio:.3f}",
                  f"≤ {size_target:.2f}", f"{r['perplexity']:.3f}", f"{delta:+.2%}", f"≤ {ppl_target:+.0%}")
    return t


def pass_table(result: dict) -> Table:
    t = Table(title=f"passes, --quant {result['mode']}")
    for col in ("pass", "nodes before", "nodes after", "seconds", "max abs err", "max rel err", "tolerance"):
        t.add_column(col, justify="right")
    for p in result["passes"]:
        fmt = (lambda x: "-" if x is None else f"{x:.2e}")
        t.add_row(p["name"], str(p["nodes_before"]), str(p["nodes_after"]), f"{p['seconds']:.1f}",
                  fmt(p["max_abs_error"]), fmt(p["max_rel_error"]), fmt(p["tolerance"]))
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="none,int8,int4")
    ap.add_argument("--out", type=Path, default=Path("bench/.cache/build"))
    ap.add_argument("--json", type=Path, default=Path("bench/results/build.json"))
    args = ap.parse_args()
    modes = args.modes.split(",")
    if "none" not in modes:
        modes.insert(0, "none")      # ratios are against fp32 measured in the same run
    results = [measure(m, args.out) for m in modes]
    console.print(summary_table(results))
    for r in results:
        console.print(pass_table(r))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
