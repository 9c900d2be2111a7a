"""Gemma, Gemma 2 and Gemma 3 (text): what their configs turn on in kiln's decoder graph.

Gemma (1): RMSNorm scaling by (1 + weight), embeddings times sqrt(hidden_size), GeGLU (tanh GELU).
Gemma 2 and 3 add sandwich norms, scores scaled by query_pre_attn_scalar^-1/2 and sliding-window
layers interleaved with full ones (layer_types). Gemma 2 adds tanh soft-capping of scores and
logits; Gemma 3 adds q/k RMSNorm and a rope base of its own for the sliding layers.
"""

from __future__ import annotations

import numpy as np

from kiln.compiler.export.rope import read_rope
from kiln.contract.model_spec import UnsupportedModelError


def _layer_types(cfg: dict, every: int) -> tuple[str, ...]:
    """HF's default when the config has none: every `every`-th layer is full attention."""
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    return tuple("sliding_attention" if (i + 1) % every else "full_attention" for i in range(cfg["num_hidden_layers"]))


def _common(cfg: dict, every: int) -> dict:
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("Gemma with bidirectional attention is not a decoder kiln serves")
    types = _layer_types(cfg, every)
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported")
    window = int(cfg.get("sliding_window") or 0)
    if window >= cfg.get("max_position_embeddings", 8192):
        window = 0
    return dict(
        layer_types=types if window else (), sliding_window=window, activation="gelu_tanh", norm_offset=1.0,
        # NOTE: HF multiplies by the fp32 value of sqrt(hidden_size); the graph's constant is that fp32.
        embed_scale=float(np.float32(cfg["hidden_size"] ** 0.5)), sandwich_norms=True,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)))


def gemma_extras(cfg: dict) -> dict:
    """Gemma (1): the (1 + w) norms, scaled embeddings and GeGLU, without Gemma 2's additions."""
    return dict(activation="gelu_tanh", norm_offset=1.0, embed_scale=float(np.float32(cfg["hidden_size"] ** 0.5)))


def gemma2_extras(cfg: dict) -> dict:
    return _common(cfg, every=2) | dict(
        attn_softcap=float(cfg.get("attn_logit_softcapping", 50.0) or 0.0),
        final_softcap=float(cfg.get("final_logit_softcapping", 30.0) or 0.0))


def gemma3_extras(cfg: dict) -> dict:
    extras = _common(cfg, every=cfg.get("sliding_window_pattern", 6)) | dict(
        attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0))
    if extras["sliding_window"]:
        extras["local_rope_theta"] = _local_theta(cfg)
    return extras


def gemma3_rope(cfg: dict) -> tuple[str, dict]:
    """The full-attention layers' rope: transformers 5 nests it per layer type; older configs do not."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        return read_rope({"rope_parameters": params["full_attention"]})
    rope_type, params = read_rope({k: v for k, v in cfg.items() if k != "rope_parameters"})
    params.setdefault("rope_theta", cfg.get("rope_theta", 1e6))     # HF's global default for Gemma 3
    return rope_type, params


def _local_theta(cfg: dict) -> float:
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention")
    if local is None:
        return float(cfg.get("rope_local_base_freq", 10000.0))
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"Gemma 3 sliding layers with rope {local['rope_type']!r} are not supported")
    return float(local.get("rope_theta", 10000.0))
