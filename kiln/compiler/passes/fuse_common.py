"""What every fusion pass shares: an index over the graph, a batched rewrite, and the pass skeleton.

A fusion finds candidate sites by the emitter's deterministic node names, checks the structure
(op types, wiring, constants, single consumers) before touching anything, and records the
rewrite in a `Rewrite`; the rewrite is applied once at the end, followed by a stable toposort
and a sweep of the nodes and initializers it orphaned.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from pathlib import Path

import numpy as np
import onnx

from kiln.compiler.export.external import fill_tensor, tensor_array, weights_dir
from kiln.compiler.graph_utils import MS_DOMAIN, ensure_ms_opset, stable_toposort



class GraphIndex:
    """Read-only lookups over a graph as it was before this pass's rewrite."""

    def __init__(self, graph: onnx.GraphProto, weights_dir: Path | None = None):
        self.graph, self.weights_dir = graph, weights_dir
        self.by_name = {n.name: n for n in graph.node}
        self.producer = {o: n for n in graph.node for o in n.output if o}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for n in graph.node:
            for i in n.input:
                self.consumers[i].append(n)
        self.initializers = {t.name: t for t in graph.initializer}
        self.graph_outputs = {o.name for o in graph.output}

    def node(self, name: str, op_type: str) -> onnx.NodeProto | None:
        n = self.by_name.get(name)
        return n if n is not None and n.op_type == op_type and n.domain in ("", "ai.onnx") else None

    def const(self, tensor: str) -> np.ndarray | None:
        t = self.initializers.get(tensor)
        return None if t is None else tensor_array(t, self.weights_dir)

    def const_equals(self, tensor: str, value) -> bool:
        arr = self.const(tensor)
        return arr is not None and arr.shape == np.shape(value) and bool(np.all(arr == value))

    def feeds_only(self, tensor: str, nodes: list[onnx.NodeProto]) -> bool:
        """The tensor is consumed by exactly these nodes (once each) and is no graph output."""
        names = sorted(n.name for n in self.consumers.get(tensor, []))
        return tensor not in self.graph_outputs and names == sorted(n.name for n in nodes)


class Rewrite:
    """Nodes to drop, nodes to add, tensors to rename; applied in one go."""

    def __init__(self, weights_dir: Path | None = None):
        self.weights_dir = weights_dir      # large new weights are appended there (export.external)
        self.removed: set[str] = set()
        self.added: list[onnx.NodeProto] = []
        self.renamed: dict[str, str] = {}
        self.initializers: dict[str, onnx.TensorProto] = {}

    def replace(self, old: list[onnx.NodeProto], new: list[onnx.NodeProto], renamed: dict[str, str]):
        self.removed.update(n.name for n in old)
        self.added.extend(new)
        self.renamed.update(renamed)

    def add_initializer(self, name: str, array: np.ndarray) -> str:
        if name not in self.initializers:
            self.initializers[name] = fill_tensor(onnx.TensorProto(), name, array, self.weights_dir)
        return name

    def apply(self, graph: onnx.GraphProto) -> None:
        nodes = [n for n in graph.node if n.name not in self.removed] + self.added
        for n in nodes:
            for k, name in enumerate(n.input):
                n.input[k] = self._resolve(name)
        keep = _live_nodes(nodes, {o.name for o in graph.output})
        del graph.node[:]
        available = {i.name for i in graph.input} | {t.name for t in graph.initializer} | set(self.initializers)
        graph.node.extend(stable_toposort(keep, available))
        _sweep_initializers(graph, self.initializers)

    def _resolve(self, name: str) -> str:
        while name in self.renamed:
            name = self.renamed[name]
        return name


def _live_nodes(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """Drop nodes none of whose outputs reach a graph output (what a fusion orphaned)."""
    producer = {o: n for n in nodes for o in n.output if o}
    live, stack = set(), [producer[o] for o in outputs if o in producer]
    while stack:
        n = stack.pop()
        if id(n) in live:           # by identity: a foreign graph may leave node names empty
            continue
        live.add(id(n))
        stack.extend(producer[i] for i in n.input if i in producer)
    return [n for n in nodes if id(n) in live]


def _sweep_initializers(graph: onnx.GraphProto, added: dict[str, onnx.TensorProto]) -> None:
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name in used]
    kept += [t for name, t in added.items() if name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)


class FusionPass:
    """Skeleton: subclasses name their sites and rewrite one site at a time."""

    name = "fusion"
    rel_tolerance = 1e-4

    def __init__(self):
        self._counts: Counter = Counter()
        self._skipped: list[str] = []

    @classmethod
    def for_spec(cls, spec) -> "FusionPass":
        return cls()

    def sites(self, idx: GraphIndex) -> list[str]:
        raise NotImplementedError

    def rewrite(self, idx: GraphIndex, site: str, rw: Rewrite) -> bool:
        """Record the rewrite of one site; False (and nothing recorded) when it does not match."""
        raise NotImplementedError

    def run(self, model: onnx.ModelProto) -> onnx.ModelProto:
        self._counts, self._skipped = Counter(), []
        out = onnx.ModelProto()
        out.CopyFrom(model)
        folder = weights_dir(out)
        idx, rw = GraphIndex(out.graph, folder), Rewrite(folder)
        for site in self.sites(idx):
            if self.rewrite(idx, site, rw):
                self._counts["fused"] += 1
            else:
                self._counts["skipped"] += 1
                self._skipped.append(site)
        if rw.removed:
            rw.apply(out.graph)
            ensure_ms_opset(out)
        return out

    def details(self) -> dict:
        return {"fused": self._counts["fused"], "skipped": self._counts["skipped"],
                "skipped_sites": list(self._skipped)}


def scope_of(node_name: str) -> str:
    """'/model/layers.3/input_norm/Pow' -> '/model/layers.3/input_norm'."""
    return node_name.rsplit("/", 1)[0]


def out_name(node_name: str, k: int = 0) -> str:
    """Output tensor names follow the graph builder's convention."""
    return f"{node_name}_output_{k}"
