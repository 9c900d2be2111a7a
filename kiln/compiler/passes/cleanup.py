"""Cleanup: constant folding, shape simplification and dead-node removal, through onnx-graphsurgeon.

The standard decoder graph is already tight, so on a fresh export this mostly removes what other
passes leave behind (orphaned rotary tables, unused weights, Shape ops on now-static dims).
"""

from __future__ import annotations

from collections import Counter

import onnx
import onnx_graphsurgeon as gs


class CleanupPass:
    name = "cleanup"
    rel_tolerance = 1e-5

    def __init__(self):
        self._details: dict = {}

    @classmethod
    def for_spec(cls, spec) -> "CleanupPass":
        return cls()

    def run(self, model: onnx.ModelProto) -> onnx.ModelProto:
        graph = gs.import_onnx(model)
        # NOTE: fold_shapes turns Shape/Gather-of-Shape on static dims into constants; dynamic
        # dims (batch, seq, past) stay, so the graph keeps working for every bucket.
        graph.fold_constants(fold_shapes=True).cleanup(remove_unused_graph_inputs=False).toposort()
        out = gs.export_onnx(graph, do_type_check=False)
        _keep_model_header(model, out)
        self._details = _diff(model, out)
        return out

    def details(self) -> dict:
        return dict(self._details)


def _keep_model_header(src: onnx.ModelProto, dst: onnx.ModelProto) -> None:
    """gs writes its own opset list and IR version; keep the source's (com.microsoft included)."""
    del dst.opset_import[:]
    dst.opset_import.extend(src.opset_import)
    dst.ir_version = src.ir_version
    dst.producer_name, dst.producer_version = src.producer_name, src.producer_version
    del dst.metadata_props[:]
    dst.metadata_props.extend(src.metadata_props)


def _diff(before: onnx.ModelProto, after: onnx.ModelProto) -> dict:
    ops_before = Counter(n.op_type for n in before.graph.node)
    ops_after = Counter(n.op_type for n in after.graph.node)
    removed = {op: n - ops_after.get(op, 0) for op, n in ops_before.items() if n > ops_after.get(op, 0)}
    return {
        "nodes_removed": len(before.graph.node) - len(after.graph.node),
        "initializers_before": len(before.graph.initializer),
        "initializers_after": len(after.graph.initializer),
        "removed_by_op": dict(sorted(removed.items())),
    }
