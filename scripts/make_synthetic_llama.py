"""Write a seeded random Llama checkpoint the way people ship models: bf16, sharded, with a tokenizer.

For measuring and testing builds of a given size without downloading one (README, model sources):

    .venv/bin/python scripts/make_synthetic_llama.py 0.65b /tmp/synth650-q4 --weights q4-grid
    .venv/bin/python scripts/make_synthetic_llama.py over-2gib /tmp/synth-2gib --weights unit

transformers' own LlamaForCausalLM writes it (save_pretrained), so the folder is exactly what a
real checkpoint of that shape looks like to `kiln build`. The same preset and seed give the same
bytes. --weights:
- hf: transformers' init (std 0.02): near-uniform logits, where greedy decoding is all ties;
- unit: unit-scale weights, peaked logits (tests compare greedy tokens with transformers);
- q4-grid: unit-scale weights that lie on a 4-bit grid per block of 32, like a model shipped
  Q4-quantized (the SmolLM2 GGUF). A random model has none of a trained model's tolerance to
  quantization (measured on 0.65b: int4 top-1 agreement with fp32 0.19 from hf, 0.45 from unit,
  under the build's 0.70 check); on the grid, kiln's int4 and int8 weights are exact and the
  check measures what a real model would show, so a quantized build of this size completes.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

# The shapes: hidden, layers, heads, kv heads, intermediate; vocab 49152 (SmolLM2's) for all.
PRESETS = {
    # SmolLM2-135M's shape, tied embeddings: 0.54 GB fp32 graph.
    "135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                 intermediate_size=1536, tie_word_embeddings=True, max_shard_size="100MB"),
    # 0.65B, untied: 1.3 GB bf16 in two shards, a 2.6 GB fp32 graph (over protobuf's 2 GiB).
    "0.65b": dict(hidden_size=1536, num_hidden_layers=20, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=4096, tie_word_embeddings=False, max_shard_size="700MB"),
    # The smallest Llama of this vocab whose fp32 graph passes 2 GiB (2.26 GB, 566M parameters):
    # few layers, so a build that must cross the limit stays short (the slow test's model).
    "over-2gib": dict(hidden_size=2048, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=4,
                      intermediate_size=8192, tie_word_embeddings=False, max_shard_size="700MB"),
    # 1.47B, untied: 2.9 GB bf16, a 5.9 GB fp32 graph.
    "1.5b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
                 intermediate_size=6912, tie_word_embeddings=False, max_shard_size="1GB"),
}
COMMON = dict(vocab_size=49152, max_position_embeddings=2048, bos_token_id=None, eos_token_id=258,
              pad_token_id=256)


def write_synthetic(preset: str, out: Path, seed: int = 0, weights: str = "hf") -> int:
    """Write the checkpoint folder; returns its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = dict(PRESETS[preset])
    shard = shape.pop("max_shard_size")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**shape, **COMMON), dtype=torch.bfloat16)
    if weights != "hf":
        WEIGHTS[weights](model, seed)
    model.save_pretrained(out, max_shard_size=shard)
    _write_tokenizer(out)
    return sum(p.numel() for p in model.parameters())


def _unit_scale(model, seed: int) -> None:
    """As tests/models/model_checkpoints.py: norms near 1, embeddings N(0, 1), linears N(0, 1/fan_in)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)


def _q4_grid(model, seed: int, block: int = 32) -> None:
    """Each matrix row in blocks of 32: w = ±s·(q - 8), q in 0..15, every block holding both ends (so
    its min/max is the grid's), a random sign per block (mean zero), s a power of two near
    1/(4.6·sqrt(fan_in)) (unit scale). Exact in bf16, exactly what kiln's int4 recipe (block minimum
    + scale) stores, and on the 8-bit grid with an integer zero point (8·17 or 7·17 steps): with a
    half-step zero point instead (w = s·(2q - 15)/2), every 8-bit block is off by the same amount,
    which adds up along K (measured: int8 top-1 0.035)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
                continue
            rows, cols = p.shape
            q = torch.randint(0, 16, (rows, cols // block, block), generator=g, dtype=torch.int16)
            q[..., 0], q[..., 1] = 0, 15
            fan_in = 1 if "embed_tokens" in name else cols
            step = 2.0 ** round(math.log2(fan_in ** -0.5 / 4.6))
            sign = torch.randint(0, 2, (rows, cols // block, 1), generator=g, dtype=torch.int16) * 2 - 1
            p.copy_((sign * (q - 8)).to(torch.float32).mul_(step).reshape(rows, cols))


WEIGHTS = {"unit": _unit_scale, "q4-grid": _q4_grid}


def _write_tokenizer(out: Path) -> None:
    import json

    from kiln.compiler.export.presets import CHATML_TEMPLATE, byte_level_tokenizer

    byte_level_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights", choices=["hf", *WEIGHTS], default="hf", help="see the module docstring")
    args = parser.parse_args()
    count = write_synthetic(args.preset, args.out, args.seed, args.weights)
    print(f"wrote {args.out}: {count / 1e6:.0f}M parameters ({args.preset}, {args.weights} weights, seed {args.seed})")


if __name__ == "__main__":
    main()
