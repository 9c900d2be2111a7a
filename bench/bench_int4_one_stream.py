"""One stream, same process, alternating: kiln artifacts against onnxruntime-genai int4, per decode token.

    .venv/bin/python bench/bench_int4_one_stream.py ov-int4=/tmp/a/ov4 ort-int4=/tmp/a/ort4 \\
        --genai bench/.cache/genai-int4 --threads 1 --rounds 5

Each round runs every system once, in turn: a 13-token prompt, then `--tokens` greedy tokens. A
system's figure is the median over rounds of its decode time per token (the first token, the
prefill, left out), as wall time and as the process's CPU time (all threads: on a shared machine the
steadier of the two, and the one to read at --threads 1). Ratios are to the genai peer.
bench_runtime.py is the full side by side; this is its one-stream column, cheaper and steadier.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT = list(range(100, 113))


def kiln_system(artifact: Path, threads: int):
    from kiln import LLM, RuntimeConfig, SamplingParams, SchedulerConfig

    llm = LLM(artifact, RuntimeConfig(kv_cache_memory=256 << 20, threads=threads,
                                      scheduler=SchedulerConfig(enable_prefix_caching=False)))

    def run(n: int) -> tuple[float, float, list[int]]:
        core, params = llm.core, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        request = llm.make_request(PROMPT, params)
        core.add_request(request)
        llm.outputs.add(request)
        core.step()                               # the prefill and the first token
        w0, c0 = time.perf_counter(), time.process_time()
        while core.has_unfinished():
            core.step()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        return wall / (n - 1), cpu / (n - 1), list(request.output_token_ids)
    return run


def genai_system(model_dir: Path, threads: int):
    from peers import GenAIRunner

    runner = GenAIRunner(model_dir, threads, "int4")
    og = runner.og

    def run(n: int) -> tuple[float, float, list[int]]:
        params = og.GeneratorParams(runner.model)
        params.set_search_options(batch_size=1, max_length=len(PROMPT) + n, min_length=len(PROMPT) + n, do_sample=False)
        gen = og.Generator(runner.model, params)
        gen.append_tokens(np.asarray([PROMPT], dtype=np.int32))
        gen.generate_next_token()
        w0, c0 = time.perf_counter(), time.process_time()
        while not gen.is_done():
            gen.generate_next_token()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        return wall / (n - 1), cpu / (n - 1), list(map(int, gen.get_sequence(0)[len(PROMPT):]))
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kiln", nargs="*", help="LABEL=ARTIFACT")
    ap.add_argument("--genai", default="bench/.cache/genai-int4", help="onnxruntime-genai model folder ('' for none)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    systems = {}
    if args.genai:
        systems["genai-int4"] = genai_system(Path(args.genai), args.threads)
    for item in args.kiln:
        label, _, path = item.partition("=")
        systems[label] = kiln_system(Path(path), args.threads)
    for run in systems.values():                 # warm-up
        run(8)
    walls = {k: [] for k in systems}
    cpus = {k: [] for k in systems}
    tokens = {}
    for r in range(args.rounds):
        order = list(systems) if r % 2 == 0 else list(reversed(systems))
        for name in order:
            wall, cpu, tokens[name] = systems[name](args.tokens)
            walls[name].append(wall)
            cpus[name].append(cpu)
    base = next(iter(systems))
    bw, bc = statistics.median(walls[base]), statistics.median(cpus[base])
    print(f"{args.threads} thread(s), {args.rounds} rounds of {args.tokens} tokens, decode per token (median of rounds)")
    for name in systems:
        w, c = statistics.median(walls[name]), statistics.median(cpus[name])
        print(f"  {name:<14} wall {w * 1e3:7.2f} ms ({1 / w:6.1f} tok/s, {bw / w:5.2f}x {base})   "
              f"CPU {c * 1e3:7.2f} ms ({bc / c:5.2f}x)   first 12 tokens {tokens[name][:12]}")


if __name__ == "__main__":
    main()
