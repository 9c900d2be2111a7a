"""A GGUF's tensors -> kiln's HF-named fp32 weights, checked whole before any data is read, then
dequantized lazily: one tensor at a time, when the exporter asks for it (checkpoint.LazyWeights).

Names: llama.cpp's `token_embd`, `blk.N.attn_q`, ... map to the HF names the exporter reads. Its
`ffn_norm` is the norm before the MLP: HF's post_attention_layernorm in Llama-style models, but
pre_feedforward_layernorm in Gemma 2 / 3, whose post_attention_norm / post_ffw_norm are the
sandwich norms after attention and the MLP. Phi-3 files keep HF's fused attn_qkv and (as ffn_up)
gate_up_proj; they are split like an HF Phi-3 checkpoint's.
Values: q/k rows un-interleaved where llama.cpp permuted them; Gemma norms stored as w + 1 get
the 1 back off, in fp32 (the graph adds it again, as HF does).
"""

from __future__ import annotations

from functools import partial

import numpy as np

from kiln.compiler.export.checkpoint import LazyWeights
from kiln.compiler.export.families import expected_shapes, split_fused
from kiln.compiler.export.gguf_config import GGUFArch
from kiln.compiler.export.gguf_reader import GGUFError, GGUFFile, TensorInfo, readable
from kiln.contract.model_spec import ModelSpec

TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}
LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_qkv": "self_attn.qkv_proj",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
LLAMA_NORMS = {"ffn_norm": "post_attention_layernorm"}
SANDWICH_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                  "post_ffw_norm": "post_feedforward_layernorm"}
# read into the config (gguf_config._rope), or tables kiln computes itself (old llama files)
NOT_WEIGHTS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
NOT_WEIGHT_LEAVES = {"attn_rot_embd"}
READS = "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, the IQ and TQ types"


def lazy_weights(f: GGUFFile, arch: GGUFArch, spec: ModelSpec) -> LazyWeights:
    """HF name -> loader; every tensor the exporter reads is checked (present, shaped as the config
    implies, of a type kiln can dequantize) and nothing else is left over, before any is read."""
    named = _hf_names(f, arch)
    fused = "model.layers.0.self_attn.qkv_proj.weight" in named
    expected = expected_shapes(spec, fused)
    _check(f, named, expected)
    loaders = {hf: partial(_load, f, info, _transform(hf, arch, spec)) for hf, info in named.items()}
    weights = LazyWeights(loaders)
    if fused:
        split_fused(weights, spec)
    return weights


def _hf_names(f: GGUFFile, arch: GGUFArch) -> dict[str, TensorInfo]:
    norms = SANDWICH_NORMS if arch.sandwich_norms else LLAMA_NORMS
    # Phi-3's ffn_up holds gate and up together when the file has no ffn_gate
    fused_up = arch.model_type == "phi3" and "blk.0.ffn_gate.weight" not in f.tensors
    named = {}
    for name, info in f.tensors.items():
        hf = _hf_name(name, norms, fused_up)
        if hf is not None:
            named[hf] = info
    return named


def _hf_name(name: str, norms: dict, fused_up: bool) -> str | None:
    if name in TOP:
        return TOP[name]
    if name in NOT_WEIGHTS:
        return None
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] in ("weight", "bias"):
        leaf = parts[2]
        if leaf in NOT_WEIGHT_LEAVES:
            return None
        if fused_up and leaf == "ffn_up":
            return f"model.layers.{parts[1]}.mlp.gate_up_proj.{parts[3]}"
        hf = norms.get(leaf) or LAYER.get(leaf)
        if hf is not None:
            return f"model.layers.{parts[1]}.{hf}.{parts[3]}"
    raise GGUFError(f"tensor {name} has no place in kiln's graph (an architecture variant kiln does not build)")


def _check(f: GGUFFile, named: dict[str, TensorInfo], expected: dict[str, tuple[int, ...]]) -> None:
    by_hf = {hf: info.name for hf, info in named.items()}
    for hf, shape in expected.items():
        info = named.get(hf)
        if info is None:
            raise GGUFError(f"incomplete GGUF: {f.path.name} has no tensor for {hf}")
        if info.shape != shape:
            raise GGUFError(f"tensor {info.name} has shape {list(info.shape)}, the metadata implies {list(shape)}")
        if not readable(info.ggml_type):
            raise GGUFError(f"tensor {info.name} is stored as {info.type_name}, which gguf.quants cannot "
                            f"dequantize (kiln reads {READS})")
    extra = sorted(set(named) - set(expected))
    if extra:
        raise GGUFError(f"tensor {by_hf[extra[0]]} has no place in kiln's graph "
                        f"(it would be {extra[0]}, which this model's config does not use)")


def _transform(hf: str, arch: GGUFArch, spec: ModelSpec):
    if arch.permuted_qk and hf.endswith(("q_proj.weight", "k_proj.weight")):
        return partial(unpermute, heads=spec.num_heads if "q_proj" in hf else spec.num_kv_heads)
    if arch.norm_offset and hf.endswith("norm.weight"):
        return _minus_one
    return None


def _load(f: GGUFFile, info: TensorInfo, transform) -> np.ndarray:
    w = f.read(info.name)
    return w if transform is None else transform(w)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's permute: each head's rows were (pairs, 2) interleaved for llama.cpp's
    NORM rope; kiln's rotate-half rope wants the two halves of the head apart again."""
    half = w.shape[0] // heads // 2
    return np.ascontiguousarray(w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _minus_one(w: np.ndarray) -> np.ndarray:
    w -= np.float32(1.0)       # the array is this call's own copy
    return w
