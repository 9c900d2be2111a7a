"""kiln's runtime side by side with its peers on the same SmolLM2 weights, in one process and one run.

    .venv/bin/python bench/bench_runtime.py            # full run (~10 min on 2 cores)
    .venv/bin/python bench/bench_runtime.py --quick    # smoke run: few tokens, one repetition

Measures, greedy and with exactly N new tokens everywhere, every engine on the same threads:
- single-stream decode tokens/s: kiln vs HF transformers `generate` (fp32) and vs
  onnxruntime-genai at the same precision (fp32, int4);
- 32 concurrent requests, aggregate tokens/s: kiln's in-flight batch vs onnxruntime-genai's
  static batch of 32 (it has no continuous batching on CPU);
- TTFT of a 512-token prompt: kiln vs onnxruntime-genai;
- kiln's Python overhead per decode-only step at batch 32: 1 - time in engine.run / step time.
Prints a table of ratios against the runtime issue's targets and writes bench/results/runtime.json;
where kiln misses a target it profiles where the time goes: ONNX Runtime's per-op-type profile of
kiln's engine next to onnxruntime-genai's for the same step, or cProfile of kiln's Python step.
These are benchmarks, not tests: nothing here asserts on a time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

# NOTE: transformers' GGUF loader draws tqdm bars of its own; tqdm reads this when it is imported.
os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).parent))
from peers import GenAIRunner, HFRunner, build_genai, load_hf_gguf, write_hf_folder  # noqa: E402
from runtime_console import console  # noqa: E402
from runtime_kiln import KilnRunner, ensure_kiln  # noqa: E402
from runtime_profile import profile_misses  # noqa: E402
from runtime_report import agreement, phase_split, print_agreement, print_phases, print_table, rows_for, to_json  # noqa: E402,E501
from runtime_workloads import SIZES, Sizes, make_prompts, measure  # noqa: E402

HERE = Path(__file__).parent


# -- main -----------------------------------------------------------------------------------------

def setup(args, precisions: list[str]) -> tuple[dict, dict, object]:
    """Build or load every model; returns kiln runners, genai runners and the HF model."""
    cache = args.cache
    with console.status("loading SmolLM2 into HF transformers (fp32, from the GGUF)"):
        hf_model, hf_tok = load_hf_gguf()
    hf_dir = write_hf_folder(hf_model, hf_tok, cache / "hf-smollm2")
    kiln, genai = {}, {}
    for p in precisions:
        artifact = ensure_kiln(cache, p)
        with console.status(f"building onnxruntime-genai {p} (its model builder, offline)"):
            genai_dir = build_genai(hf_dir, cache / f"genai-{p}", p, cache / "genai-cache")
        kiln[p] = KilnRunner(artifact, args.threads, p)
        genai[p] = GenAIRunner(genai_dir, args.threads, p)
    return kiln, genai, hf_model


def run_all(args, sizes: Sizes, kiln: dict, genai: dict, hf) -> dict:
    prompts = make_prompts(kiln[next(iter(kiln))].llm.tokenizer, sizes)
    results = {}
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        for p in kiln:
            single = [kiln[p], genai[p]] + ([hf] if p == "fp32" else [])
            results[p] = {
                "single": measure(single, prompts["single"], sizes.decode_tokens, sizes.reps, progress,
                                  f"{p} single stream"),
                "batch": measure([kiln[p], genai[p]], prompts["batch"], sizes.batch_tokens, sizes.reps,
                                 progress, f"{p} 32 streams"),
                "ttft": measure([kiln[p], genai[p]], prompts["ttft"], 1, sizes.reps, progress, f"{p} TTFT 512"),
            }
    return results


def _quiet() -> None:
    """Keep the progress display readable: no per-tensor bars from transformers, no INFO logs."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.getLogger("kiln").setLevel(logging.WARNING)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: few tokens, one repetition")
    ap.add_argument("--precisions", default="fp32,int4", help="comma-separated: fp32, int4 (int8: untried)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads for every engine")
    ap.add_argument("--cache", type=Path, default=HERE / ".cache", help="built models (reused)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "runtime.json")
    ap.add_argument("--profile", choices=("auto", "always", "never"), default="auto",
                    help="profile where kiln's time goes: only for missed targets by default")
    args = ap.parse_args(argv)
    sizes = SIZES["quick" if args.quick else "full"]
    precisions = args.precisions.split(",")
    load_start = os.getloadavg()
    _quiet()
    kiln, genai, hf_model = setup(args, precisions)
    results = run_all(args, sizes, kiln, genai, HFRunner(hf_model, args.threads))
    rows = [row for p in precisions for row in rows_for(p, results[p])]
    load_end = os.getloadavg()
    print_table(rows)
    phases = phase_split(results)
    print_phases(phases)
    print_agreement(agreement(results), sizes.decode_tokens)
    console.print(f"load average (1 min) at start {load_start[0]:.2f}, at end {load_end[0]:.2f} "
                  f"on {os.cpu_count()} CPUs: anything well above 0 means shared cores and noisy figures")
    profiles = {}
    if args.profile != "never":
        cases = {c for r in rows if args.profile == "always" or not r.met for c in r.cases}
        profiles = profile_misses(sorted(cases), kiln, genai, make_prompts(kiln[precisions[0]].llm.tokenizer, sizes))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(to_json(args, sizes, rows, results, (load_start, load_end), profiles), indent=1))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
