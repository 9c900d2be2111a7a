"""Same-run A/B of kiln artifacts on three shapes: TTFT of a 512-token prompt, one stream and 32
streams of 64 greedy tokens (13-token prompts). Rounds interleave the artifacts so drifting machine
load hits all alike; the best round of each is printed, with ratios to the first artifact.

    kiln build smollm2-135m --quant int8 -o /tmp/a-int8
    kiln build smollm2-135m --quant w8a8 -o /tmp/a-w8a8
    .venv/bin/python bench/bench_engine_modes.py /tmp/a-int8 /tmp/a-w8a8 [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

from kiln import LLM, RuntimeConfig, SamplingParams, SchedulerConfig

PROMPT = list(range(1, 14))


def timed(llm: LLM, prompts: list[list[int]], n: int) -> tuple[float, int]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)


def measure(llm: LLM) -> dict[str, float]:
    long_prompt = [(i * 7919) % 20000 + 100 for i in range(512)]
    ttft, _ = timed(llm, [long_prompt], 1)
    one_s, one_n = timed(llm, [PROMPT], 64)
    many_s, many_n = timed(llm, [[*PROMPT[:2], 3 + i, *PROMPT[3:]] for i in range(32)], 64)
    return {"ttft_ms": ttft * 1e3, "one_tok_s": one_n / one_s, "32_tok_s": many_n / many_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    cfg = RuntimeConfig(kv_cache_memory=1 << 30, threads=args.threads,
                        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024,
                                                  enable_prefix_caching=False))
    llms = {a: LLM(a, cfg) for a in args.artifacts}
    best: dict[str, dict[str, float]] = {}
    for r in range(args.rounds):
        for a, llm in llms.items():
            m = measure(llm)
            b = best.setdefault(a, m)
            best[a] = {"ttft_ms": min(b["ttft_ms"], m["ttft_ms"]), "one_tok_s": max(b["one_tok_s"], m["one_tok_s"]),
                       "32_tok_s": max(b["32_tok_s"], m["32_tok_s"])}
            print(f"round {r + 1} {a}: " + ", ".join(f"{k} {v:.1f}" for k, v in m.items()), flush=True)
    base = best[args.artifacts[0]]
    print("| artifact | quant | TTFT 512 | 1 stream tok/s | 32 streams tok/s |\n|---|---|---|---|---|")
    for a in args.artifacts:
        m, quant = best[a], llms[a].artifact.manifest.quant["mode"]
        print(f"| {a} | {quant} | {m['ttft_ms']:.0f} ms ({base['ttft_ms'] / m['ttft_ms']:.2f}×) | "
              f"{m['one_tok_s']:.1f} ({m['one_tok_s'] / base['one_tok_s']:.2f}×) | "
              f"{m['32_tok_s']:.0f} ({m['32_tok_s'] / base['32_tok_s']:.2f}×) |")
    for llm in llms.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
