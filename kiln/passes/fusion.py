"""The fusion passes, in the order the build runs them, and why each one is there.

Measured with bench/bench_fusions.py (SmolLM2-135M fp32, ORT 1.32 CPU, ORT_ENABLE_ALL,
2 intra-op threads; median ms, ratio vs no fusion in the same run): see BENCHMARK below.

Attention: not fused. What ORT's CPU contrib ops offer does not fit a graph whose K/V the
kv_io pass turns into a gather from a paged pool:
- GroupQueryAttention wants past_key/past_value buffers it appends to itself (present shares
  the past buffer) and derives the mask from seqlens_k; it cannot take an already-gathered,
  already-concatenated K/V with an additive [B,S,T] mask.
- MultiHeadAttention does take key/value [B,kv_len,hidden] (or BNSH) plus attention_bias, but
  it has no grouped-query support (K/V must have num_heads heads), so K/V would first be
  repeated 3x for SmolLM2, tripling the KV traffic that dominates decode.
- Attention (com.microsoft) packs the QKV projection itself and also assumes num_heads K/V.
The standard-op attention stays; a native paged kernel is the real answer (ARCHITECTURE.md).
"""

from __future__ import annotations

from kiln.passes.fuse_norm import FuseRMSNorm, FuseSkipRMSNorm
from kiln.passes.fuse_projections import MergeProjections
from kiln.passes.fuse_rotary import FuseRotary

# NOTE: FuseSkipRMSNorm matches FuseRMSNorm's output, so it must come after it.
FUSION_PASSES = [FuseRMSNorm, FuseSkipRMSNorm, FuseRotary, MergeProjections]

ALL_FUSIONS = [FuseRMSNorm, FuseSkipRMSNorm, FuseRotary, MergeProjections]

BENCHMARK = """(filled in from bench/bench_fusions.py)"""


def fusion_passes(spec) -> list:
    """The winning fusions, configured for a model (the rotary caches need its max positions)."""
    return [cls.for_spec(spec) for cls in FUSION_PASSES]


__all__ = ["FUSION_PASSES", "ALL_FUSIONS", "fusion_passes", "FuseRMSNorm", "FuseSkipRMSNorm",
           "FuseRotary", "MergeProjections"]
