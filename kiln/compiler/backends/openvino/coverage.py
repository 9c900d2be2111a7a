"""Which model architectures the openvino backend builds exactly, and with which attention core."""

from __future__ import annotations

from kiln.contract.model_spec import ModelSpec
from kiln.engines.openvino.paged_graph import unsupported


def uncovered(spec: ModelSpec) -> str:
    """What of `spec` the openvino backend does not compute yet ("" when it covers it all).

    Every family kiln exports is covered. The paged rewrite replaces kiln's attention core with
    OpenVINO's PagedAttentionExtension, which takes each layer's sliding window (the operation's
    convention is kiln's, tests/engines/openvino/test_openvino_windows.py) and the scale head_dim**-0.5 (the
    exporter folds any other query scale into q); everything outside the core (Gemma's norms and
    scaled embeddings, partial rotary, every rope type, final logit soft-capping) stays kiln's
    graph. What the operation cannot compute (attention-score soft-capping, Gemma 2) keeps kiln's
    paged gather in the graph instead (attention_core)."""
    return ""


def attention_core(spec: ModelSpec) -> tuple[str, str]:
    """(engine record layout, why) of the attention an openvino build of `spec` runs."""
    from kiln.engines.openvino.engine import GATHER_LAYOUT, PAGED_LAYOUT

    missing = unsupported(spec)
    if missing:
        what = missing.split(" (")[0]           # "attention soft-capping (OpenVINO's ...)" -> its name
        return GATHER_LAYOUT, f"kiln's paged gather in the graph: OpenVINO's paged attention has no {what}"
    return PAGED_LAYOUT, "OpenVINO's native paged attention"
