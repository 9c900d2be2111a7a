"""A 4-bit linear whose blocks come from the zero-point search (int4_search.py): one MatMulNBits
with integer zero points, no side path.

    MatMul(x, W[K,N] fp32)  ─▶  MatMulNBits(x, W_Q4[N, K/bs, bs/2] u8, scales[N, K/bs], zp[N, ⌈K/bs/2⌉] u8)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from kiln.compiler.graph_utils import MS_DOMAIN
from kiln.compiler.export.external import fill_tensor, tensor_array
from kiln.compiler.passes.int4_calibration import InputMoments
from kiln.compiler.passes.int4_search import matmul_nbits_tensors, search



def searched_linear(graph: onnx.GraphProto, w: TensorProto, node: onnx.NodeProto, block_size: int,
                    moments: InputMoments | None, weights_dir: Path | None = None) -> onnx.NodeProto:
    """The MatMulNBits that replaces MatMul(x, w); its initializers are appended to `graph`."""
    weight = np.asarray(tensor_array(w, weights_dir), np.float32)
    quant = search(weight, block_size, moments)
    packed, scales, zero_points = matmul_nbits_tensors(quant)
    tables = [(f"{w.name}_Q4", packed), (f"{w.name}_scales", scales), (f"{w.name}_zero_points", zero_points)]
    inputs = [node.input[0], *(name for name, _ in tables)]
    graph.initializer.extend(fill_tensor(TensorProto(), name, a, weights_dir) for name, a in tables)
    k, n = w.dims
    return helper.make_node("MatMulNBits", inputs, list(node.output),
                            name=f"{node.name or w.name}_Q4", domain=MS_DOMAIN, K=k, N=n, bits=4,
                            block_size=block_size, accuracy_level=4)
