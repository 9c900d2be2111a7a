"""Perplexity, weight bytes and decode latency of fp32 / int8 / int4 builds of one model, side by side.

    .venv/bin/python -m bench.bench_quant_ppl [--model smollm2-135m] [--variants fp32,int8,int4] [--fuse]

Each variant also answers QUESTION (chat template, greedy, 24 tokens).
--fuse runs the build's fusion passes first (as `kiln build` does). Decode latency: B=1, S=1 after 256
cached tokens, sessions with ORT_ENABLE_ALL and 2 threads, interleaved rounds over all variants
(--cpu-time: 1 thread, process CPU time, for a machine others are loading).

Measured 2026-11-30 (SmolLM2, --fuse; tests/data/perplexity.txt; decode --cpu-time):
| variant | ppl | Δppl | weight MB | nodes | decode CPU ms | "capital of France?" |
| fp32 | 22.197 | — | 653 | 1221 | 40.9 | Paris |
| int8 | 22.343 | +0.66% | 162 | 1222 | 19.2 | "L'Étoile, …" |
| int4 (all 4-bit, block offsets) | 22.555 | +1.61% | 121 | 1582 | 18.6 | Paris |
| int4-k8=qkv_proj+down_proj | 22.418 | +1.00% | 138 | 1402 | — | "L'Étoile, …" |
| int4-nooff-k8=qkv_proj+down_proj (former recipe) | 23.921 | +7.77% | 130 | 1222 | 17.5 | Paris |
| int4-nooff (all 4-bit, integer zero points) | — | +37% | — | 1222 | 16.6 | — |

Measured 2026-11-30 evening (same text; --no-latency for ppl, --no-ppl --cpu-time for decode, one
run each on a shared machine); the INT4 recipe became int4-search-cal-k8=gate_up_proj+down_proj:
| variant | ppl | Δppl | weight MB | nodes | decode CPU ms | "capital of France?" |
| int4-search-nocal (plain squared error) | 25.829 | +16.37% | 107 | 1222 | — | Paris |
| int4-search-cal | 23.951 | +7.90% | 107 | 1222 | 15.8 (int4 with offsets: 17.9) | Paris |
| int4-search-cal-bs16 | 23.388 | +5.36% | 131 | 1222 | — | "L'Alle…" |
| int4-search-cal-o=gate_up_proj | 23.256 | +4.77% | 114 | 1312 | 17.0 | Paris |
| int4-search-cal-k8=gate_up_proj | — | — | 135 | 1222 | 16.6 | Paris |
| int4-search-cal-k8=gate_up_proj+down_proj (INT4, = int4) | 22.803 | +2.73% | 148 | 1222 | 16.6 (int4-off-pure 17.4, same run) | Paris |

Variants: fp32, int8, int4 (the pass's default recipe), plus options joined by '-': sym (symmetric),
bs16/bs64 (block size), t4/t8 (bits of the embedding and LM head), pure (no linear kept at 8 bits),
k8=a+b (these node-name segments at 8 bits), off/nooff (4-bit linears with / without a float
minimum per block, passes/block_offsets.py), nbits/dynamic (how 8-bit linears run: MatMulNBits or
DynamicQuantizeMatMul, passes/dynamic_int8.py), nb=a+b (these 8-bit linears stay MatMulNBits
when the rest are dynamic; nb= alone: none), search (4-bit linears with integer zero points from
passes/int4_search.py, weighted by a calibration run over kiln/data/calibration.txt as in the
build; nocal: plain squared error; cal: accepted, the default), q4min (4-bit linears with a float
minimum per block on kiln's MatMulQ4Min kernel, passes/q4min_linear.py: int4-q4min-pure is the INT4
recipe when the op library is built with hq8, the LM head on kiln's MatMulQ8; hq4: the head
on MatMulQ4Min),
o=a+b (these 4-bit linears keep block offsets: a mixed split), e.g. int4-pure-t4 (everything
4-bit), int4-sym-bs16, int4-search-cal-o=gate_up_proj, int4-off-pure (the former INT4 recipe:
every linear 4-bit with block offsets). --no-latency: perplexity and answers only.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from kiln.compiler.eval.perplexity import greedy_tokens, make_session, perplexity, text_token_ids
from kiln.compiler.export.decoder_graph import build_decoder
from kiln.compiler.export.sources import load_source
from kiln.compiler.passes.int4_calibration import CALIBRATION_TEXT
from kiln.contract.quant import QuantMode
from kiln.compiler.passes.quantize import QuantizePass, weight_bytes
from kiln.compiler.passes.quant_settings import QuantSettings
from kiln.tokenizer import Tokenizer

QUESTION = "What is the capital of France?"


def make_pass(variant: str, calibration_ids: list[int] | None = None) -> QuantizePass:
    mode, *opts = variant.split("-")
    kw: dict = {"symmetric": "sym" in opts}
    if "search" in opts:        # integer zero points (the MatMulNBits INT4 recipe's rounding)
        kw["int4_rounding"] = "search"
    if "q4min" in opts:         # a float minimum per block on kiln's MatMulQ4Min (kiln/engines/ort/native)
        kw["int4_rounding"] = "q4min"
    if "hq4" in opts:           # the LM head 4-bit on MatMulQ4Min too (the embedding keeps its own table)
        kw["head_kernel"] = "q4min"
    if "hq8" in opts:           # the LM head 8-bit on kiln's MatMulQ8 (the INT4 recipe with the library)
        kw["head_kernel"] = "q8"
    for o in opts:
        if o.startswith("bs"):
            kw["block_size"] = int(o[2:])
        if o[0] == "t" and o[1:].isdigit():
            kw["table_bits"] = int(o[1:])
        if o == "pure":
            kw["int8_linears"] = ()
        if o == "off":
            kw["block_offsets"] = True
        if o == "nooff":
            kw["block_offsets"] = False
        if o in ("nbits", "dynamic"):
            kw["int8_kernel"] = o
        if o.startswith("nb="):
            kw["nbits_linears"] = tuple(x for x in o[3:].split("+") if x)
        if o.startswith("o="):          # these 4-bit linears keep block offsets (a mixed split)
            kw["offset_linears"] = tuple(o[2:].split("+"))
        if o.startswith("k8="):
            kw["int8_linears"] = tuple(o[3:].split("+"))
    settings = QuantSettings(QuantMode.NONE if mode == "fp32" else QuantMode(mode), **kw)
    # as the build: calibration tokens given (used by the search only); "nocal": plain squared error
    return QuantizePass(settings, None if "nocal" in opts else calibration_ids)


def decode_feeds(sess, past: int = 256) -> dict:
    rng = np.random.default_rng(0)
    feeds = {"input_ids": np.array([[42]], np.int64), "position_ids": np.array([[past]], np.int64),
             "attention_mask": np.ones((1, past + 1), np.int64)}
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values."):
            feeds[i.name] = rng.normal(0, 1, (1, i.shape[1], past, i.shape[3])).astype(np.float32)
    return feeds


def decode_latencies_ms(models: dict, rounds: int = 4, runs: int = 20,
                        cpu_time: bool = False) -> dict[str, tuple[float, float]]:
    """Median / min ms per variant of one decode step; rounds interleave the variants against drift.
    cpu_time: one thread, no spinning, process CPU time: a loaded machine barely moves it."""
    sessions = {v: make_session(m, threads=1 if cpu_time else 2) for v, m in models.items()}
    clock = time.process_time if cpu_time else time.perf_counter
    feeds = {v: decode_feeds(s) for v, s in sessions.items()}
    times: dict[str, list[float]] = {v: [] for v in models}
    for r in range(rounds):
        for v, sess in sessions.items():
            for i in range(runs + (5 if r == 0 else 0)):
                t0 = clock()
                sess.run(["logits"], feeds[v])
                if r or i >= 5:
                    times[v].append((clock() - t0) * 1e3)
    return {v: (statistics.median(t), min(t)) for v, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--variants", default="fp32,int8,int4")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--fuse", action="store_true")
    ap.add_argument("--no-ppl", action="store_true", help="decode latency and bytes only")
    ap.add_argument("--no-latency", action="store_true", help="perplexity, bytes and answers only")
    ap.add_argument("--cpu-time", action="store_true", help="decode CPU ms at 1 thread (for a shared machine)")
    args = ap.parse_args()
    src = load_source(args.model)
    fp32 = build_decoder(src.spec, src.weights)
    if args.fuse:
        from kiln.compiler.passes.fusion import fusion_passes

        for p in fusion_passes(src.spec):
            fp32 = p.run(fp32)
    tokens = text_token_ids(src.tokenizer_dir)
    args.calibration_ids = text_token_ids(src.tokenizer_dir, CALIBRATION_TEXT)     # never the eval text
    base_bytes = weight_bytes(fp32.graph)
    print(f"{args.model}{' (fused)' if args.fuse else ''}: {len(tokens)} tokens, window {args.window}, "
          f"fp32 weights {base_bytes / 1e6:.1f} MB", flush=True)
    chat = chat_prompt(src.tokenizer_dir)
    with tempfile.TemporaryDirectory() as tmp:
        rows = {v: measure(v, fp32, tokens, chat, args, Path(tmp)) for v in args.variants.split(",")}
        del fp32
        latency = ({v: (float("nan"),) * 2 for v in rows} if args.no_latency else
                   decode_latencies_ms({v: r["path"] for v, r in rows.items()}, cpu_time=args.cpu_time))
    base_ppl = next(iter(rows.values()))["ppl"]
    clock = "CPU ms, 1 thread" if args.cpu_time else "ms"
    print(f"| variant | ppl | Δppl | weight MB | ratio | nodes | decode {clock} (median / min) | quantize + ppl s |")
    print("|---|---|---|---|---|---|---|---|")
    for v, r in rows.items():
        print(f"| {v} | {r['ppl']:.4f} | {100 * (r['ppl'] / base_ppl - 1):+.2f}% | {r['bytes'] / 1e6:.1f} | "
              f"{r['bytes'] / base_bytes:.3f} | {r['nodes']} | {latency[v][0]:.2f} / {latency[v][1]:.2f} | "
              f"{r['seconds']:.0f} |")
    for v, r in rows.items():
        print(f"{v}: {r['answer']!r}")


def chat_prompt(tokenizer_dir: Path) -> tuple[list[int], tuple[int, ...], Tokenizer]:
    tok = Tokenizer(tokenizer_dir)
    ids = tok.encode_chat([{"role": "user", "content": QUESTION}])
    return ids, (tok.eos_token_id,) if tok.eos_token_id is not None else (), tok


def measure(variant: str, fp32, tokens: list[int], chat, args, tmp: Path) -> dict:
    """Quantize, score and save one variant; only its file stays (SmolLM2 graphs are ~0.1-0.7 GB each)."""
    t0 = time.perf_counter()
    model = make_pass(variant, args.calibration_ids).run(fp32)
    ppl = float("nan") if args.no_ppl else perplexity(model, tokens, args.window)
    ids, stop, tok = chat
    answer = tok.decode(greedy_tokens(model, ids, 24, stop))
    path = tmp / f"{variant}.onnx"
    onnx.save(model, str(path))
    print(f"  {variant}: ppl {ppl:.4f}, {len(model.graph.node)} nodes, {answer!r}", flush=True)
    return {"ppl": ppl, "seconds": time.perf_counter() - t0, "bytes": weight_bytes(model.graph),
            "nodes": len(model.graph.node), "answer": answer, "path": str(path)}

if __name__ == "__main__":
    main()
