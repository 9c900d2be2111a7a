"""What a CPU can check of the PagedAttention graph before a GPU ever runs it.

ONNX Runtime resolves a graph (every node against its registered schema, types inferred through
the whole graph, the com.microsoft ops included) before it looks for kernels. The CPU provider has
no PagedAttention kernel, so a sound graph fails exactly there; any other failure is a defect in
the rewrite. onnx.checker alone cannot judge the graph: it does not know ORT's contrib ops.

Releases say "no CPU kernel" differently (NO_CPU_KERNEL): 1.32 fails the kernel lookup by the op's
name; 1.31 first casts the op's fp16 inputs to fp32 itself (the CPU provider's cast insertion for
nodes it has no fp16 kernel for) and then fails type resolution on a cast it inserted. Both mean
the same; a type error on a tensor the rewrite made is still a defect.
"""

from __future__ import annotations

import re
from pathlib import Path

import onnxruntime as ort

from kiln.engines.ort.session import CPU_PROVIDERS

# ONNX Runtime names the casts it inserts with this prefix (its insert-cast transformer).
ORT_INSERTED_CAST = "InsertedPrecisionFreeCast_"
NO_CPU_KERNEL = (
    re.compile(r"Could not find an implementation for PagedAttention\b"),
    re.compile(r"input parameter \(" + ORT_INSERTED_CAST + r"[^)]*\) of operator \(PagedAttention\)"),
)


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
        if means_no_cpu_kernel(str(e)):
            return {"check": "onnxruntime graph resolution (CPU)", "passed": True,
                    "note": "types and schemas resolve; PagedAttention has no CPU kernel"}
        first = str(e).strip().splitlines()[0]
        raise PagedGraphError(f"the PagedAttention graph does not resolve in ONNX Runtime: {first}") from None
    # A CPU kernel for PagedAttention would mean an onnxruntime this check was not written for.
    return {"check": "onnxruntime graph resolution (CPU)", "passed": True, "note": "session created"}


def means_no_cpu_kernel(message: str) -> bool:
    """Whether onnxruntime's failure says only that PagedAttention has no CPU kernel (see above)."""
    return any(p.search(message) for p in NO_CPU_KERNEL)
