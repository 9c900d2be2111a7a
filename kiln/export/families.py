"""The registry of model families kiln exports: HF `model_type` -> how to read its config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kiln.export.spec import ModelSpec, UnsupportedModelError


@dataclass(frozen=True)
class Family:
    name: str
    attention_bias: Callable[[dict], bool]


def _llama_bias(cfg: dict) -> bool:
    return bool(cfg.get("attention_bias", False))


FAMILIES: dict[str, Family] = {
    # Llama covers SmolLM and Mistral-style configs (GQA, RMSNorm, SwiGLU, rotate-half RoPE).
    "llama": Family("llama", _llama_bias),
    "mistral": Family("llama", _llama_bias),
    # Qwen2 is Llama with biases on q/k/v.
    "qwen2": Family("qwen2", lambda cfg: True),
}


def family_for(model_type: str) -> Family:
    try:
        return FAMILIES[model_type]
    except KeyError:
        supported = ", ".join(sorted(FAMILIES))
        raise UnsupportedModelError(
            f"unsupported architecture {model_type!r}: kiln exports {supported}"
        ) from None


def spec_from_hf_config(cfg: dict) -> ModelSpec:
    """Read an HF config.json dict into a ModelSpec, refusing what kiln cannot run faithfully."""
    family = family_for(cfg.get("model_type", "<missing model_type>"))
    _refuse_unsupported_features(cfg)
    heads = cfg["num_attention_heads"]
    return ModelSpec(
        family=family.name,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(_rope_theta(cfg)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=family.attention_bias(cfg),
    )


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    return params.get("rope_theta", cfg.get("rope_theta", 10000.0))


def _refuse_unsupported_features(cfg: dict) -> None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", None):
        raise UnsupportedModelError(f"rope scaling {rope_type!r} is not supported yet")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"activation {cfg['hidden_act']!r} is not supported")
    if cfg.get("sliding_window") and cfg.get("use_sliding_window"):
        raise UnsupportedModelError("sliding-window attention is not supported")
