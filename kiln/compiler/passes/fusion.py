"""The fusion passes, in the order the build runs them, and why each one is there.

Each fusion touches a small share of a decode step (decode is mostly MatMul here); together RMSNorm,
rotary and merged projections win a few percent at decode and are neutral-to-positive at prefill
(the figures and their command, `python bench/bench_fusions.py`: docs/results/2026-11-28-graph-fusions.md). One merged
int8/int4 matmul per projection group also suits the quantize pass (which knows qkv_proj).
Fusing the residual Add into the norm (SkipSimplifiedLayerNormalization) measured nothing at
decode while MatMulNBits dominated a step (and bench_fusions.py's sessions run ORT_ENABLE_ALL). On
kiln's own 4-bit kernels a one-stream decode is short enough that the engine's nodes cost as much
as their arithmetic: the fused graph (fewer nodes) decoded faster over alternating pairs of
processes, prefill no slower (docs/results/2026-12-06-figures-from-code-comments.md). ONNX Runtime only: the other
backends skip it (kiln.contract.backends).

Attention: not fused here, in the standard graph. `kiln build --attention gqa` has the kv_io pass
put GroupQueryAttention in place of the core (passes/attention_gqa.py, layout "paged-gqa"; opt-in).
Why not the other contrib ops: GroupQueryAttention takes a chunk with a past only at batch 1;
MultiHeadAttention and com.microsoft Attention assume num_heads K/V heads (K/V repeated three times
for SmolLM2, tripling decode's KV traffic); ONNX's own Attention (opset 23) needs the graph bumped from
opset 21 and a transpose of the kv-head-major K/V, the copy the head-major pool exists to avoid.
A native paged kernel that reads the pool without the gather is the real answer (docs/architecture.md).
"""

from __future__ import annotations

from kiln.compiler.plan import Fusion
from kiln.contract.backends import SkippedFusion
from kiln.compiler.passes.fuse_norm import FuseRMSNorm, FuseSkipRMSNorm
from kiln.compiler.passes.fuse_projections import MergeProjections
from kiln.compiler.passes.fuse_rotary import FuseRotary

# The ones that win (figures above), in the order the build runs them.
FUSION_PASSES = [FuseRMSNorm, FuseSkipRMSNorm, FuseRotary, MergeProjections]

# Every fusion, for tests and the benchmark. NOTE: FuseSkipRMSNorm matches FuseRMSNorm's output.
ALL_FUSIONS = [FuseRMSNorm, FuseSkipRMSNorm, FuseRotary, MergeProjections]


def planned_fusions(skipped: tuple[SkippedFusion, ...] = (), quant: str | None = None,
                    fuse: bool = True) -> tuple[Fusion, ...]:
    """Each winning fusion as the build plan records it: applied, applied without some parts, or off,
    with the reason. skipped: a backend's Backend.skipped_fusions (those for `quant` count)."""
    if not fuse:
        return tuple(Fusion(cls.name, False, reason="--no-fuse") for cls in FUSION_PASSES)
    fusions = []
    for cls in FUSION_PASSES:
        mine = [s for s in skipped if s.fusion == cls.name and s.applies_at(quant)]
        whole = [s for s in mine if not s.part]
        if whole:
            fusions.append(Fusion(cls.name, False, reason=whole[0].reason))
        else:
            fusions.append(Fusion(cls.name, True, tuple(s.part for s in mine), "; ".join(s.reason for s in mine)))
    return tuple(fusions)


def passes_for(fusions: tuple[Fusion, ...], spec) -> list:
    """The fusion passes a plan applies, in the build's order, configured for a model (the rotary
    caches need its max positions)."""
    by_name = {cls.name: cls for cls in FUSION_PASSES}
    passes = []
    for fusion in fusions:
        if fusion.applies:
            p = by_name[fusion.name].for_spec(spec)
            passes.append(p.without(list(fusion.without)) if fusion.without else p)
    return passes


def fusion_passes(spec, skipped: tuple[SkippedFusion, ...] = (), quant: str | None = None) -> list:
    """The winning fusions but the `skipped` ones (a backend's Backend.skipped_fusions, a part of a
    pass through its without(parts) method, some for one quant mode only), configured for a model."""
    return passes_for(planned_fusions(skipped, quant), spec)


__all__ = ["FUSION_PASSES", "ALL_FUSIONS", "fusion_passes", "planned_fusions", "passes_for", "FuseRMSNorm",
           "FuseSkipRMSNorm",
           "FuseRotary", "MergeProjections"]
