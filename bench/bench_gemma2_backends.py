"""Gemma 2 on the two CPU backends: the openvino engine with kiln's paged gather against ort's.

    .venv/bin/python bench/bench_gemma2_backends.py TOKENIZER_DIR [--reps 2] [--out bench/.cache/gemma2]

TOKENIZER_DIR: any artifact's tokenizer folder with a 49,152-token vocabulary and a chat template
(`kiln build smollm2-135m --out engines/smollm2` makes engines/smollm2/tokenizer). The checkpoint is
a seeded random Gemma 2 of SmolLM2-135M's shape (576 hidden, 30 layers, 9/3 heads, head_dim 64,
soft-caps 50/30): speed depends on the shape, not on the weights. Random weights fail the build's
int8 accuracy check (near-tied logits), so both artifacts are built with --no-verify; the numerics
of the path are tested on tiny checkpoints (tests/models/test_openvino_family_parity.py). Then
bench_engine_backends.py runs its workloads on both, interleaved.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
KILN = Path(sys.executable).parent / "kiln"
SHAPE = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
             intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, sliding_window=4096,
             query_pre_attn_scalar=64, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def write_checkpoint(out: Path, tokenizer: Path) -> Path:
    import torch
    import transformers

    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Gemma2Config(**SHAPE), dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(out)
    for f in tokenizer.iterdir():
        shutil.copy(f, out / f.name)
    return out


def build(checkpoint: Path, out: Path, backend: str) -> Path:
    if not (out / "manifest.json").is_file():
        subprocess.run([str(KILN), "build", str(checkpoint), "--out", str(out), "--backend", backend,
                        "--quant", "int8", "--no-verify", "--force"], check=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tokenizer", type=Path)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / ".cache" / "gemma2")
    args = ap.parse_args()
    checkpoint = write_checkpoint(args.out / "checkpoint", args.tokenizer)
    artifacts = [build(checkpoint, args.out / backend, backend) for backend in ("ort", "openvino")]
    subprocess.run([sys.executable, str(HERE / "bench_engine_backends.py"), *map(str, artifacts),
                    "--reps", str(args.reps)], check=True)


if __name__ == "__main__":
    main()
