"""llama.cpp's GGUF architectures -> the HF config dict kiln's families read (families.py).

A GGUF has no config.json: its metadata, under `{arch}.*` keys, is the config, and some of what HF
states llama.cpp hard-codes per architecture instead (Gemma's sliding-window pattern and local rope
base, its attention scale). Each architecture string llama.cpp writes for a family kiln builds maps
here to that family's HF `model_type` plus the conventions of its tensors:
- `permuted_qk`: llama.cpp's converter interleaves the q/k rows of every architecture it runs with
  its NORM (GPT-J) rope -- llama, mistral3 (and mistral) -- so kiln's rotate-half graph needs them
  undone. NEOX-rope architectures (qwen2/3, phi3, gemma*) are stored in HF's row order.
- `norm_offset`: Gemma's converters store every RMSNorm weight (q/k norms too) as w + 1.
What kiln cannot run faithfully (experts, extra scales) is refused from the metadata alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from kiln.compiler.export.gguf_reader import GGUFError, GGUFFile, readable
from kiln.contract.model_spec import UnsupportedModelError


@dataclass(frozen=True)
class GGUFArch:
    model_type: str                 # the HF model_type: a key of families.FAMILIES
    permuted_qk: bool = False
    norm_offset: bool = False
    sandwich_norms: bool = False    # post_attention_norm / post_ffw_norm tensors (Gemma 2 / 3)
    extras: Callable[["_Keys", dict], dict] = lambda key, cfg: {}


class _Keys:
    """`{arch}.<name>` metadata with f32 values given as the shortest decimal that round-trips them
    (1e-05, not 9.999999747378752e-06), so a GGUF's spec reads like its HF config."""

    def __init__(self, f: GGUFFile, arch: str):
        self.f, self.arch = f, arch

    def __call__(self, name: str, default=None):
        value = self.f.get(f"{self.arch}.{name}", default)
        if isinstance(value, np.ndarray):
            value = _uniform(value, f"{self.arch}.{name}")
        if isinstance(value, float):
            return float(str(np.float32(value)))
        return value

    def has(self, name: str) -> bool:
        return f"{self.arch}.{name}" in self.f.metadata


def _uniform(values: np.ndarray, key: str):
    """A per-layer array (some files write head counts per layer): one value, or refused."""
    if values.size == 0 or (values != values.flat[0]).any():
        raise UnsupportedModelError(f"{key} differs between layers ({values.tolist()[:8]}...); kiln runs "
                                    "one value for every layer")
    return values.flat[0].item()


def _gemma_query_scalar(key: _Keys, cfg: dict, big_layers: int) -> float:
    # llama.cpp states no query_pre_attn_scalar: it takes hidden/heads for the 27B (its only
    # model where that differs from head_dim, recognised by the layer count) and head_dim otherwise.
    if key.has("attention.scale"):
        return float(key("attention.scale")) ** -2
    if cfg["num_hidden_layers"] == big_layers:
        return cfg["hidden_size"] / cfg["num_attention_heads"]
    return cfg["head_dim"]


def _sliding_types(key: _Keys, cfg: dict, period: int) -> dict:
    """layer_types from the window pattern: a period (every period-th layer full) or one flag per layer."""
    window = key("attention.sliding_window") or 0
    if not window:
        return {"sliding_window": None}
    pattern = key.f.get(f"{key.arch}.attention.sliding_window_pattern", period)
    n = cfg["num_hidden_layers"]
    if isinstance(pattern, np.ndarray):
        flags = [bool(x) for x in pattern.tolist()]
        if len(flags) != n:
            raise GGUFError(f"{key.arch}.attention.sliding_window_pattern has {len(flags)} flags for {n} layers")
    else:
        flags = [pattern == 0 or i % pattern < pattern - 1 for i in range(n)]   # as llama.cpp's set_swa_pattern
    return {"sliding_window": window, "layer_types": ["sliding_attention" if s else "full_attention" for s in flags]}


def _gemma(key: _Keys, cfg: dict) -> dict:
    return {"hidden_activation": "gelu_pytorch_tanh"}


def _gemma2(key: _Keys, cfg: dict) -> dict:
    extras = _sliding_types(key, cfg, period=2) | {
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": _gemma_query_scalar(key, cfg, 46)}
    # absent: llama.cpp's defaults, which are kiln's (50 / 30)
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if key.has(name):
            extras[name] = key(name)
    return extras


def _gemma3(key: _Keys, cfg: dict) -> dict:
    return _sliding_types(key, cfg, period=6) | {
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": _gemma_query_scalar(key, cfg, 62),
        "rope_local_base_freq": key("rope.freq_base_swa", 10000.0),    # llama.cpp's fixed local base
        "final_logit_softcapping": key("final_logit_softcapping"),
        "attn_logit_softcapping": key("attn_logit_softcapping")}


def _windowed(key: _Keys, cfg: dict) -> dict:
    return {"sliding_window": key("attention.sliding_window")}


def _phi3(key: _Keys, cfg: dict) -> dict:
    extras = _windowed(key, cfg)
    rotary = key("rope.dimension_count") or cfg["head_dim"]
    if rotary != cfg["head_dim"]:
        extras["partial_rotary_factor"] = rotary / cfg["head_dim"]
    return extras


ARCHITECTURES: dict[str, GGUFArch] = {
    # Llama 1/2/3.x, SmolLM, and Mistral / Mixtral: llama.cpp writes "llama" for them.
    "llama": GGUFArch("llama", permuted_qk=True),
    # Ministral 3 / Mistral 3 text: llama's layout under its own name.
    "mistral3": GGUFArch("mistral", permuted_qk=True, extras=_windowed),
    # No llama.cpp converter writes "mistral" (nor does llama.cpp or transformers read it); a file
    # that says it is taken in the layout every llama.cpp Mistral has, llama's.
    "mistral": GGUFArch("mistral", permuted_qk=True, extras=_windowed),
    "qwen2": GGUFArch("qwen2"),
    "qwen3": GGUFArch("qwen3"),
    "phi3": GGUFArch("phi3", extras=_phi3),
    "gemma": GGUFArch("gemma", norm_offset=True, extras=_gemma),
    "gemma2": GGUFArch("gemma2", norm_offset=True, sandwich_norms=True, extras=_gemma2),
    "gemma3": GGUFArch("gemma3_text", norm_offset=True, sandwich_norms=True, extras=_gemma3),
    "gemma3_text": GGUFArch("gemma3_text", norm_offset=True, sandwich_norms=True, extras=_gemma3),
}

# Metadata that changes the computation in ways kiln's graph does not carry.
_REFUSED_KEYS = ("expert_count", "logit_scale", "embedding_scale", "residual_scale",
                 "attention.temperature_scale", "attention.output_scale", "rope.scaling.alpha")


def check_architecture(arch: str) -> None:
    """Called as soon as the file's general.architecture is read, before the rest of it."""
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r}: kiln builds GGUF files of "
                                    f"architecture {', '.join(ARCHITECTURES)}")


def hf_config(f: GGUFFile) -> tuple[GGUFArch, dict]:
    """The architecture's conventions and an HF config dict for spec_from_hf_config."""
    arch_name = f.get("general.architecture")
    if not isinstance(arch_name, str):
        raise GGUFError(f"{f.path.name} has no general.architecture: not a model GGUF")
    check_architecture(arch_name)
    arch, key = ARCHITECTURES[arch_name], _Keys(f, arch_name)
    for name in _REFUSED_KEYS:
        if key(name):
            raise UnsupportedModelError(f"GGUF {arch_name} with {arch_name}.{name} = {key(name)} is not supported "
                                        "(kiln's graph has no mixture of experts or extra scales)")
    embed = f.tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise GGUFError(f"{f.path.name} has no 2-D token_embd.weight tensor")
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    cfg = {
        "model_type": arch.model_type,
        "vocab_size": embed.shape[0],       # the embedding is the truth; some files pad their token list
        "hidden_size": hidden,
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv") or heads,
        "head_dim": key("attention.key_length") or (hidden // heads if _positive(hidden, heads) else None),
        "intermediate_size": key("feed_forward_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": "blk.0.attn_q.bias" in f.tensors,
    }
    _require_ints(cfg, arch_name)
    cfg |= arch.extras(key, cfg)
    _refuse_head_shapes(key, cfg, arch_name)
    cfg |= _rope(f, key, arch_name)
    return arch, cfg


def _refuse_head_shapes(key: _Keys, cfg: dict, arch: str) -> None:
    """Values as wide as keys, and rotary over the whole head unless the family reads a partial one."""
    if (key("attention.value_length") or cfg["head_dim"]) != cfg["head_dim"]:
        raise UnsupportedModelError(f"GGUF {arch} with value heads of {key('attention.value_length')} "
                                    f"and key heads of {cfg['head_dim']} is not supported")
    rotary = key("rope.dimension_count") or cfg["head_dim"]
    if rotary != cfg["head_dim"] and "partial_rotary_factor" not in cfg:
        raise UnsupportedModelError(f"GGUF {arch} with rotary over {rotary} of {cfg['head_dim']} head "
                                    "dimensions is not supported")


def _positive(*values) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


def _require_ints(cfg: dict, arch: str) -> None:
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "head_dim"):
        if not _positive(cfg[name]):
            raise GGUFError(f"the GGUF has no usable {arch} value for {name} ({cfg[name]!r})")
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise GGUFError(f"the GGUF's {cfg['num_attention_heads']} attention heads do not group over its "
                        f"{cfg['num_key_value_heads']} kv heads")


def _rope(f: GGUFFile, key: _Keys, arch: str) -> dict:
    """rope_scaling from `{arch}.rope.scaling.*`, and the per-frequency tables llama.cpp stores as
    tensors: rope_freqs (Llama 3.x's llama3 scaling) and rope_factors_long/short (Phi-3 longrope)."""
    kind = key("rope.scaling.type") or ("linear" if key("rope.scale_linear") else "none")
    has_freqs = "rope_freqs.weight" in f.tensors
    if "rope_factors_long.weight" in f.tensors:
        kind = "longrope"
    if has_freqs and kind not in ("none", "longrope"):
        raise UnsupportedModelError(f"GGUF {arch} with both rope_freqs and {kind} rope scaling is not supported")
    if kind == "longrope":
        return {"rope_scaling": _longrope(f, key, arch)}
    if has_freqs:
        return {"rope_scaling": {"rope_type": "freq_factors", "freq_factors": _table(f, "rope_freqs.weight")}}
    if kind == "none":
        return {}
    if kind == "linear":
        factor = key("rope.scaling.factor") or key("rope.scale_linear")
        return {"rope_scaling": {"rope_type": "linear", "factor": factor}}
    if kind == "yarn":
        params = {"rope_type": "yarn", "factor": key("rope.scaling.factor"),
                  "original_max_position_embeddings": key("rope.scaling.original_context_length"),
                  "beta_fast": key("rope.scaling.yarn_beta_fast"), "beta_slow": key("rope.scaling.yarn_beta_slow")}
        if arch == "mistral3":
            # llama.cpp's mistral3 graph divides yarn's magnitude scaling back out (attn_factor)
            params["attention_factor"] = 1.0
        return {"rope_scaling": {k: v for k, v in params.items() if v is not None}}
    raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported")


def _longrope(f: GGUFFile, key: _Keys, arch: str) -> dict:
    if "rope_factors_short.weight" not in f.tensors:
        raise GGUFError(f"{f.path.name}: longrope needs rope_factors_long and rope_factors_short")
    return {"rope_type": "longrope", "long_factor": _table(f, "rope_factors_long.weight"),
            "short_factor": _table(f, "rope_factors_short.weight"),
            "original_max_position_embeddings": key("rope.scaling.original_context_length")}


def _table(f: GGUFFile, name: str) -> list[float]:
    """A small per-frequency rope table, as the shortest decimals of its f32 values (see _Keys)."""
    info = f.tensors[name]
    if len(info.shape) != 1 or info.shape[0] > 4096 or not readable(info.ggml_type):
        raise GGUFError(f"{f.path.name}: {name} ({info.type_name}, shape {list(info.shape)}) is not a "
                        "per-frequency table kiln can read")
    return [float(str(v)) for v in f.read(name)]
