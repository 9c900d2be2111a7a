"""The fusion passes, in the order the build runs them, and why each one is there.

Measured with bench/bench_fusions.py on SmolLM2-135M fp32 (ORT 1.32 CPU, ORT_ENABLE_ALL, 2 intra-op
threads, spinning off, 2-core shared VM). Ratio = median over iterations of time / no-fusion time in
the same round-robin iteration; decode is B=1, S=1 over 256 past tokens, prefill B=1, S=256.

    variant                 decode ms  ratio    prefill ms  ratio      (run of 19:33, 200/15 iterations)
    none                      47.8     1.000      642      1.000       prefill ran under load here
    rms_norm                  47.3     0.983      635      1.000
    rms_norm+skip             47.5     0.982      672      1.056
    rotary                    47.2     0.985      628      0.979
    merge_projections         47.9     0.973      679      1.054
    rms_norm+rotary           47.4     0.981      645      1.024
    rms_norm+rotary+merge     46.8     0.944      671      1.041
    all four                  46.2     0.927      676      1.066

    quieter run (19:36, 200/30 iterations): none 52.4 / 329 ms; rms_norm+rotary+merge 0.982 / 0.962;
    all four 0.981 / 0.975. Two earlier runs: all four 0.973 / 0.993 and 0.972 / 1.020; prefill ratios
    of merge_projections alone 1.022, 0.943; rms_norm+skip vs rms_norm alone +1.7 %, +3.3 % prefill.

Reading: the fusions touch 1-3 % each, because decode here is MatMul (~60 %) and the attention
Transposes/Concats; together RMSNorm + rotary + merged projections win 2-6 % at decode and are
neutral-to-positive at prefill. SkipSimplifiedLayerNormalization adds nothing at decode beyond the
plain RMSNorm fusion in the quiet run and costs 1-5 % at prefill in every run, so it is not in
FUSION_PASSES (the pass stays, tested, for a later re-measure). MergeProjections' decode win is
steady; its prefill figure is noise-level either way, and one int8/int4 matmul per group suits
the quantize pass (which already knows qkv_proj).

Attention: not fused here, in the standard graph. `kiln build --attention gqa` has the kv_io pass
put GroupQueryAttention in place of the core (passes/attention_gqa.py, layout "paged-gqa"; opt-in,
its figures are there): fed the
gathered past as its past_key/past_value and the mask as seqlens_k, rather than an
already-concatenated K/V with an additive mask, which it cannot take. What the other contrib ops
offer, for the record (the standard core stays for TensorRT and the other backends):
- GroupQueryAttention takes a chunk with a past only at batch 1 (the ORT planner keeps to that).
- MultiHeadAttention does take key/value [B,kv_len,hidden] (or BNSH) plus attention_bias, but
  it has no grouped-query support (K/V must have num_heads heads), so K/V would first be
  repeated 3x for SmolLM2, tripling the KV traffic that dominates decode.
- Attention (com.microsoft) packs the QKV projection itself and also assumes num_heads K/V.
- Not a contrib op, but the closest fit: ONNX's own Attention (opset 23, which ORT 1.32 runs on
  CPU) takes K/V [B,kv_heads,T,hd] with kv_num_heads < q_num_heads and an additive mask. It needs
  the whole graph bumped from opset 21 and a Transpose of the kv-head-major [kv_heads,B,T,hd] K/V
  (free only at B=1), the copy the head-major pool exists to avoid. Not measured here.
A native paged kernel that reads the pool without the gather is still the real answer (ARCHITECTURE.md).
"""

from __future__ import annotations

from kiln.compiler.passes.fuse_norm import FuseRMSNorm, FuseSkipRMSNorm
from kiln.compiler.passes.fuse_projections import MergeProjections
from kiln.compiler.passes.fuse_rotary import FuseRotary

# The ones that win (figures above), in the order the build runs them.
FUSION_PASSES = [FuseRMSNorm, FuseRotary, MergeProjections]

# Every fusion, for tests and the benchmark. NOTE: FuseSkipRMSNorm matches FuseRMSNorm's output,
# so it must come after it.
ALL_FUSIONS = [FuseRMSNorm, FuseSkipRMSNorm, FuseRotary, MergeProjections]


def fusion_passes(spec, skipped: tuple[str, ...] = ()) -> list:
    """The winning fusions but the `skipped` names (a backend's Backend.skipped_fusions: OpenVINO's
    CPU plugin fuses the plain rotary pattern into its own RoPE kernel, while
    com.microsoft.RotaryEmbedding reaches it as a Transpose/Reshape chain), configured for a model
    (the rotary caches need its max positions)."""
    return [cls.for_spec(spec) for cls in FUSION_PASSES if cls.name not in skipped]


__all__ = ["FUSION_PASSES", "ALL_FUSIONS", "fusion_passes", "FuseRMSNorm", "FuseSkipRMSNorm",
           "FuseRotary", "MergeProjections"]
