"""Which model architectures the openvino backend builds exactly (the paged rewrite's attention core)."""

from __future__ import annotations

from kiln.contract.model_spec import ModelSpec


def uncovered(spec: ModelSpec) -> str:
    """What of `spec` the paged-attention rewrite does not compute yet ("" when it covers it all).

    The rewrite replaces kiln's attention core with OpenVINO's PagedAttentionExtension, which takes a
    scale, one sliding window and no score soft-capping; anything else would be computed wrongly, so
    it is refused (and `--backend auto` picks ort)."""
    if spec.sliding_window or any(spec.layer_window(i) for i in range(spec.num_layers)):
        return "sliding-window attention"
    if spec.attn_softcap:
        return "attention soft-capping"
    if abs(spec.query_scale - spec.head_dim ** -0.5) > 1e-12:
        return "a query scale other than head_dim ** -0.5"
    return ""
