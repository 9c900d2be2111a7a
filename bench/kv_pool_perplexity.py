"""Perplexity of artifacts through their engines, every token reading its past from the KV pool:
tests/data/perplexity.txt in 512-token windows, each fed in chunks of 32 (so the pool's precision
is what attention reads), with the KV bytes per token each artifact's layout costs.

    kiln build smollm2-135m --quant int8 -o /tmp/kv32
    kiln build smollm2-135m --quant int8 --kv-dtype fp16 -o /tmp/kv16
    .venv/bin/python -m bench.kv_pool_perplexity /tmp/kv32 /tmp/kv16
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from kiln.contract.artifact import EngineArtifact
from kiln.compiler.eval.perplexity import PERPLEXITY_TEXT, text_token_ids
from kiln.compiler.eval.sequence import SequenceRunner

WINDOW, CHUNK = 512, 32


def total_nll(artifact: EngineArtifact, ids: list[int], threads: int) -> tuple[float, int]:
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, WINDOW):
        window = ids[start:start + WINDOW]
        if len(window) < 2:
            break
        logits = SequenceRunner(artifact, WINDOW, threads).feed_chunked(window, CHUNK)[:-1].astype(np.float64)
        targets = np.asarray(window[1:])
        top = logits.max(-1)
        log_z = top + np.log(np.exp(logits - top[:, None]).sum(-1))
        total += float((log_z - logits[np.arange(len(targets)), targets]).sum())
        count += len(targets)
    return total, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    for path in args.artifacts:
        artifact = EngineArtifact.load(path)
        layout = artifact.manifest.kv_layout
        nll, n = total_nll(artifact, text_token_ids(artifact.tokenizer_dir, PERPLEXITY_TEXT), args.threads)
        print(f"{path}: KV {layout.dtype}, {layout.bytes_per_token:,} bytes/token; "
              f"perplexity {math.exp(nll / n):.4f} over {n} tokens")


if __name__ == "__main__":
    main()
