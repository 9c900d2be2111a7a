"""A small ONNX graph builder: hierarchical node names, initializers, typed IO."""

from __future__ import annotations

import ctypes
import ctypes.util
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from kiln.compiler.export.external import attach_weights_dir, fill_tensor
from kiln.compiler.graph_utils import MS_DOMAIN

OPSET = 21


class GraphBuilder:
    def __init__(self, name: str, weights_dir: Path | None = None):
        self.name = name
        self.weights_dir = weights_dir     # large weights go there as external data (export.external)
        self.nodes: list[onnx.NodeProto] = []
        # NOTE: weights go straight into the model being built: a list handed to make_graph would be
        # copied, and the graph held twice at the end of an export.
        self._model = onnx.ModelProto()
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

    @property
    def initializers(self):
        return self._model.graph.initializer

    def weight(self, name: str, array: np.ndarray) -> str:
        fill_tensor(self.initializers.add(), name, array, self.weights_dir)
        return name

    def const(self, value, dtype=np.int64) -> str:
        """A small shared constant (shapes, axes, scalars)."""
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._const_cache:
            name = f"/const/{self.name}/{dtype.__name__}_{len(self._const_cache)}"
            self.weight(name, arr)
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
        """The finished model (the builder's own; call once)."""
        model, graph = self._model, self._model.graph
        graph.name = self.name
        graph.node.extend(self.nodes)
        graph.input.extend(self.inputs)
        graph.output.extend(self.outputs)
        model.opset_import.extend([helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)])
        model.producer_name, model.ir_version = "kiln", 10
        if self.weights_dir is not None:
            attach_weights_dir(model, self.weights_dir)
        return model


FLOAT, INT64, INT32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc); a no-op elsewhere.

    NOTE: each weight passes through a few transient copies (transpose, bytes) below glibc's
    32 MB mmap ceiling, so they land on the heap between protobuf's blocks and stay in RSS after
    they are freed: measured on a 135M-parameter model, the resident set after export was more than
    twice the graph's size, and a trim brought it back close to the graph's own size
    (docs/results/2026-12-06-figures-from-code-comments.md).
    """
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
