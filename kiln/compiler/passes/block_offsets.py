"""4-bit linears with a float minimum per block (llama.cpp's Q4_1 scheme) on MatMulNBits.

Each block of `bs` weights along K is stored as w = scale·q + min, q in 0..15. MatMulNBits' own zero
point is an integer nibble, so `min` cannot be one (a float zero point exists in its schema but runs
on a dequantize fallback, far slower than the packed kernel for a decode matmul: figures in
docs/results/2026-12-06-figures-from-code-comments.md). The minimum goes
into a small side product instead: x·W = MatMulNBits(x, W - min) + (per-block sums of x)·mins.

Why it matters: with an integer zero point the grid is off the weights by up to half a step in
every block, and the error is the same sign across the block's 32 weights, so it adds up in the dot
product. A Q4_1 source (the SmolLM2 GGUF) is reproduced exactly; any source gets min-max rounding
with an exact offset (measured: quantize.py, above the INT4 recipe). The cost: three small nodes
per linear, a few percent more CPU per SmolLM2 decode step (bench/bench_quant_ppl.py --cpu-time;
docs/results/2026-12-06-figures-from-code-comments.md).

    x ─┬─ MatMulNBits(W_Q = q, scales, zp = 0) ──────────────┐
       └─ MatMul(P [K, K/bs] 0/1) ─ MatMul(mins [K/bs, N]) ─ Add ─ y
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from kiln.compiler.graph_utils import MS_DOMAIN
from kiln.compiler.export.external import fill_tensor, tensor_array
from kiln.compiler.passes.quant_tables import weight_quantizer



def block_minimums(w: np.ndarray, block_size: int) -> np.ndarray:
    """[K/bs, N]: the smallest weight of each block along K (the Q4_1 `min`)."""
    k, n = w.shape
    return w.reshape(k // block_size, block_size, n).min(axis=1)


def offset_linear(graph: onnx.GraphProto, w: TensorProto, node: onnx.NodeProto, bits: int,
                  block_size: int, weights_dir: Path | None = None) -> list[onnx.NodeProto]:
    """The nodes that replace MatMul(x, w); their initializers are appended to `graph` (large ones
    as external data in weights_dir: export.external)."""
    weight = tensor_array(w, weights_dir)
    mins = block_minimums(weight, block_size)
    shifted = weight - np.repeat(mins, block_size, axis=0)        # >= 0: the block's range starts at 0
    packed, scales, zero_points = weight_quantizer(bits, block_size, False).qbits_block_quant(shifted)
    k, n = weight.shape
    names = {"q": f"{w.name}_Q{bits}", "scales": f"{w.name}_scales", "zp": f"{w.name}_zero_points",
             "mins": f"{w.name}_block_mins"}
    for key, array in (("q", packed), ("scales", scales), ("zp", zero_points), ("mins", mins.astype(np.float32))):
        graph.initializer.append(fill_tensor(TensorProto(), names[key], array, weights_dir))
    block_sum = _block_sum_matrix(graph, k, block_size, weights_dir)
    x, y, base = node.input[0], node.output[0], node.name or w.name
    main = helper.make_node("MatMulNBits", [x, names["q"], names["scales"], names["zp"]], [f"{base}/nbits_output_0"],
                            name=f"{base}_Q{bits}", domain=MS_DOMAIN, K=k, N=n, bits=bits,
                            block_size=block_size, accuracy_level=4)
    sums = helper.make_node("MatMul", [x, block_sum], [f"{base}/block_sums_output_0"], name=f"{base}/block_sums")
    offset = helper.make_node("MatMul", [sums.output[0], names["mins"]], [f"{base}/block_offset_output_0"],
                              name=f"{base}/block_offset")
    add = helper.make_node("Add", [main.output[0], offset.output[0]], [y], name=f"{base}/add_block_offset")
    return [main, sums, offset, add]


def _block_sum_matrix(graph: onnx.GraphProto, k: int, block_size: int, weights_dir: Path | None) -> str:
    """A shared [K, K/bs] 0/1 matrix: x·P sums x over each block."""
    name = f"/model/quant/block_sum_{k}x{block_size}"
    if not any(t.name == name for t in graph.initializer):
        p = np.kron(np.eye(k // block_size, dtype=np.float32), np.ones((block_size, 1), np.float32))
        graph.initializer.append(fill_tensor(TensorProto(), name, p, weights_dir))
    return name
