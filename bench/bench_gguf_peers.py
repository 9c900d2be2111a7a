"""kiln built from a GGUF file as published, side by side with llama.cpp on that same file.

    .venv/bin/python -m bench.bench_gguf_peers                       # both models, one round
    .venv/bin/python -m bench.bench_gguf_peers --models gemma3 --rounds 2
    .venv/bin/python -m bench.bench_gguf_peers --quick               # smoke run

Models: `smollm2`, the registry's SmolLM2-135M-Instruct Q4_1 file (what the smollm2-135m preset
builds from); `gemma3`, a Gemma 3 with google/gemma-3-270m's shapes and random weights (no Gemma 3
file ships in a package here), written in f16 by gguf_models.py and quantized by llama.cpp's own
quantizer with its Q4_K_M recipe (Q4_K, Q5_0, Q6_K and Q8_0 tensors, as the published 270M file).

kiln: `kiln build FILE` with no flags, whatever that chooses on this machine (printed), and with
`--quant int4` (`--kiln`: the builds, "auto" for no flags). llama.cpp:
llama-cpp-python compiled for this CPU in its own environment (bench/setup_llamacpp.sh, ~10 min
once), stepped as its batched example steps. Each system runs in a process of its own
(runtime_worker.py), one at a time, on the same threads, greedy, exactly N new tokens, on the same
token ids (kiln's tokenization of the file's vocabulary); the workloads are bench_runtime.py's.
Prints each model's table and kiln / llama.cpp ratios (by round too), writes
bench/results/gguf_peers.json and one figure per model. A benchmark: nothing asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.bench_runtime import merge_rounds
from bench.runtime_console import console
from bench.runtime_kiln import _build_code_hash
from bench.runtime_plot import plot
from bench.runtime_report import METRICS, print_systems, summarize
from bench.runtime_workloads import ANSWER, QUESTION, SIZES, make_prompts

from kiln.tokenizer import Tokenizer

HERE = Path(__file__).parent
LLAMA_VENV = HERE / ".cache" / "venv-llamacpp"


def ensure_gguf(model: str, cache: Path) -> Path:
    from kiln.compiler.export.presets import smollm2_gguf_path

    if model == "smollm2":
        return smollm2_gguf_path()
    from bench.gguf_models import write_gemma3_270m_shape

    out = cache / "gguf" / "gemma3-270m-shape.Q4_K_M.gguf"
    if out.is_file():
        return out
    with console.status("writing a Gemma 3 of 270M's shapes (f16), then llama.cpp's Q4_K_M of it"):
        f16 = write_gemma3_270m_shape(cache / "gguf" / "gemma3-270m-shape.f16.gguf", smollm2_gguf_path())
        tmp = out.with_name(out.name + ".tmp")
        subprocess.run([llama_python(), "-m", "bench.peer_llamacpp", "quantize", str(f16), str(tmp), "Q4_K_M"], check=True)
        tmp.rename(out)
    return out


def llama_python() -> str:
    if not hasattr(llama_python, "ready"):
        with console.status("checking llama.cpp's environment (bench/setup_llamacpp.sh)"):
            subprocess.run(["bash", str(HERE / "setup_llamacpp.sh")], check=True)
        llama_python.ready = True
    return str(LLAMA_VENV / "bin" / "python")


def ensure_kiln(gguf: Path, model: str, quant: str, cache: Path) -> Path:
    """`kiln build FILE` with no flags (quant "auto") or with `--quant QUANT`, rebuilt when kiln's
    build code changes."""
    out = cache / f"kiln-gguf-{model}-{quant}-{_build_code_hash()}"
    if (out / "manifest.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    # NOTE: the CLI of this interpreter's kiln (a checkout on PYTHONPATH included), not whatever `kiln` is on PATH
    cli = [sys.executable, "-c", "from kiln.cli import main; main()"]
    flags = [] if quant == "auto" else ["--quant", quant]
    subprocess.run([*cli, "build", str(gguf), "--out", str(tmp), *flags], check=True)
    tmp.rename(out)
    return out


def run_worker(python: str, spec: str, plan: Path, out: Path) -> dict:
    out.unlink(missing_ok=True)
    cmd = [python, "-m", "bench.runtime_worker", spec, "--plan", str(plan), "--out", str(out)]
    done = subprocess.run(cmd, env={**os.environ, "TQDM_DISABLE": "1"})
    if done.returncode != 0 or not out.is_file():
        return {"system": spec, "error": f"worker exited {done.returncode}"}
    return json.loads(out.read_text())


def measure_model(model: str, args, sizes) -> dict:
    gguf = ensure_gguf(model, args.cache)
    artifacts = [ensure_kiln(gguf, model, quant, args.cache) for quant in _split(args.kiln)]
    for artifact in artifacts:
        c = json.loads((artifact / "manifest.json").read_text())["choices"]
        console.print(f"{model}: {artifact.name} chose {c['backend']['value']} {c['quant']['value']} "
                      f"({c['backend']['reason']})")
    tokenizer = Tokenizer(artifacts[0] / "tokenizer")
    plan = args.cache / f"gguf-plan-{model}.json"
    plan.write_text(json.dumps({"sizes": {**sizes.__dict__, "ways": list(sizes.ways)}, "threads": args.threads,
                                "cache": str(args.cache.resolve()), "prompts": make_prompts(tokenizer, sizes)}))
    systems = [(sys.executable, f"artifact:{a.resolve()}") for a in artifacts]
    systems.append((llama_python(), f"llamacpp:{gguf.resolve()}"))
    rounds: dict[str, list[dict]] = {}
    for round_no in range(args.rounds):
        for i, (python, spec) in enumerate(systems if round_no % 2 == 0 else systems[::-1]):
            console.rule(f"{model}: {Path(spec.split(':', 1)[1]).name} (round {round_no + 1}/{args.rounds})")
            out = args.cache / f"gguf-result-{model}-{i}.json"
            rounds.setdefault(spec, []).append(run_worker(python, spec, plan, out))
    summaries = [summarize(merge_rounds(rs), tokenizer) for rs in rounds.values()]
    by_round = [[summarize(rs[i], tokenizer) for rs in rounds.values()] for i in range(args.rounds)]
    return {"gguf": gguf.name, "summaries": summaries, "ratios": ratios(summaries),
            "by_round": [ratios(r) for r in by_round]}


def _split(csv: str) -> list[str]:
    return [x.strip() for x in csv.split(",") if x.strip()]


def ratios(summaries) -> dict[str, dict[str, float]]:
    """Each kiln build's name -> kiln / llama.cpp per metric (TTFT: below 1 is faster; the rest:
    above 1 is faster). llama.cpp is the last system."""
    *kilns, peer = summaries
    if peer.error:
        return {}
    return {k.name: {m: k.metrics[m] / peer.metrics[m] for m in METRICS if peer.metrics.get(m)}
            for k in kilns if not k.error}


def report(model: str, result: dict, args) -> None:
    print_systems(result["summaries"])
    for name, by_metric in result["ratios"].items():
        for metric, ratio in by_metric.items():
            rounds = " / ".join(f"{r[name][metric]:.2f}×" for r in result["by_round"] if metric in r.get(name, {}))
            console.print(f"{model}: {METRICS[metric][0]}, {name} / llama.cpp {ratio:.2f}×"
                          + (f" (by round {rounds})" if args.rounds > 1 else "")
                          + (" (lower is faster)" if metric == "ttft_ms" else ""))
    png = args.out.with_name(f"{args.out.stem}-{model}.png")
    plot(result["summaries"], png, f"kiln vs llama.cpp on {result['gguf']}, {args.threads} threads")


def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3", help="comma-separated: smollm2, gemma3")
    ap.add_argument("--kiln", default="auto,int4",
                    help="kiln builds of each file: auto (no flags) or a --quant value, comma-separated")
    ap.add_argument("--quick", action="store_true", help="smoke run: few tokens, one repetition")
    ap.add_argument("--rounds", type=int, default=1, help="alternate the two systems this many times, pooled")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=HERE / ".cache")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "gguf_peers.json")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    sizes = SIZES["quick" if args.quick else "full"]
    args.cache.mkdir(parents=True, exist_ok=True)
    load_start, results = os.getloadavg(), {}
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        results[model] = measure_model(model, args, sizes)
    for model, result in results.items():
        report(model, result, args)
    load_end = os.getloadavg()
    console.print(f"load average (1 min) at start {load_start[0]:.2f}, at end {load_end[0]:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "mode": "quick" if args.quick else "full", "threads": args.threads, "rounds": args.rounds,
        "load_avg": [load_start[0], load_end[0]], "chat_question": QUESTION, "chat_expects": ANSWER,
        "models": {m: {"gguf": r["gguf"], "ratios_kiln_over_llamacpp": r["ratios"],
                       "ratios_by_round": r["by_round"],
                       "systems": {s.name: {"metrics": s.metrics, "chat_answer": s.chat, "error": s.error}
                                   for s in r["summaries"]}} for m, r in results.items()}}, indent=1))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
