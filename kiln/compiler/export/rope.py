"""Rotary embedding frequencies for each HF `rope_type`, in numpy (the build needs no torch).

Each function mirrors transformers' `modeling_rope_utils._compute_*_parameters` at the sequence
lengths kiln serves, and returns the inverse frequencies plus the factor HF multiplies cos/sin by.
Two types depend on the sequence length at run time in HF:
- `dynamic` (NTK) changes its base only past max_position_embeddings; below it, it is the default
  rope. kiln keeps max_model_len at max_position_embeddings, so it is exact where it runs and never
  serves the range where a static graph would differ.
- `longrope` switches from short to long factors once a call's last position passes the original
  context. The graph decides per sequence and call as HF does for one sequence (HF takes the max over
  the whole batch); keys already cached keep the factors they were rotated with, in both. A prompt
  prefilled in chunks that straddle the boundary differs from HF's single call (as HF's own would).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from kiln.contract.model_spec import ModelSpec, UnsupportedModelError


@dataclass(frozen=True)
class Rotary:
    inv_freq: np.ndarray                  # [rotary_dim/2] float32
    attention_scaling: float = 1.0        # HF multiplies cos and sin by it (yarn, longrope)
    long_inv_freq: np.ndarray | None = None   # longrope: frequencies from original_max on
    original_max: int = 0


def read_rope(cfg: dict) -> tuple[str, dict]:
    """(rope_type, parameters) from either transformers 5's rope_parameters or the older rope_scaling."""
    params = dict(cfg.get("rope_parameters") or {})
    params.update(cfg.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type == "su":        # Phi-3's early name for longrope
        rope_type = "longrope"
    if rope_type != "default" and "original_max_position_embeddings" in cfg:
        # Phi-3 keeps it beside, not inside, rope_scaling
        params.setdefault("original_max_position_embeddings", cfg["original_max_position_embeddings"])
    return rope_type, params


def rotary_for(spec: ModelSpec) -> Rotary:
    params = json.loads(spec.rope_scaling) if spec.rope_scaling else {}
    return ROPE_TYPES[spec.rope_type](spec, params)


def _exponents(spec: ModelSpec) -> np.ndarray:
    dim = spec.rotary_dim
    # NOTE: HF computes arange(0, dim, 2) / dim in float32, then base ** that in float32.
    return np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)


def _base_inv_freq(spec: ModelSpec) -> np.ndarray:
    return (1.0 / (np.float32(spec.rope_theta) ** _exponents(spec))).astype(np.float32)


def _default(spec: ModelSpec, params: dict) -> Rotary:
    return Rotary(_base_inv_freq(spec))


def _linear(spec: ModelSpec, params: dict) -> Rotary:
    return Rotary((_base_inv_freq(spec) / np.float32(params["factor"])).astype(np.float32))


def _llama3(spec: ModelSpec, params: dict) -> Rotary:
    inv_freq = _base_inv_freq(spec)
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return Rotary(np.where(medium, smoothed, scaled).astype(np.float32))


def _yarn(spec: ModelSpec, params: dict) -> Rotary:
    dim, base = spec.rotary_dim, spec.rope_theta
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor") or spec.max_position_embeddings / original_max
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))
    low, high = _yarn_correction_range(params.get("beta_fast") or 32, params.get("beta_slow") or 1,
                                       dim, base, original_max, params.get("truncate", True))
    pos_freqs = np.float32(base) ** _exponents(spec)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (np.float32(factor) * pos_freqs)
    if low == high:
        high += 0.001   # as HF: avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return Rotary(inv_freq.astype(np.float32), float(attention))


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_range(fast, slow, dim, base, max_pos, truncate) -> tuple[float, float]:
    def correction_dim(rotations):
        return (dim * math.log(max_pos / (rotations * 2 * math.pi))) / (2 * math.log(base))
    low, high = correction_dim(fast), correction_dim(slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _longrope(spec: ModelSpec, params: dict) -> Rotary:
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor") or spec.max_position_embeddings / original_max
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
    powers = np.float32(spec.rope_theta) ** _exponents(spec)

    def freqs(ext):
        return (1.0 / (np.asarray(ext, np.float32) * powers)).astype(np.float32)
    return Rotary(freqs(params["short_factor"]), float(attention), freqs(params["long_factor"]), original_max)


def _freq_factors(spec: ModelSpec, params: dict) -> Rotary:
    """A GGUF's rope_freqs table (how llama.cpp stores Llama 3.x's llama3 scaling): each frequency
    divided by its own factor, as ggml's rope does; the llama3 rule computed once by the converter."""
    return Rotary((_base_inv_freq(spec) / np.asarray(params["freq_factors"], np.float32)).astype(np.float32))


ROPE_TYPES = {
    "default": _default,
    "linear": _linear,
    "dynamic": _default,     # exact below max_position_embeddings, the longest kiln serves (above)
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
    "freq_factors": _freq_factors,
}

# The parameters each type needs, checked when the config is read so a bad config fails up front.
REQUIRED_PARAMS = {
    "default": (), "dynamic": ("factor",), "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "freq_factors": ("freq_factors",),
}


def check_rope(rope_type: str, params: dict, rotary_dim: int) -> None:
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling {rope_type!r} is not supported: kiln runs {', '.join(ROPE_TYPES)}")
    missing = [k for k in REQUIRED_PARAMS[rope_type] if params.get(k) is None]
    if missing:
        raise UnsupportedModelError(f"rope scaling {rope_type!r} needs {', '.join(missing)} in the config")
    for key in ("short_factor", "long_factor", "freq_factors"):
        if key in params and len(params[key]) != rotary_dim // 2:
            raise UnsupportedModelError(
                f"rope scaling {rope_type!r}: {key} has {len(params[key])} entries, rotary needs {rotary_dim // 2}")
