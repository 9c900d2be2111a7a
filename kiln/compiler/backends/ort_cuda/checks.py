"""What a CPU can check of the PagedAttention graph before a GPU ever runs it.

ONNX Runtime resolves a graph (every node against its registered schema, types inferred through
the whole graph, the com.microsoft ops included) before it looks for kernels. The CPU provider has
no PagedAttention kernel, so a sound graph fails exactly there; any other failure is a defect in
the rewrite. onnx.checker alone cannot judge the graph: it does not know ORT's contrib ops.
"""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

from kiln.engines.ort.session import CPU_PROVIDERS

EXPECTED = "Could not find an implementation for PagedAttention"


class PagedGraphError(ValueError):
    """The rewritten graph does not resolve in ONNX Runtime."""


def check_resolves(model_path: Path) -> dict:
    """Resolve the graph in ONNX Runtime CPU; returns the check's record, raises on a defect."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 4
    try:
        ort.InferenceSession(str(model_path), opts, providers=CPU_PROVIDERS)
    except Exception as e:          # onnxruntime raises its own exception types per status code
        if EXPECTED in str(e):
            return {"check": "onnxruntime graph resolution (CPU)", "passed": True,
                    "note": "types and schemas resolve; PagedAttention has no CPU kernel"}
        first = str(e).strip().splitlines()[0]
        raise PagedGraphError(f"the PagedAttention graph does not resolve in ONNX Runtime: {first}") from None
    # A CPU kernel for PagedAttention would mean an onnxruntime this check was not written for.
    return {"check": "onnxruntime graph resolution (CPU)", "passed": True, "note": "session created"}
