"""Speculative decoding (prompt lookup) against plain decoding on SmolLM2, side by side in one run.

    flock /tmp/kiln-heavy.lock nice -n 5 .venv/bin/python -m bench.bench_speculative

Workloads, greedy, chat template, up to --max-tokens each, EOS ends a reply:
- input-grounded: "repeat / correct / summarize this passage" over passages of
  tests/data/perplexity.txt (the answer quotes its input: prompt lookup's case);
- open-ended chat: questions whose answers quote nothing.
Single stream: one request at a time; each prompt runs with and without `--speculative ngram`
in alternating order, --reps times, and a workload's tokens/s is its tokens over its seconds.
A 4-stream row (the chat prompts four at a time) shows the load limit at work. Every greedy
output is compared token for token with the non-speculative one.

Artifacts: fp32 (every engine row is computed alone: outputs must be identical) and int8
(MatMulNBits with int8 activations: a row's rounding depends on how many rows its call has, so
a verification row can differ from a decode row; the table says how many outputs still match).
Prints one table, writes bench/results/speculative.json and speculative.png. A benchmark, not a
test: only the identity of fp32 outputs is asserted.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.runtime_kiln import ensure_kiln

from rich.console import Console
from rich.table import Table

from kiln.config import RuntimeConfig, SpeculativeConfig
from kiln.runtime.llm import LLM
from kiln.runtime.sampling_params import SamplingParams

HERE = Path(__file__).parent
RESULTS = HERE / "results"
TASKS = ("Repeat the following passage exactly, word for word:\n\n{}",
         "Correct any spelling or grammar mistakes in this passage and return the whole corrected passage:\n\n{}",
         "Summarize this passage, quoting its key sentences:\n\n{}")
CHAT = ("Write a short story about a robot who learns to paint.",
        "What are some tips for staying productive when working from home?",
        "Explain how a bicycle stays upright.",
        "Give me three ideas for a birthday party for a ten-year-old.",
        "Why is the sky blue?",
        "Describe your ideal weekend.")
console = Console(width=160)


@dataclass
class Case:
    artifact: str
    workload: str
    streams: int
    tokens: dict[str, int] = field(default_factory=lambda: {"off": 0, "ngram": 0})
    seconds: dict[str, float] = field(default_factory=lambda: {"off": 0.0, "ngram": 0.0})
    identical: int = 0
    outputs: int = 0
    proposed: int = 0
    accepted: int = 0

    def tok_s(self, mode: str) -> float:
        return self.tokens[mode] / self.seconds[mode] if self.seconds[mode] else 0.0

    @property
    def ratio(self) -> float:
        return self.tok_s("ngram") / self.tok_s("off") if self.tok_s("off") else 0.0


def passages(n: int) -> list[str]:
    text = (Path(__file__).parents[1] / "tests" / "data" / "perplexity.txt").read_text()
    return [p for p in text.split("\n\n") if 400 < len(p) < 1200][:n]


def workloads() -> dict[str, list[list[dict]]]:
    grounded = [[{"role": "user", "content": task.format(p)}] for p in passages(2) for task in TASKS]
    chat = [[{"role": "user", "content": q}] for q in CHAT]
    return {"input-grounded": grounded, "open-ended chat": chat}


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    spec = llm.core.speculator
    before = (spec.stats.proposed, spec.stats.accepted) if spec else (0, 0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    after = (spec.stats.proposed, spec.stats.accepted) if spec else (0, 0)
    return [o.token_ids for o in outs], seconds, (after[0] - before[0], after[1] - before[1])


def run_case(case: Case, llms: dict[str, LLM], batches: list[list[list[int]]], params, reps: int) -> None:
    for rep in range(reps):
        for batch in batches:
            order = ("off", "ngram") if rep % 2 == 0 else ("ngram", "off")
            got = {}
            for mode in order:
                got[mode], seconds, (proposed, accepted) = timed(llms[mode], batch, params)
                case.tokens[mode] += sum(len(t) for t in got[mode])
                case.seconds[mode] += seconds
                case.proposed += proposed
                case.accepted += accepted
            if rep == 0:
                case.outputs += len(batch)
                case.identical += sum(a == b for a, b in zip(got["off"], got["ngram"]))


def bench_artifact(name: str, path: Path, args) -> list[Case]:
    runtime = RuntimeConfig(kv_cache_memory=512 << 20, threads=args.threads)
    llms = {"off": LLM(path, runtime),
            "ngram": LLM(path, RuntimeConfig(kv_cache_memory=512 << 20, threads=args.threads,
                                             speculative=SpeculativeConfig(num_speculative_tokens=args.k)))}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    for llm in llms.values():                       # warm-up: sessions, arenas, step-cost model
        llm.generate([llm.chat_prompt([{"role": "user", "content": "Hi"}])], SamplingParams(max_tokens=8, temperature=0))
    cases = []
    for workload, convs in workloads().items():
        prompts = [llms["off"].chat_prompt(c) for c in convs]
        case = Case(name, workload, 1)
        run_case(case, llms, [[p] for p in prompts], params, args.reps)
        cases.append(case)
        console.print(f"{name} {workload}: {case.tok_s('off'):.1f} -> {case.tok_s('ngram'):.1f} tok/s "
                      f"({case.ratio:.2f}x)")
    chat = [llms["off"].chat_prompt(c) for c in workloads()["open-ended chat"]]
    case = Case(name, "open-ended chat", 4)
    run_case(case, llms, [chat[i:i + 4] for i in range(0, len(chat), 4)], params, args.reps)
    cases.append(case)
    for llm in llms.values():
        llm.shutdown()
    return cases


def print_table(cases: list[Case], k: int) -> None:
    table = Table(title=f"speculative decoding (prompt lookup, k <= {k}) on SmolLM2-135M, greedy")
    for col in ("artifact", "workload", "streams", "tok/s plain", "tok/s ngram", "ratio", "accepted/proposed",
                "identical outputs"):
        table.add_column(col, justify="left" if col in ("artifact", "workload") else "right")
    for c in cases:
        rate = f"{c.accepted}/{c.proposed} ({c.accepted / c.proposed:.0%})" if c.proposed else "-"
        table.add_row(c.artifact, c.workload, str(c.streams), f"{c.tok_s('off'):.1f}", f"{c.tok_s('ngram'):.1f}",
                      f"{c.ratio:.2f}x", rate, f"{c.identical}/{c.outputs}")
    console.print(table)


def plot(cases: list[Case], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{c.artifact}\n{c.workload}\n{c.streams} stream{'s' if c.streams > 1 else ''}" for c in cases]
    x = range(len(cases))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(cases)), 4.5))
    ax.bar([i - 0.2 for i in x], [c.tok_s("off") for c in cases], 0.4, label="plain decoding")
    ax.bar([i + 0.2 for i in x], [c.tok_s("ngram") for c in cases], 0.4, label="--speculative ngram")
    for i, c in zip(x, cases):
        ax.text(i + 0.2, c.tok_s("ngram"), f"{c.ratio:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("output tokens/s")
    ax.set_title("SmolLM2-135M, greedy, 2-core CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quant", default="fp32,int8", help="Artifacts to build (bench/.cache) and compare.")
    parser.add_argument("--artifact", action="append", default=[], metavar="NAME=PATH",
                        help="Use this artifact instead of building NAME.")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("-k", type=int, default=5, help="--num-speculative-tokens")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--reuse", action="store_true", help="Reuse the newest cached artifacts.")
    parser.add_argument("--out", type=Path, default=RESULTS / "speculative.json")
    args = parser.parse_args()
    given = dict(a.split("=", 1) for a in args.artifact)
    cases = []
    for quant in args.quant.split(","):
        path = Path(given[quant]) if quant in given else ensure_kiln(HERE / ".cache", "ort", quant, args.reuse)
        cases += bench_artifact(quant, path, args)
    print_table(cases, args.k)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()},
                                    "cases": [asdict(c) | {"ratio": c.ratio} for c in cases]}, indent=1))
    plot(cases, args.out.with_suffix(".png"))
    console.print(f"wrote {args.out} and {args.out.with_suffix('.png')}; the machine may have been shared: "
                  "compare ratios, not absolute tokens/s")
    fp32 = [c for c in cases if c.artifact == "fp32"]
    assert all(c.identical == c.outputs for c in fp32), "fp32 greedy outputs differ with speculation"


if __name__ == "__main__":
    main()
