"""Engine backends side by side under kiln's own runtime, interleaved in one process.

    .venv/bin/python -m bench.bench_engine_backends ART [ART ...] [--reps 3] [--threads 2]

Each ARTIFACT (any backend: ort, openvino) runs bench_runtime's workloads (TTFT of a 512-token
prompt; single stream, 13-token prompt + 128 greedy tokens, decode tok/s after the first token;
32 distinct 13-token prompts together, end-to-end tok/s) through the same KilnRunner. Repetitions
are interleaved across artifacts so a machine that slows down mid-run hurts all of them alike;
medians and ratios to the first artifact are printed. Check `uptime` first: on a loaded machine
OpenVINO's pinned threads suffer more than ONNX Runtime's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


from bench.runtime_kiln import KilnRunner
from bench.runtime_workloads import SIZES, make_prompts, median, new_tokens

from kiln.tokenizer import Tokenizer

WORKLOADS = {"ttft": ("TTFT 512", "ms"), "single": ("1 stream", "tok/s"), "32-way": ("32-way", "tok/s")}


def figure(workload: str, run, n_prompts: int) -> float:
    if workload == "ttft":
        return run.first_token_s * 1000
    return run.decode_tokens_per_s() if workload == "single" else run.aggregate_tokens_per_s()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifacts", nargs="+", type=Path)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sizes = SIZES["full"]
    prompts = make_prompts(Tokenizer(args.artifacts[0] / "tokenizer"), sizes)
    runners = [KilnRunner(a, args.threads, a.name) for a in args.artifacts]
    results = {r.name: {} for r in runners}
    for workload in WORKLOADS:
        batch, n = prompts[workload], new_tokens(sizes, workload)
        for r in runners:
            r.generate(batch, n)                               # warm-up
        runs = {r.name: [] for r in runners}
        for _ in range(args.reps):
            for r in runners:
                runs[r.name].append(figure(workload, r.generate(batch, n), len(batch)))
        for r in runners:
            results[r.name][workload] = median(runs[r.name])
        _print(workload, runners, results, runs)
    print(json.dumps(results))


def _print(workload, runners, results, runs) -> None:
    label, unit = WORKLOADS[workload]
    base = results[runners[0].name][workload]
    for r in runners:
        value = results[r.name][workload]
        ratio = base / value if unit == "ms" else value / base
        print(f"{label:9s} {r.name:32s} {value:8.1f} {unit:5s} x{ratio:5.2f} of first  "
              f"runs {[round(v, 1) for v in runs[r.name]]}", flush=True)


if __name__ == "__main__":
    main()
