"""Same-run A/B of kiln artifacts on three shapes: TTFT of a 512-token prompt, one stream and 32
streams of 64 greedy tokens (13-token prompts). Rounds interleave the artifacts so drifting machine
load hits all alike; the best round of each is printed, with ratios to the first artifact.

    kiln build smollm2-135m --quant int8 -o /tmp/a-int8
    kiln build smollm2-135m --quant w8a8 -o /tmp/a-w8a8
    .venv/bin/python -m bench.bench_engine_modes /tmp/a-int8 /tmp/a-w8a8 [--rounds 3] [--threads 2]

--build SOURCE:QUANT[:ATTENTION[:PREFILL]] builds an artifact in this run first (into --build-dir),
e.g. the paged graph's attention cores side by side (ATTENTION: standard, the default, or gqa,
kiln build --attention; PREFILL: a --prefill-engine mode):
    bench_engine_modes.py --build smollm2-135m:int4:standard --build smollm2-135m:int4:gqa
Each artifact's decode graph node count is printed with its results.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import onnx

from kiln import LLM, RuntimeConfig, SamplingParams, SchedulerConfig
from kiln.compiler.build import build
from kiln.config import BuildConfig
from kiln.contract.quant import QuantMode

PROMPT = list(range(1, 14))


def timed(llm: LLM, prompts: list[list[int]], n: int) -> tuple[float, int]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)


def measure(llm: LLM, long_context: int = 0) -> dict[str, float]:
    long_prompt = [(i * 7919) % 20000 + 100 for i in range(512)]
    ttft, _ = timed(llm, [long_prompt], 1)
    one_s, one_n = timed(llm, [PROMPT], 64)
    many_s, many_n = timed(llm, [[*PROMPT[:2], 3 + i, *PROMPT[3:]] for i in range(32)], 64)
    out = {"ttft_ms": ttft * 1e3, "one_tok_s": one_n / one_s, "32_tok_s": many_n / many_s}
    if long_context:
        prompts = [[(i * 7919 + j * 104729) % 20000 + 100 for i in range(long_context)] for j in range(8)]
        out["long_decode_tok_s"] = decode_only_rate(llm, prompts, 64)
    return out


def decode_only_rate(llm: LLM, prompts: list[list[int]], n: int) -> float:
    """Tokens/s of the steps the engine core counts as decode-only (no prefill chunk in them): the
    prompts' streams decoding over long contexts, where attention reads the most KV."""
    core, params = llm.core, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    requests = [llm.make_request(p, params) for p in prompts]
    for r in requests:
        core.add_request(r)
        llm.outputs.add(r)
    tokens, seconds = 0, 0.0
    while core.has_unfinished():
        decode_before, t0 = core.stats.decode_seconds, time.perf_counter()
        deltas = core.step()
        for d in deltas:
            llm.outputs.process(d)
        if core.stats.decode_seconds > decode_before:
            seconds += time.perf_counter() - t0
            tokens += len(deltas)
    for r in requests:
        llm.outputs.result(r)
    return tokens / max(seconds, 1e-9)


def build_artifact(spec: str, root: Path) -> str:
    """SOURCE:QUANT[:ATTENTION[:PREFILL]] -> the built artifact's folder."""
    source, quant, attention, prefill = (spec.split(":") + ["", "", ""])[:4]
    out = root / spec.replace(":", "-")
    print(f"building {spec} -> {out}", flush=True)
    return str(build(BuildConfig(source=source, out=out, quant=QuantMode(quant), attention=attention or "standard",
                                 prefill_engine=prefill, force=True)))


def decode_nodes(llm: LLM) -> int | str:
    """Nodes of the engine that serves decodes (the manifest's first), if it is an ONNX graph."""
    record = llm.artifact.manifest.engines[0]
    if record["backend"] != "ort":
        return f"({record['backend']})"
    return len(onnx.load(str(llm.artifact.path / record["file"]), load_external_data=False).graph.node)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="*")
    ap.add_argument("--build", action="append", default=[], metavar="SOURCE:QUANT[:ATTENTION[:PREFILL]]")
    ap.add_argument("--build-dir", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--long-context", type=int, default=0, metavar="N",
                    help="also time 8 streams decoding after N-token prompts (KV-heavy decode)")
    args = ap.parse_args()
    root = args.build_dir or Path(tempfile.mkdtemp(prefix="kiln-bench-modes-"))
    args.artifacts += [build_artifact(spec, root) for spec in args.build]
    cfg = RuntimeConfig(kv_cache_memory=1 << 30, threads=args.threads,
                        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024,
                                                  enable_prefix_caching=False))
    llms = {a: LLM(a, cfg) for a in args.artifacts}
    best: dict[str, dict[str, float]] = {}
    for r in range(args.rounds):
        for a, llm in llms.items():
            m = measure(llm, args.long_context)
            b = best.setdefault(a, m)
            best[a] = {k: (min if k == "ttft_ms" else max)(b[k], m[k]) for k in m}
            print(f"round {r + 1} {a}: " + ", ".join(f"{k} {v:.1f}" for k, v in m.items()), flush=True)
    base = best[args.artifacts[0]]
    long = f" | 8 streams after {args.long_context} tokens, decode tok/s" if args.long_context else ""
    print(f"| artifact | quant | decode nodes | TTFT 512 | 1 stream tok/s | 32 streams tok/s{long} |\n"
          f"|---|---|---|---|---|---|{'---|' if long else ''}")
    for a in args.artifacts:
        m, quant = best[a], llms[a].artifact.manifest.quant["mode"]
        extra = (f" {m['long_decode_tok_s']:.0f} ({m['long_decode_tok_s'] / base['long_decode_tok_s']:.2f}×) |"
                 if long else "")
        print(f"| {a} | {quant} | {decode_nodes(llms[a])} | "
              f"{m['ttft_ms']:.0f} ms ({base['ttft_ms'] / m['ttft_ms']:.2f}×) | "
              f"{m['one_tok_s']:.1f} ({m['one_tok_s'] / base['one_tok_s']:.2f}×) | "
              f"{m['32_tok_s']:.0f} ({m['32_tok_s'] / base['32_tok_s']:.2f}×) |{extra}")
    for llm in llms.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
