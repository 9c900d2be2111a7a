"""kiln's runtime side by side with its peers on the same SmolLM2 weights, in one run.

    .venv/bin/python -m bench.bench_runtime            # full run
    .venv/bin/python -m bench.bench_runtime --quick    # smoke run: few tokens, one repetition

Systems: kiln (each `--kiln BACKEND:QUANT`), ONNX Runtime GenAI (`--genai`), OpenVINO GenAI
(`--openvino`, in its own environment made by bench/setup_peers.sh) and HF transformers fp32.
Each runs in a process of its own (runtime_worker.py), one after another, on the same threads,
greedy, exactly N new tokens, the same token ids. Workloads: TTFT of a 512-token prompt;
single-stream decode tokens/s (13-token prompt); 8-way and 32-way end-to-end tokens/s (distinct
13-token prompts submitted together, prefill included); the greedy chat answer to
runtime_workloads.QUESTION, and whether it names ANSWER. Prints every system's medians, the
engine-speed issue's ratios with target met/missed, writes bench/results/runtime.json and
runtime.png, and, where kiln misses a target, profiles where its time goes (runtime_profile.py).
Benchmarks, not tests: nothing asserts a time.

`--rounds N` runs the whole sequence N times, every other round in reverse order, and takes each
system's medians over all its rounds' repetitions; it also prints each target's ratio round by
round. This machine's speed drifts over minutes (a peer's 32-way figure moved 787-948 tok/s
between runs an hour apart), so one pass can put a ratio on either side of its target.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.runtime_console import console
from bench.runtime_plot import plot
from bench.runtime_report import (agreement, print_agreement, print_systems, print_targets, summarize,
                            target_rows, to_json)
from bench.runtime_workloads import SIZES, make_prompts

from kiln.tokenizer import Tokenizer

HERE = Path(__file__).parent
PEER_VENV = HERE / ".cache" / "venv-openvino"


def systems(args) -> list[str]:
    """The system specs of this run, in the order they run."""
    specs = [f"kiln:{k}" for k in _split(args.kiln)]
    specs += [f"genai:{q}" for q in _split(args.genai)] + [f"openvino:{q}" for q in _split(args.openvino)]
    return specs + (["hf:fp32"] if args.hf else [])


def _split(csv: str) -> list[str]:
    return [x.strip() for x in csv.split(",") if x.strip()]


def write_plan(args, sizes, hf_dir: Path) -> tuple[Path, Tokenizer]:
    """What every worker reads: sizes, threads, cache, and the prompts as kiln's token ids."""
    tokenizer = Tokenizer(hf_dir)
    plan = {"sizes": {**sizes.__dict__, "ways": list(sizes.ways)}, "threads": args.threads,
            "cache": str(args.cache.resolve()), "hf_dir": str(hf_dir.resolve()), "reuse_kiln": args.reuse_kiln,
            "prompts": make_prompts(tokenizer, sizes)}
    path = args.cache / "runtime-plan.json"
    path.write_text(json.dumps(plan))
    return path, tokenizer


def ensure_hf_dir(cache: Path) -> Path:
    """The plain HF folder (from the GGUF) the peers' builders read and the tokenizer comes from."""
    out = cache / "hf-smollm2"
    if not (out / "config.json").is_file():
        with console.status("writing SmolLM2 as a plain HF folder (from the GGUF, once)"):
            code = f"from bench import peers; import pathlib; peers.ensure_hf_folder(pathlib.Path({str(out)!r}))"
            subprocess.run([sys.executable, "-c", code], check=True)
    return out


def peer_python(spec: str) -> str:
    """The interpreter a system's worker runs in: OpenVINO GenAI's own environment, made on demand."""
    if not spec.startswith("openvino:"):
        return sys.executable
    if not hasattr(peer_python, "ready"):
        with console.status("checking the OpenVINO GenAI environment (bench/setup_peers.sh)"):
            subprocess.run(["bash", str(HERE / "setup_peers.sh")], check=True)
        peer_python.ready = True
    return str(PEER_VENV / "bin" / "python")


def run_system(spec: str, plan: Path, cache: Path, setup_only: bool = False) -> dict:
    out = cache / f"runtime-result-{spec.replace(':', '-')}.json"
    out.unlink(missing_ok=True)
    cmd = [peer_python(spec), "-m", "bench.runtime_worker", spec, "--plan", str(plan), "--out", str(out),
           *(["--setup-only"] if setup_only else [])]
    done = subprocess.run(cmd, env={**os.environ, "TQDM_DISABLE": "1"})
    if done.returncode != 0 or not out.is_file():
        return {"system": spec, "error": f"worker exited {done.returncode}"}
    return json.loads(out.read_text())


def merge_rounds(rounds: list[dict]) -> dict:
    """One worker result from several rounds' results: every workload's repetitions pooled (the
    summary's medians then run over all of them); a failed round fails the system."""
    failed = next((r for r in rounds if "error" in r), None)
    if failed is not None:
        return failed
    merged = {**rounds[0], "runs": {w: list(rs) for w, rs in rounds[0].get("runs", {}).items()}}
    for r in rounds[1:]:
        for workload, reps in r["runs"].items():
            merged["runs"].setdefault(workload, []).extend(reps)
    return merged


def print_round_ratios(specs: list[str], rounds: dict[str, list[dict]], tokenizer) -> None:
    per_round = [target_rows([summarize(rounds[s][i], tokenizer) for s in specs]) for i in range(len(rounds[specs[0]]))]
    if len({len(rows) for rows in per_round}) != 1:
        return          # a system failed in some round: its rows do not line up
    for rows in zip(*per_round):
        ratios = [r.ratio for r in rows]
        if all(x is not None for x in ratios):
            console.print(f"{rows[0].metric}, {rows[0].kiln_name} / {rows[0].peer_name} by round: "
                          + " ".join(f"{x:.2f}×" for x in ratios))


def profile(args, rows, plan: Path) -> dict:
    """Per-op profiles of kiln's engine (next to onnxruntime-genai's where it is the peer), in a process of its own."""
    cases = sorted({c for r in rows if args.profile == "always" or r.met is False for c in r.cases
                    if c[0].startswith("kiln:ort:")}, key=str)
    if args.profile == "never" or not cases:
        return {}
    out = args.cache / "runtime-profiles.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.runtime_profile", "--plan", str(plan), "--cases", json.dumps(cases),
           "--out", str(out)]
    done = subprocess.run(cmd, env={**os.environ, "TQDM_DISABLE": "1"})
    return json.loads(out.read_text()) if done.returncode == 0 and out.is_file() else {"error": done.returncode}


def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: few tokens, one repetition")
    ap.add_argument("--kiln", default="ort:int4,ort:int8,ort:fp32,openvino:int8,openvino:int4",
                    help="kiln artifacts as BACKEND:QUANT[+PREFILL][@ATTENTION], comma-separated "
                         "(e.g. ort:int8,ort:int8+w8a8@gqa,openvino:int8)")
    ap.add_argument("--genai", default="int4,fp32", help="onnxruntime-genai precisions ('' for none)")
    ap.add_argument("--openvino", default="int8,int4,fp32", help="OpenVINO GenAI precisions ('' for none)")
    ap.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True, help="HF transformers fp32")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads for every system")
    ap.add_argument("--cache", type=Path, default=HERE / ".cache", help="built models (reused)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "runtime.json")
    ap.add_argument("--plot", type=Path, default=HERE / "results" / "runtime.png")
    ap.add_argument("--reuse-kiln", action="store_true",
                    help="take the newest cached kiln artifacts even if kiln's build code changed since (smoke runs)")
    ap.add_argument("--setup-only", action="store_true",
                    help="build and export every system's model into the cache, measure nothing")
    ap.add_argument("--profile", choices=("auto", "always", "never"), default="auto",
                    help="profile where kiln's time goes: only for missed targets by default")
    ap.add_argument("--journal", default=None,
                    help="the docs/results/ entry that tells this run's story (bench/render_results.py links it)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every system this many times (alternating order) and pool the repetitions")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    sizes = SIZES["quick" if args.quick else "full"]
    args.cache.mkdir(parents=True, exist_ok=True)
    plan, tokenizer = write_plan(args, sizes, ensure_hf_dir(args.cache))
    specs, load_start, rounds = systems(args), os.getloadavg(), {}
    for round_no in range(1 if args.setup_only else max(args.rounds, 1)):
        order = specs if round_no % 2 == 0 else specs[::-1]
        for i, spec in enumerate(order, 1):
            label = f" (round {round_no + 1}/{args.rounds})" if args.rounds > 1 else ""
            console.rule(f"[{i}/{len(specs)}] {spec}{label}")
            rounds.setdefault(spec, []).append(run_system(spec, plan, args.cache, args.setup_only))
    results = {spec: merge_rounds(rs) for spec, rs in rounds.items()}
    if args.setup_only:
        for spec, r in results.items():
            console.print(f"{spec}: " + (r["error"] if "error" in r else f"ready (setup {r['setup_s']:.0f} s)"))
        return
    load_end = os.getloadavg()
    summaries = [summarize(results[s], tokenizer) for s in specs]
    rows = target_rows(summaries)
    print_systems(summaries)
    print_targets(rows)
    if args.rounds > 1:
        print_round_ratios(specs, rounds, tokenizer)
    same = agreement(summaries)
    if same:
        print_agreement(same, sizes.decode_tokens)
    console.print(f"load average (1 min) at start {load_start[0]:.2f}, at end {load_end[0]:.2f} "
                  f"on {os.cpu_count()} CPUs: anything well above 0 means shared cores and noisy figures")
    profiles = profile(args, rows, plan)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(to_json(args, sizes, summaries, rows, results, (load_start, load_end),
                                           profiles), indent=1))
    title = f"kiln vs peers, SmolLM2-135M, {args.threads} threads{' (quick)' if args.quick else ''}"
    console.print(f"wrote {args.out} and {plot(summaries, args.plot, title)}")


if __name__ == "__main__":
    main()
