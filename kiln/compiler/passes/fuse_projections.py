"""Merged projections: sibling MatMuls reading one hidden state become one wider MatMul + Split.

q/k/v (with Qwen2's biases, concatenated the same way) and gate/up read the same normed
hidden state; one GEMM over the concatenated weight reads the activations once and runs one
kernel instead of three (or two), which matters most at decode, where each is a thin GEMV.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from kiln.compiler.passes.fuse_common import FusionPass, GraphIndex, Rewrite, out_name, scope_of

# (leaf scope of the first member, members, merged name)
PROJECTION_GROUPS = [
    ("attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    ("mlp", ("gate_proj", "up_proj"), "gate_up_proj"),
]


@dataclass
class Member:
    matmul: onnx.NodeProto
    weight: np.ndarray          # [in, out]
    bias_node: onnx.NodeProto | None
    bias: np.ndarray | None

    @property
    def output(self) -> str:
        return (self.bias_node or self.matmul).output[0]


def match_member(idx: GraphIndex, scope: str) -> Member | None:
    """`scope`/MatMul with a 2-D weight initializer, and its `scope`/Bias Add if there is one."""
    mm = idx.node(f"{scope}/MatMul", "MatMul")
    w = idx.const(mm.input[1]) if mm is not None else None
    if w is None or w.ndim != 2:
        return None
    bias_node = idx.node(f"{scope}/Bias", "Add")
    if bias_node is None:
        return Member(mm, w, None, None)
    b = next((idx.const(i) for i in bias_node.input if i != mm.output[0]), None)
    if mm.output[0] not in bias_node.input or b is None or b.shape != (w.shape[1],) \
            or not idx.feeds_only(mm.output[0], [bias_node]):
        return None
    return Member(mm, w, bias_node, b)


def match_group(idx: GraphIndex, parent: str, members: tuple[str, ...]) -> list[Member] | None:
    found = [match_member(idx, f"{parent}/{m}") for m in members]
    if any(m is None for m in found):
        return None
    same_input = len({m.matmul.input[0] for m in found}) == 1
    same_rows = len({m.weight.shape[0] for m in found}) == 1
    all_or_no_bias = len({m.bias is None for m in found}) == 1
    same_dtype = len({m.weight.dtype for m in found}) == 1
    return found if same_input and same_rows and all_or_no_bias and same_dtype else None


class MergeProjections(FusionPass):
    """q/k/v → qkv_proj and gate/up → gate_up_proj: one MatMul (+ one bias Add) and a Split."""

    name = "merge_projections"
    rel_tolerance = 1e-4

    def __init__(self, groups: tuple[str, ...] = tuple(leaf for leaf, _, _ in PROJECTION_GROUPS)):
        self.groups = [g for g in PROJECTION_GROUPS if g[0] in groups]     # by leaf scope: "attn", "mlp"

    def without(self, leaves: list[str]) -> "MergeProjections":
        """This pass less the groups of `leaves` (a backend's "merge_projections:mlp")."""
        return MergeProjections(tuple(leaf for leaf, _, _ in self.groups if leaf not in leaves))

    def sites(self, idx: GraphIndex) -> list[str]:
        firsts = {f"/{leaf}/{members[0]}/MatMul" for leaf, members, _ in self.groups}
        return [scope_of(scope_of(n.name)) for n in idx.graph.node
                if n.op_type == "MatMul" and any(n.name.endswith(f) for f in firsts)]

    def rewrite(self, idx: GraphIndex, parent: str, rw: Rewrite) -> bool:
        group = next(((m, merged) for leaf, m, merged in self.groups if parent.endswith("/" + leaf)), None)
        found = match_group(idx, parent, group[0]) if group else None
        if found is None:
            return False
        nodes, outputs = _merged_nodes(f"{parent}/{group[1]}", found, rw)
        old = [n for m in found for n in (m.matmul, m.bias_node) if n is not None]
        rw.replace(old, nodes, {m.output: o for m, o in zip(found, outputs)})
        return True


# h ─ MatMul(W_q|W_k|W_v) ─ [Add(b_q|b_k|b_v)] ─ Split(out_q, out_k, out_v) ─ q, k, v
def _merged_nodes(scope: str, members: list[Member], rw: Rewrite) -> tuple[list[onnx.NodeProto], list[str]]:
    weight = rw.add_initializer(_weight_name(members[0].matmul.input[1], scope),
                                np.concatenate([m.weight for m in members], axis=1))
    mm = helper.make_node("MatMul", [members[0].matmul.input[0], weight], [out_name(f"{scope}/MatMul")],
                          name=f"{scope}/MatMul")
    nodes, y = [mm], mm.output[0]
    if members[0].bias is not None:
        bias = rw.add_initializer(_weight_name(members[0].matmul.input[1], scope, "bias"),
                                  np.concatenate([m.bias for m in members]))
        nodes.append(helper.make_node("Add", [y, bias], [out_name(f"{scope}/Bias")], name=f"{scope}/Bias"))
        y = nodes[-1].output[0]
    sizes = rw.add_initializer(f"{scope}/split_sizes", np.array([m.weight.shape[1] for m in members], np.int64))
    outputs = [out_name(f"{scope}/Split", k) for k in range(len(members))]
    nodes.append(helper.make_node("Split", [y, sizes], outputs, name=f"{scope}/Split", axis=-1))
    return nodes, outputs


def _weight_name(first_weight: str, scope: str, kind: str = "weight") -> str:
    """'model.layers.3.self_attn.q_proj.weight' → 'model.layers.3.self_attn.qkv_proj.weight'."""
    merged_leaf = scope.rsplit("/", 1)[1]
    parts = first_weight.split(".")
    if len(parts) >= 2 and parts[-1] == "weight":
        return ".".join([*parts[:-2], merged_leaf, kind])
    return f"{scope}/{kind}"
