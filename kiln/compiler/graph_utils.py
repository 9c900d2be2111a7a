"""Small ONNX graph-surgery helpers every rewrite shares: prune, topological order, opsets, lookups."""

from __future__ import annotations

import onnx
from onnx import helper

MS_DOMAIN = "com.microsoft"


def ensure_ms_opset(model: onnx.ModelProto) -> None:
    """Declare the com.microsoft domain (ONNX Runtime's contrib ops) once."""
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))


def prune(g: onnx.GraphProto) -> None:
    """Remove nodes and initializers nothing reaches from the outputs (works on unordered nodes)."""
    producer = {o: n for n in g.node for o in n.output}
    needed, stack, live = set(), [o.name for o in g.output], set()
    while stack:
        name = stack.pop()
        if name in needed:
            continue
        needed.add(name)
        node = producer.get(name)
        if node is not None and id(node) not in live:
            live.add(id(node))
            stack.extend(i for i in node.input if i)
    nodes = [n for n in g.node if id(n) in live]
    del g.node[:]
    g.node.extend(nodes)
    inits = [t for t in g.initializer if t.name in needed]
    del g.initializer[:]
    g.initializer.extend(inits)


def stable_toposort(nodes: list[onnx.NodeProto], available: set[str]) -> list[onnx.NodeProto]:
    """Kahn's sort that keeps the original order wherever the dependencies allow it.
    available: tensor names that exist before any node (graph inputs, initializers)."""
    known = set(available) | {""}
    pending, ordered = list(nodes), []
    while pending:
        rest = []
        for n in pending:
            if all(i in known for i in n.input):
                ordered.append(n)
                known.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            missing = sorted({i for n in rest for i in n.input if i not in known})[:5]
            raise ValueError(f"the rewrite left a cycle or dangling inputs: {missing} (at {rest[0].name!r})")
        pending = rest
    return ordered


def toposort(g: onnx.GraphProto) -> None:
    """Put the graph's nodes in topological order, in place."""
    ordered = stable_toposort(list(g.node), {i.name for i in g.input} | {t.name for t in g.initializer})
    del g.node[:]
    g.node.extend(ordered)


def node_named(nodes: dict[str, onnx.NodeProto], name: str, backend: str) -> onnx.NodeProto:
    """A node of kiln's standard decoder graph by its stable name, or a clear refusal."""
    if name not in nodes:
        raise ValueError(f"the decoder graph has no node {name!r}; the {backend} backend takes kiln's "
                         "standard graph (before the kv_io pass)")
    return nodes[name]
