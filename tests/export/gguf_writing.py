"""Tiny GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them, from tiny HF models.

Each starts as a transformers model with seeded unit-scale weights. Its tensors are renamed with the
`gguf` package's own name map (not kiln's), get the converter's transforms (q/k rows permuted for
llama-rope architectures, Gemma norms stored as w + 1, Llama 3's rope as a rope_freqs table) and are
written quantized; every quantized tensor's dequantized values are put back into the HF model, so
the model computes exactly what the file holds and is the reference for kiln's build of the file.
The file itself is written by the benchmarks' GGUF writer (bench/gguf_models.py), the only one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import gguf
from gguf import GGMLQuantizationType as Q

from bench.gguf_models import hparams, tokenizer_metadata, write_gguf_file
from kiln.compiler.export.presets import CHATML_TEMPLATE

BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
GEMMA3_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}

# name -> (general.architecture, transformers config class, overrides)
MODELS = {
    "llama": ("llama", "LlamaConfig", dict(rope_parameters={"rope_type": "default", "rope_theta": 50000.0})),
    "llama3-rope": ("llama", "LlamaConfig", dict(rope_parameters=LLAMA3_ROPE)),
    "mistral": ("mistral", "MistralConfig", dict(sliding_window=None, head_dim=32)),
    "mistral3": ("mistral3", "MistralConfig", dict(sliding_window=None)),
    "qwen2": ("qwen2", "Qwen2Config", dict(tie_word_embeddings=True,
                                           rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3": ("qwen3", "Qwen3Config", dict(head_dim=128, tie_word_embeddings=True)),
    "phi3": ("phi3", "Phi3Config", dict()),
    # Phi-3.5 / Phi-4-mini style: partial rotary and longrope, whose factors llama.cpp stores as tensors
    "phi3-longrope": ("phi3", "Phi3Config", dict(
        partial_rotary_factor=0.75, original_max_position_embeddings=32, tie_word_embeddings=True,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "short_factor": [1.0 + 0.1 * i for i in range(6)],
                         "long_factor": [2.0 + 0.5 * i for i in range(6)]})),
    "llama-kquants": ("llama", "LlamaConfig", dict(hidden_size=256, intermediate_size=512)),
    "gemma": ("gemma", "GemmaConfig", dict(head_dim=16, tie_word_embeddings=True)),
    # head_dim 256: transformers' GGUF loader assumes Gemma's query_pre_attn_scalar 256 (llama.cpp: head_dim)
    "gemma2": ("gemma2", "Gemma2Config", dict(head_dim=256, sliding_window=8, tie_word_embeddings=True)),
    "gemma3": ("gemma3", "Gemma3TextConfig", dict(num_hidden_layers=6, head_dim=256, sliding_window=8,
                                                  tie_word_embeddings=True, rope_parameters=GEMMA3_ROPE)),
}
PERMUTED = {"llama", "mistral", "mistral3"}   # architectures run with llama.cpp's NORM rope
NORM_PLUS_ONE = {"gemma", "gemma2", "gemma3"}
NAME_MAPS = {"mistral": "llama"}          # no MODEL_ARCH of its own in gguf-py

# HF weight name fragment -> the type it is written in (1-D tensors stay F32, as llama.cpp keeps them)
MIXED = [("embed_tokens", Q.Q8_0), ("q_proj", Q.Q8_0), ("k_proj", Q.Q5_1), ("v_proj", Q.BF16),
         ("o_proj", Q.Q4_1), ("gate_proj", Q.Q4_0), ("up_proj", Q.Q5_0), ("down_proj", Q.Q4_1),
         ("qkv_proj", Q.Q8_0), ("gate_up_proj", Q.Q5_0), ("lm_head", Q.F16)]
# what llama-quantize's K mixes write (rows of 256: the "llama-kquants" model)
K_MIXED = [("embed_tokens", Q.Q6_K), ("q_proj", Q.Q4_K), ("k_proj", Q.Q5_K), ("v_proj", Q.Q6_K),
           ("o_proj", Q.Q3_K), ("gate_proj", Q.Q2_K), ("up_proj", Q.Q4_K), ("down_proj", Q.Q5_K),
           ("lm_head", Q.Q6_K)]
# where each K-quant block keeps its f16 super-block scale d (and dmin, where it has one)
K_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


@dataclass
class Written:
    path: Path
    model: torch.nn.Module        # the HF model holding exactly the file's values (fp32)
    tokenizer: dict               # what was written as tokenizer metadata


def write_gguf(name: str, folder: Path, quants=MIXED, seed: int = 0, arch: str | None = None,
               with_tokenizer: bool = True, eot_token_id: int | None = None, vocab_size: int | None = None,
               embed_std: float = 1.0, config: dict | None = None) -> Written:
    """A tiny `name` model as a GGUF file in `folder`, and its HF reference model. vocab_size: the
    tokenizer padded with unused tokens to that many (as Gemma 3's 262,144); embed_std: the
    embedding's scale (unit by default); config: further config overrides."""
    arch_default, cls_name, overrides = MODELS[name]
    arch = arch or arch_default
    tok = spm_tokenizer() if arch.startswith("gemma") else byte_level_tokenizer()
    if vocab_size:
        tok = padded(tok, vocab_size)
    model = _hf_model(cls_name, BASE | overrides | (config or {}) | tok["ids"], len(tok["tokens"]), seed, embed_std)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"tiny-{name}.gguf"
    metadata = _metadata(model.config) | (_tokenizer_metadata(tok) if with_tokenizer else {})
    metadata["eot_token_id"] = eot_token_id          # llama.cpp writes Gemma's <end_of_turn> here
    write_gguf_file(path, arch, metadata, _tensors(model, arch, quants, np.random.default_rng(seed)))
    return Written(path, model.eval(), tok)


def _hf_model(cls_name: str, cfg: dict, vocab: int, seed: int, embed_std: float = 1.0):
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, cls_name)(**cfg, vocab_size=vocab)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():      # unit scale: HF's 0.02 init makes all-tie logits
            if p.ndim == 1:
                p.copy_((1 if pname.endswith("norm.weight") else 0) + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (embed_std if "embed" in pname else p.shape[1] ** -0.5))
    return model


def _rope_theta(config) -> float:
    params = config.rope_parameters
    return float((params.get("full_attention") or params)["rope_theta"])


def _metadata(config) -> dict:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    meta = hparams(context=config.max_position_embeddings, hidden=config.hidden_size,
                   layers=config.num_hidden_layers, ffn=config.intermediate_size, heads=heads,
                   kv_heads=config.num_key_value_heads, head_dim=head_dim,
                   rope_dims=int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0)),
                   eps=config.rms_norm_eps, rope_base=_rope_theta(config),
                   window=getattr(config, "sliding_window", None) or None)
    if config.model_type == "gemma2":
        meta |= dict(attn_logit_softcapping=config.attn_logit_softcapping,
                     final_logit_softcapping=config.final_logit_softcapping)
    if config.rope_parameters.get("rope_type") == "longrope":       # as convert_hf_to_gguf.py's Phi3MiniModel
        meta["rope_scaling_orig_ctx_len"] = config.original_max_position_embeddings
    return meta


def _tensors(model, arch: str, quants, rng):
    """(name, stored values, GGML type) per tensor, the converter's way; the model gets the values back."""
    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[NAME_MAPS.get(arch, arch).upper()], config.num_hidden_layers)
    state = model.state_dict()
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        data = tensor.numpy().astype(np.float32)
        qtype = next((t for frag, t in quants if frag in base), Q.F32) if data.ndim == 2 else Q.F32
        if qtype == Q.Q8_K:         # no dequantizer anywhere in Python: for the refusal test only
            stored = exact = rng.integers(0, 256, (data.shape[0], data.shape[1] // 256 * 292), dtype=np.uint8)
        else:
            if qtype in K_SCALES:
                stored = kquant_blocks(data.shape, qtype, rng, float(data.std()))
            else:
                stored = gguf.quants.quantize(data, qtype)
            exact = gguf.quants.dequantize(stored, qtype).reshape(data.shape).astype(np.float32)
            tensor.copy_(torch.from_numpy(exact))       # the reference holds what the file holds
        if arch in PERMUTED and base.endswith(("q_proj", "k_proj")):
            # rows are whole blocks, so the quantized rows permute as the values do
            heads = config.num_attention_heads if base.endswith("q_proj") else config.num_key_value_heads
            stored = permute(stored, heads)
        if arch in NORM_PLUS_ONE and hf_name.endswith("norm.weight"):
            stored = exact + np.float32(1.0)
        yield f"{names.get_name(base)}.{suffix}", stored, qtype
    rope = config.rope_parameters
    if rope.get("rope_type") == "llama3":
        yield "rope_freqs.weight", llama3_rope_factors(config), None
    if rope.get("rope_type") == "longrope":       # as convert_hf_to_gguf.py's Phi3MiniModel
        yield "rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32), None
        yield "rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32), None


def kquant_blocks(shape: tuple[int, int], qtype: Q, rng, std: float) -> np.ndarray:
    """Random K-quant rows with finite scales, scaled to `std`: gguf-py cannot quantize to K types,
    but any bytes laid out as K blocks are a valid tensor of that type."""
    rows, cols = shape
    blocks = rng.integers(0, 256, (rows, cols // 256, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)

    def set_scales(value: float) -> None:
        for offset in K_SCALES[qtype]:
            blocks[..., offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    set_scales(1.0)
    # every K type's values are linear in d (and dmin), so one rescale of both reaches the target
    set_scales(std / float(gguf.quants.dequantize(blocks.reshape(rows, -1), qtype).std()))
    return blocks.reshape(rows, -1)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(config) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: llama3 rope as one factor per frequency."""
    p = config.rope_parameters
    dim = config.head_dim
    freqs = 1.0 / (p["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_wavelen = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wavelen = p["original_max_position_embeddings"] / p["high_freq_factor"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(p["factor"])
        else:
            smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / (
                p["high_freq_factor"] - p["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return np.asarray(factors, np.float32)


# --- tokenizers ------------------------------------------------------------------------------

def byte_level_tokenizer() -> dict:
    """gpt2-type (byte-level BPE) metadata: the 256 byte symbols, a few merges, three control tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = sorted(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "a n", "e r", "o n", "Ġ a", "r e", "a t"]
    tokens = symbols + ["".join(m.split()) for m in merges] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 3]
    n = len(tokens)
    return dict(model="gpt2", pre="default", tokens=tokens, types=types, merges=merges, scores=None,
                bos=n - 2, eos=n - 1, pad=n - 3, add_bos=False, template=CHATML_TEMPLATE,
                ids=dict(bos_token_id=None, eos_token_id=n - 1, pad_token_id=n - 3))


GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                  "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def spm_tokenizer() -> dict:
    """llama-type (sentencepiece) metadata as Gemma files have it: specials, the byte fallbacks, pieces."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    pieces = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["\u2581t", "he", "\u2581the", "in"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [3, 3, 3, 2, 4, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))]
    return dict(model="llama", pre="default", tokens=tokens, types=types, merges=None, scores=scores,
                bos=2, eos=1, pad=0, add_bos=True, template=GEMMA_TEMPLATE,
                ids=dict(bos_token_id=2, eos_token_id=1, pad_token_id=0))


def padded(tok: dict, vocab_size: int) -> dict:
    """The tokenizer with unused tokens appended up to vocab_size (published vocabularies carry many)."""
    extra = vocab_size - len(tok["tokens"])
    scores = None if tok["scores"] is None else tok["scores"] + [0.0] * extra
    return dict(tok, tokens=tok["tokens"] + [f"<unused{i}>" for i in range(extra)], types=tok["types"] + [5] * extra,
                scores=scores)


def _tokenizer_metadata(tok: dict) -> dict:
    return tokenizer_metadata(**{k: tok[k] for k in ("model", "pre", "tokens", "types", "merges", "scores", "bos",
                                                     "eos", "pad", "add_bos", "template")})
