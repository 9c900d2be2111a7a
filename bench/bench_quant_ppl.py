"""Perplexity, weight bytes and decode latency of fp32 / int8 / int4 builds of one model, side by side.

    .venv/bin/python bench/bench_quant_ppl.py [--model smollm2-135m] [--variants fp32,int8,int4]

Variants: fp32, int8, int4 (the pass's default recipe), plus options joined by '-': sym (symmetric),
bs16/bs64 (block size), t4/t8 (bits of the embedding and LM head), pure (no linear kept at 8 bits),
k8=a+b (these node-name segments at 8 bits), e.g. int4-pure-t4 (everything 4-bit), int4-sym-bs16.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kiln.eval.perplexity import make_session, perplexity, text_token_ids
from kiln.export.decoder_graph import build_decoder
from kiln.export.sources import load_source
from kiln.passes.quantize import QuantizePass, QuantMode, weight_bytes


def make_pass(variant: str) -> QuantizePass:
    mode, *opts = variant.split("-")
    kw: dict = {"symmetric": "sym" in opts}
    for o in opts:
        if o.startswith("bs"):
            kw["block_size"] = int(o[2:])
        if o[0] == "t" and o[1:].isdigit():
            kw["table_bits"] = int(o[1:])
        if o == "pure":
            kw["int8_linears"] = ()
        if o.startswith("k8="):
            kw["int8_linears"] = tuple(o[3:].split("+"))
    return QuantizePass(QuantMode.NONE if mode == "fp32" else QuantMode(mode), **kw)


def decode_latency_ms(model, past: int = 256, runs: int = 60) -> tuple[float, float]:
    """Median / min ms of one B=1, S=1 step after `past` cached tokens (random KV)."""
    sess = make_session(model)
    rng = np.random.default_rng(0)
    feeds = {"input_ids": np.array([[42]], np.int64), "position_ids": np.array([[past]], np.int64),
             "attention_mask": np.ones((1, past + 1), np.int64)}
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values."):
            feeds[i.name] = rng.normal(0, 1, (1, i.shape[1], past, i.shape[3])).astype(np.float32)
    for _ in range(5):
        sess.run(["logits"], feeds)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(["logits"], feeds)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--variants", default="fp32,int8,int4")
    ap.add_argument("--window", type=int, default=512)
    args = ap.parse_args()
    src = load_source(args.model)
    fp32 = build_decoder(src.spec, src.weights)
    tokens = text_token_ids(src.tokenizer_dir)
    base_bytes = weight_bytes(fp32.graph)
    print(f"{args.model}: {len(tokens)} tokens, window {args.window}, fp32 weights {base_bytes / 1e6:.1f} MB")
    print("| variant | ppl | Δppl | weight MB | ratio | decode ms (median / min) | quantize s |")
    print("|---|---|---|---|---|---|---|")
    base_ppl = None
    for variant in args.variants.split(","):
        t0 = time.perf_counter()
        model = make_pass(variant).run(fp32)
        qs = time.perf_counter() - t0
        ppl = perplexity(model, tokens, args.window)
        base_ppl = base_ppl or ppl
        med, low = decode_latency_ms(model)
        size = weight_bytes(model.graph)
        print(f"| {variant} | {ppl:.4f} | {100 * (ppl / base_ppl - 1):+.2f}% | {size / 1e6:.1f} | "
              f"{size / base_bytes:.3f} | {med:.2f} / {low:.2f} | {qs:.1f} |", flush=True)


if __name__ == "__main__":
    main()
