"""The vocabulary tables of the quantize pass: finding the embedding and the LM head, and storing the
embedding as a GatherBlockQuantized table (its own, or a view of the LM head's MatMulNBits weight).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization.matmul_nbits_quantizer import (
    DefaultWeightOnlyQuantConfig,
    DefaultWeightOnlyQuantizer,
)

from kiln.compiler.export.external import fill_tensor, tensor_array
from kiln.compiler.graph_utils import MS_DOMAIN



@functools.lru_cache(maxsize=None)
def weight_quantizer(bits: int, block_size: int, symmetric: bool) -> DefaultWeightOnlyQuantizer:
    # NOTE: accuracy_level=4 (int8 activations) always: at level 0, 8-bit MatMulNBits has no packed
    # CPU kernel and dequantizes B on every call, far slower than fp32
    # (docs/results/2026-12-06-figures-from-code-comments.md).
    config = DefaultWeightOnlyQuantConfig(block_size=block_size, bits=bits, is_symmetric=symmetric,
                                          accuracy_level=4)
    return DefaultWeightOnlyQuantizer(config)


@dataclass(frozen=True)
class QuantizedTable:
    """A [rows, K] table quantized along K in MatMulNBits' layout: data [rows, K/bs, blob] uint8."""

    data: str
    scales: str
    zero_points: str | None
    bits: int
    rows: int

    @classmethod
    def of_matmul_nbits(cls, node: onnx.NodeProto, bits: int) -> QuantizedTable:
        zp = node.input[3] if len(node.input) > 3 and node.input[3] else None
        n = next(a.i for a in node.attribute if a.name == "N")
        return cls(node.input[1], node.input[2], zp, bits, n)


def lm_head_node(graph: onnx.GraphProto) -> onnx.NodeProto | None:
    """The MatMul whose result is the `logits` output (through Identity nodes only)."""
    producer = {o: n for n in graph.node for o in n.output}
    node = producer.get("logits")
    while node is not None and node.op_type == "Identity":
        node = producer.get(node.input[0])
    return node if node is not None and node.op_type == "MatMul" else None


def embedding_node(graph: onnx.GraphProto, inits: dict[str, TensorProto]) -> onnx.NodeProto | None:
    """The Gather of a 2-D fp32 table (axis 0) by the graph input `input_ids`."""
    for n in graph.node:
        table = inits.get(n.input[0]) if n.op_type == "Gather" else None
        if (table is not None and n.input[1] == "input_ids" and len(table.dims) == 2
                and table.data_type == TensorProto.FLOAT and _gather_axis(n) == 0):
            return n
    return None


def _gather_axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 0)


def quantize_embedding(graph: onnx.GraphProto, inits: dict[str, TensorProto], embed: onnx.NodeProto,
                       shared: QuantizedTable | None, bits: int, block_size: int,
                       symmetric: bool, weights_dir: Path | None = None) -> tuple[list[onnx.NodeProto], str]:
    """The nodes that replace the embedding Gather, and a note for the pass report; large new
    tables go to weights_dir as external data (export.external)."""
    if shared is not None and shared.bits == bits == 8:
        note = "GatherBlockQuantized 8-bit, reading the LM head's quantized table in place (tied embeddings)"
        return _gather_in_place(graph, embed, shared, block_size, weights_dir), note
    if shared is not None and shared.bits == bits:
        view = _table_view(graph, embed, shared)
        note = f"GatherBlockQuantized {bits}-bit, sharing the LM head's quantized table (tied embeddings)"
        return [view, _gather_node(embed, shared, view.output[0], block_size)], note
    table = _quantize_table(graph, inits[embed.input[0]], bits, block_size, symmetric, weights_dir)
    note = f"GatherBlockQuantized {bits}-bit, own table"
    if shared is not None:
        note += f" (tied, but the LM head is {shared.bits}-bit)"
    return [_gather_node(embed, table, table.data, block_size)], note


# lm_head W_Q [V, H/bs, bs] ─ GatherBlockQuantized(quantize_axis=2) ─ [B,S,H/bs,bs] ─ Reshape ─ [B,S,H]
def _gather_in_place(graph: onnx.GraphProto, embed: onnx.NodeProto, table: QuantizedTable, block_size: int,
                     weights_dir: Path | None) -> list[onnx.NodeProto]:
    """8-bit only: the gather reads MatMulNBits' 3-D weight as it is, so no [V, H] view of it is
    materialised (ORT would fold or copy that Reshape: a second 33 MB table for SmolLM2). Only
    the small scales / zero points get 3-D copies."""
    inputs = [table.data, embed.input[1]]
    current = {t.name: t for t in graph.initializer}     # the LM head's tensors are newer than `inits`
    for name in [table.scales] + ([table.zero_points] if table.zero_points else []):
        arr = tensor_array(current[name], weights_dir).reshape(table.rows, -1, 1)
        graph.initializer.append(fill_tensor(TensorProto(), f"{name}_3d", arr, weights_dir))
        inputs.append(f"{name}_3d")
    blocks = embed.name + "/blocks_output_0"
    gather = helper.make_node("GatherBlockQuantized", inputs, [blocks], name=embed.name + "_Q8",
                              domain=MS_DOMAIN, gather_axis=0, quantize_axis=2, block_size=block_size, bits=8)
    shape = embed.name + "/hidden_shape"
    graph.initializer.append(numpy_helper.from_array(np.array([0, 0, -1], np.int64), shape))
    return [gather, helper.make_node("Reshape", [blocks, shape], list(embed.output), name=embed.name + "/merge_blocks")]


# view: lm_head W_Q [V, H/bs, blob] ─ Reshape([V, -1]) ─▶ [V, H·bits/8] ─ GatherBlockQuantized
def _table_view(graph: onnx.GraphProto, embed: onnx.NodeProto, table: QuantizedTable) -> onnx.NodeProto:
    shape = embed.name + "/table_shape"
    graph.initializer.append(numpy_helper.from_array(np.array([table.rows, -1], np.int64), shape))
    return helper.make_node("Reshape", [table.data, shape], [embed.name + "/table_view_output_0"],
                            name=embed.name + "/table_view")


def _gather_node(embed: onnx.NodeProto, table: QuantizedTable, data: str, block_size: int) -> onnx.NodeProto:
    inputs = [data, embed.input[1], table.scales] + ([table.zero_points] if table.zero_points else [])
    return helper.make_node("GatherBlockQuantized", inputs, list(embed.output), name=embed.name + f"_Q{table.bits}",
                            domain=MS_DOMAIN, gather_axis=0, quantize_axis=1, block_size=block_size,
                            bits=table.bits)


def _quantize_table(graph: onnx.GraphProto, table: TensorProto, bits: int, block_size: int,
                    symmetric: bool, weights_dir: Path | None) -> QuantizedTable:
    """Quantize E [V, H] as the MatMulNBits weight E.T [H, V] (blocks along H), stored [V, H·bits/8]."""
    packed, scales, zero_points = weight_quantizer(bits, block_size, symmetric).qbits_block_quant(
        np.ascontiguousarray(tensor_array(table, weights_dir).T))
    name = table.name
    data = packed.reshape(packed.shape[0], -1)
    graph.initializer.extend([fill_tensor(TensorProto(), f"{name}_Q{bits}", data, weights_dir),
                              fill_tensor(TensorProto(), f"{name}_scales", scales, weights_dir)])
    zp = None
    if not symmetric:
        zp = f"{name}_zero_points"
        graph.initializer.append(fill_tensor(TensorProto(), zp, zero_points, weights_dir))
    return QuantizedTable(f"{name}_Q{bits}", f"{name}_scales", zp, bits, packed.shape[0])

