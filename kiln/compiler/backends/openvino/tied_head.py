"""One table for a tied embedding and LM head in the OpenVINO model.

kiln's exporter writes a tied LM head as its own initializer, the embedding transposed
(decoder_graph.lm_head), so the IR would carry the table twice and NNCF would compress it twice:
for SmolLM2 28 M parameters, for Gemma 3 270M 168 M of its 268 M. Here the LM head's MatMul reads
the embedding's constant with transpose_b, the [vocab, hidden] layout the CPU plugin's
FullyConnected takes anyway. NNCF then compresses the one table once, per row: per token for the
Gather and per output channel for the MatMul, the same scales.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
from openvino import opset13 as ops
from openvino.utils import replace_node

from kiln.compiler.backends.openvino.q4_weights import LM_HEAD


def share_tied_head(model: ov.Model) -> bool:
    """Rewire the LM head onto the embedding's table where it holds the same values; True if it did.
    NOTE: compared value by value: an untied head, or one already quantized, stays as it is."""
    head = next((op for op in model.get_ordered_ops() if op.get_friendly_name() == LM_HEAD
                 and op.get_type_name() == "MatMul"), None)
    if head is None or head.get_transpose_b():
        return False
    weight = head.input_value(1).get_node()
    if weight.get_type_name() != "Constant" or len(weight.shape) != 2:
        return False
    table = _gathered_table(model, tuple(weight.shape)[::-1])
    if table is None:
        return False
    w, t = weight.get_data(), table.get_data()
    if w.dtype != t.dtype or not np.array_equal(w, t.T):
        return False
    shared = ops.matmul(head.input_value(0), table.output(0), head.get_transpose_a(), True)
    shared.set_friendly_name(LM_HEAD)
    replace_node(head, shared)
    return True


def _gathered_table(model: ov.Model, shape: tuple[int, ...]):
    """The Constant of this [vocab, hidden] shape a Gather reads (the token embedding), or None."""
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Gather":
            continue
        data = op.input_value(0).get_node()
        if data.get_type_name() == "Constant" and tuple(data.shape) == shape:
            return data
    return None
