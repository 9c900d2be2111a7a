"""Which model architectures the openvino backend builds exactly (the paged rewrite's attention core)."""

from __future__ import annotations

from kiln.contract.model_spec import ModelSpec
from kiln.engines.openvino.paged_graph import unsupported


def uncovered(spec: ModelSpec) -> str:
    """What of `spec` the paged-attention rewrite does not compute yet ("" when it covers it all).

    The rewrite replaces kiln's attention core with OpenVINO's PagedAttentionExtension. It takes each
    layer's sliding window (the operation's convention is kiln's, tests/unit/test_openvino_windows.py)
    and the scale head_dim**-0.5 (the exporter folds any other query scale into q), and everything
    outside the core (Gemma's norms and scaled embeddings, partial rotary, every rope type, final
    logit soft-capping) stays kiln's graph. What the operation cannot compute is refused, and
    `--backend auto` picks ort: today attention-score soft-capping (Gemma 2)."""
    return unsupported(spec)
