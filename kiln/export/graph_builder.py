"""A small ONNX graph builder: hierarchical node names, initializers, typed IO."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 21
MS_DOMAIN = "com.microsoft"


class GraphBuilder:
    def __init__(self, name: str):
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._scope: list[str] = []
        self._const_cache: dict[tuple, str] = {}

    @contextmanager
    def scope(self, name: str):
        self._scope.append(name)
        try:
            yield
        finally:
            self._scope.pop()

    def path(self, leaf: str) -> str:
        return "/" + "/".join([*self._scope, leaf])

    def op(self, op_type: str, inputs: list[str], name: str | None = None, n_out: int = 1,
           domain: str = "", **attrs):
        """Emit one node; returns its output name (or a list when n_out > 1)."""
        node_name = self.path(name or op_type)
        outs = [f"{node_name}_output_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=node_name,
                                           domain=domain or None, **attrs))
        return outs[0] if n_out == 1 else outs

    def weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def const(self, value, dtype=np.int64) -> str:
        """A small shared constant (shapes, axes, scalars)."""
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._const_cache:
            name = f"/const/{self.name}/{dtype.__name__}_{len(self._const_cache)}"
            self.initializers.append(numpy_helper.from_array(arr, name))
            self._const_cache[key] = name
        return self._const_cache[key]

    def input(self, name: str, elem_type: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, tensor: str, name: str, elem_type: int, shape: list) -> str:
        self.nodes.append(helper.make_node("Identity", [tensor], [name], name=f"/outputs/{name}"))
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def model(self) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="kiln")
        model.ir_version = 10
        return model


FLOAT, INT64, INT32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
