"""Perplexity of an onnxruntime-genai model folder (bench_runtime.py's peer, cached in bench/.cache)
on the text and windows bench/kv_pool_perplexity.py uses for kiln artifacts, so the two compare:
tests/data/perplexity.txt in 512-token windows. The model builder's graph returns logits for the
last token only, so each window is fed one token at a time through its own KV cache.

    .venv/bin/python bench/genai_perplexity.py bench/.cache/genai-int4 --tokenizer ARTIFACT/tokenizer
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import onnxruntime as ort

from kiln.compiler.eval.perplexity import PERPLEXITY_TEXT, text_token_ids

WINDOW = 512


def window_nll(session: ort.InferenceSession, window: list[int], kv_heads: int, head_dim: int) -> float:
    past_names = [i.name for i in session.get_inputs() if i.name.startswith("past_key_values")]
    outputs = ["logits", *(n.replace("past_key_values", "present") for n in past_names)]
    past = {n: np.zeros((1, kv_heads, 0, head_dim), np.float32) for n in past_names}
    total = 0.0
    for k in range(len(window) - 1):
        feeds = {"input_ids": np.asarray([[window[k]]], np.int64), "attention_mask": np.ones((1, k + 1), np.int64)}
        logits, *present = session.run(outputs, feeds | past)
        past = dict(zip(past_names, present))
        row = logits[0, -1].astype(np.float64)
        top = row.max()
        total += float(top + math.log(np.exp(row - top).sum()) - row[window[k + 1]])
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--tokenizer", type=Path, required=True, help="a kiln artifact's tokenizer folder (same vocab)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    session = ort.InferenceSession(str(args.model_dir / "model.onnx"), opts, providers=["CPUExecutionProvider"])
    decoder = json.loads((args.model_dir / "genai_config.json").read_text())["model"]["decoder"]
    ids = text_token_ids(args.tokenizer, PERPLEXITY_TEXT)
    windows = [ids[s:s + WINDOW] for s in range(0, len(ids) - 1, WINDOW) if len(ids[s:s + WINDOW]) >= 2]
    nll = sum(window_nll(session, w, decoder["num_key_value_heads"], decoder["head_size"]) for w in windows)
    n = sum(len(w) - 1 for w in windows)
    print(f"{args.model_dir}: perplexity {math.exp(nll / n):.4f} over {n} tokens")


if __name__ == "__main__":
    main()
