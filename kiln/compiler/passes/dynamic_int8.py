"""8-bit linears as DynamicQuantizeMatMul: int8 weights per output channel, activations quantized
to uint8 per call, an integer GEMM (VNNI where the CPU has it).

Why not MatMulNBits at 8 bits: its CPU kernel runs blocks of 32 along K and scales with the number
of rows almost linearly, while ORT's integer GEMM packs B once and gets faster per row as rows grow.
Measured on one linear, 1 thread, process CPU time (AMD EPYC with AVX-512 VNNI): level at one row,
and from 8 rows up this takes well under half of 8-bit MatMulNBits' time, so decode batches and
prefill both run faster and a single decode no slower (docs/results/2026-12-06-figures-from-code-comments.md).

The weights' range follows the build CPU (the build plan's recipe: kiln/compiler/recipes.py, and
kiln/engines/ort/int8_dot.py for why): full int8 with VNNI, 7 bits without (full-range weights
saturate the kernel's 16-bit sums there); the weight initializer's name says which (`_s8` / `_s7`),
and the engine record carries it to the loader.

    x ─ DynamicQuantizeMatMul(W_s8 [K, N], scales [N], zero points [N] = 0) ─ y
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from kiln.compiler.graph_utils import MS_DOMAIN
from kiln.compiler.export.external import fill_tensor, tensor_array
from kiln.engines.ort.int8_dot import FULL_RANGE



def per_channel_int8(w: np.ndarray, limit: int = FULL_RANGE) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per output channel (column of [K, N]): w ~ q * scale, q in [-limit, limit]."""
    scale = np.abs(w).max(axis=0) / float(limit)
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)     # an all-zero column stays exact
    q = np.clip(np.rint(w / scale), -limit, limit).astype(np.int8)
    return q, scale


def weight_suffix(limit: int) -> str:
    return "_s8" if limit == FULL_RANGE else "_s7"


def full_range_weights(graph: onnx.GraphProto) -> bool:
    """Whether any DynamicQuantizeMatMul here takes full-range int8 weights (needs VNNI to run right)."""
    return any(n.op_type == "DynamicQuantizeMatMul" and n.input[1].endswith(weight_suffix(FULL_RANGE))
               for n in graph.node)


def dynamic_int8_linear(graph: onnx.GraphProto, w: TensorProto, node: onnx.NodeProto,
                        weights_dir: Path | None = None, limit: int = FULL_RANGE) -> onnx.NodeProto:
    """The node that replaces MatMul(x, w); its initializers are appended to `graph` (large ones as
    external data in weights_dir: export.external). limit: the weights' magnitude (the build plan's,
    kiln/compiler/recipes.py w8a8_weight_range: what the build CPU runs right)."""
    q, scale = per_channel_int8(np.asarray(tensor_array(w, weights_dir), np.float32), limit)
    base = w.name + weight_suffix(limit)
    names = (base, f"{base}_scales", f"{base}_zero_points")
    for name, array in zip(names, (q, scale, np.zeros(scale.shape, np.int8))):
        graph.initializer.append(fill_tensor(TensorProto(), name, array, weights_dir))
    return helper.make_node("DynamicQuantizeMatMul", [node.input[0], *names], list(node.output),
                            name=f"{node.name}_DQ8", domain=MS_DOMAIN)
