"""Tiny random checkpoints made with transformers' own model classes, one per family/variant.

Saved the way people ship models: bf16, sharded (model.safetensors.index.json), with a tokenizer.
Weights are re-drawn at unit scale (HF's 0.02 init makes near-uniform logits, where greedy
decoding is all ties and a broken graph could still pass).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kiln.compiler.export.presets import CHATML_TEMPLATE, byte_level_tokenizer

BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, rms_norm_eps=1e-6, max_position_embeddings=256, vocab_size=259,
            tie_word_embeddings=False, bos_token_id=None, eos_token_id=258, pad_token_id=256)

# name -> (transformers config class name, config overrides)
VARIANTS = {
    "llama": ("LlamaConfig", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "llama-tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama3-rope": ("LlamaConfig", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama-linear-rope": ("LlamaConfig", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                "factor": 4.0})),
    "llama-dynamic-rope": ("LlamaConfig", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                                 "factor": 2.0})),
    "llama-yarn-rope": ("LlamaConfig", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 1000000.0})),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    "mistral-window": ("MistralConfig", dict(sliding_window=8, head_dim=16)),
    "qwen2-window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)),
    "qwen2-window-some-layers": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "phi3": ("Phi3Config", dict(pad_token_id=256)),
    "phi3-window": ("Phi3Config", dict(sliding_window=8)),
    "gemma": ("GemmaConfig", dict(head_dim=16, tie_word_embeddings=True)),
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", dict(
        head_dim=16, sliding_window=8, query_pre_attn_scalar=24, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "phi3-longrope-partial": ("Phi3Config", dict(
        partial_rotary_factor=0.75, original_max_position_embeddings=32, tie_word_embeddings=True,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "short_factor": [1.0 + 0.1 * i for i in range(6)],
                         "long_factor": [2.0 + 0.5 * i for i in range(6)]})),
}


def make_config(variant: str):
    import transformers

    cls_name, overrides = VARIANTS[variant]
    return getattr(transformers, cls_name)(**(BASE | overrides))


def write_checkpoint(variant: str, out: Path, seed: int = 0, dtype=torch.bfloat16,
                     max_shard_size: str | None = "60KB") -> Path:
    """A seeded random checkpoint folder of `variant`, as transformers itself saves it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(variant), dtype=torch.float32)
    _unit_scale(model, seed)
    model.to(dtype)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kw)
    _write_tokenizer(out)
    return out


@torch.no_grad()
def _unit_scale(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 1 and name.endswith("norm.weight"):
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        elif p.ndim == 1:                                   # biases
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)


def _write_tokenizer(out: Path) -> None:
    byte_level_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE}, indent=1))


def load_hf(folder: Path):
    """transformers' model on the same (bf16) weights, in fp32: the parity reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
