"""Model sources -> (ModelSpec, HF-named fp32 weights, tokenizer folder).

Three kinds of source: an HF checkpoint folder, a GGUF file, or a preset name.
Weights come back in Hugging Face naming and layout ([out, in] for linears), whatever the source.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kiln.compiler.export import presets
from kiln.compiler.export.families import spec_from_hf_config
from kiln.contract.model_spec import ModelSpec


@dataclass
class ModelSource:
    description: str
    spec: ModelSpec
    weights: dict[str, np.ndarray]
    tokenizer_dir: Path            # holds tokenizer.json (+ tokenizer_config.json)
    hf_dir: Path | None = None     # an HF folder transformers can load (for parity tests)
    _keepalive: list = field(default_factory=list, repr=False)


def load_source(source: str) -> ModelSource:
    """Resolve a preset name, a .gguf path or an HF folder."""
    if source in presets.PRESETS:
        return _load_preset(presets.PRESETS[source]())
    path = Path(source)
    if path.suffix == ".gguf" and path.is_file():
        return load_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return load_hf_folder(path)
    raise FileNotFoundError(
        f"{source!r} is neither a preset ({', '.join(presets.PRESETS)}), a .gguf file, "
        "nor a folder with config.json"
    )


def _load_preset(files: presets.PresetFiles) -> ModelSource:
    src = load_gguf(files.path) if files.path.suffix == ".gguf" else load_hf_folder(files.path)
    src.description = files.description or src.description
    if files.keepalive is not None:
        src._keepalive.append(files.keepalive)
    return src


def load_hf_folder(path: Path) -> ModelSource:
    """An HF folder: bf16/fp16/fp32 safetensors, one file or sharded; checked before it is read."""
    from kiln.compiler.export.checkpoint import load_tensors
    from kiln.compiler.export.families import expected_shapes, family_for, split_fused

    cfg = json.loads((path / "config.json").read_text())
    spec = spec_from_hf_config(cfg)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}: kiln needs a fast tokenizer")
    fused = family_for(cfg["model_type"]).fused_projections
    weights = load_tensors(path, expected_shapes(spec, fused))
    if fused:
        split_fused(weights, spec)
    return ModelSource(f"HF folder {path}", spec, weights, path, hf_dir=path)


# --- GGUF -----------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def load_gguf(path: Path) -> ModelSource:
    import gguf

    reader = gguf.GGUFReader(str(path))
    cfg = _hf_config_from_gguf(reader)
    spec = spec_from_hf_config(cfg)
    weights = {_hf_name(t.name): _dequantize(t) for t in reader.tensors}
    if spec.family == "llama":
        _unpermute_qk(weights, spec)
    tmp = tempfile.TemporaryDirectory(prefix="kiln-gguf-tok-")
    _save_gguf_tokenizer(path, Path(tmp.name))
    src = ModelSource(f"GGUF {path}", spec, weights, Path(tmp.name))
    src._keepalive.append(tmp)
    return src


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _hf_config_from_gguf(reader) -> dict:
    arch = _field(reader, "general.architecture")
    a = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    tensor_names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    return {
        "model_type": arch,
        "vocab_size": a("vocab_size") or len(tokens),
        "hidden_size": a("embedding_length"),
        "num_hidden_layers": a("block_count"),
        "num_attention_heads": a("attention.head_count"),
        "num_key_value_heads": a("attention.head_count_kv"),
        "intermediate_size": a("feed_forward_length"),
        "rms_norm_eps": a("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": a("rope.freq_base", 10000.0),
        "max_position_embeddings": a("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[gguf_name]
    _, layer, rest = gguf_name.split(".", 2)
    return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[rest]}"


def _dequantize(tensor) -> np.ndarray:
    from gguf.quants import dequantize

    return np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


def _unpermute_qk(weights: dict[str, np.ndarray], spec: ModelSpec) -> None:
    # NOTE: llama.cpp's converter interleaves q/k rows for its rotary kernel; undo it so the
    # weights use HF's rotate-half convention again.
    for i in range(spec.num_layers):
        for proj, heads in (("q_proj", spec.num_heads), ("k_proj", spec.num_kv_heads)):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            w = weights[name]
            half = w.shape[0] // heads // 2
            weights[name] = np.ascontiguousarray(
                w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
            )


def _save_gguf_tokenizer(path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(out))
