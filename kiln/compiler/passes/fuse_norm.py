"""RMSNorm fusion: the emitter's seven-node rms_norm to one SimplifiedLayerNormalization.

ORT_ENABLE_ALL does not fuse this RMSNorm itself: its SimplifiedLayerNormFusion looks for
Div(x, Sqrt(...)), not Mul(x, Reciprocal(Sqrt(...))), so without this pass every norm runs as
seven element-wise kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper

from kiln.compiler.graph_utils import MS_DOMAIN
from kiln.compiler.passes.fuse_common import FusionPass, GraphIndex, Rewrite, out_name, scope_of

# The rms_norm subgraph, by node leaf name and op type, in emission order.
RMS_NORM_NODES = [("Pow", "Pow"), ("ReduceMean", "ReduceMean"), ("AddEps", "Add"), ("Sqrt", "Sqrt"),
                  ("Reciprocal", "Reciprocal"), ("Normalize", "Mul"), ("Scale", "Mul")]


@dataclass
class RmsNormSite:
    nodes: list[onnx.NodeProto]
    x: str
    weight: str
    epsilon: float

    @property
    def output(self) -> str:
        return self.nodes[-1].output[0]


def match_rms_norm(idx: GraphIndex, scope: str) -> RmsNormSite | None:
    """The rms_norm emitted under `scope`, if its op types, wiring and constants all check out."""
    nodes = [idx.node(f"{scope}/{leaf}", op) for leaf, op in RMS_NORM_NODES]
    if any(n is None for n in nodes):
        return None
    pow_, mean, add_eps, sqrt, recip, normalize, scale = nodes
    x = pow_.input[0]
    chain_ok = (
        idx.const_equals(pow_.input[1], 2.0)
        and len(mean.input) == 2 and mean.input[0] == pow_.output[0] and idx.const_equals(mean.input[1], [-1])
        and _attr(mean, "keepdims", 1) == 1
        and add_eps.input[0] == mean.output[0] and idx.const(add_eps.input[1]) is not None
        and list(sqrt.input) == [add_eps.output[0]] and list(recip.input) == [sqrt.output[0]]
        and sorted(normalize.input) == sorted([x, recip.output[0]])
        and normalize.output[0] in scale.input
    )
    if not chain_ok:
        return None
    weight = next((i for i in scale.input if i != normalize.output[0]), None)
    w = idx.const(weight) if weight else None
    if w is None or w.ndim != 1 or idx.const(add_eps.input[1]).size != 1:
        return None
    # Every intermediate must be private to the pattern, or removing it would starve someone.
    private = all(idx.feeds_only(a.output[0], [b]) for a, b in zip(nodes[:-1], nodes[1:]) if a is not recip)
    if not (private and idx.feeds_only(recip.output[0], [normalize])):
        return None
    return RmsNormSite(nodes, x, weight, float(idx.const(add_eps.input[1]).reshape(())))


def _attr(node: onnx.NodeProto, name: str, default):
    a = next((a for a in node.attribute if a.name == name), None)
    return default if a is None else helper.get_attribute_value(a)


class FuseRMSNorm(FusionPass):
    """x ─ Pow ─ ReduceMean ─ Add(eps) ─ Sqrt ─ Reciprocal ─ Mul(x) ─ Mul(w)  →  SimplifiedLayerNormalization(x, w)"""

    name = "fuse_rms_norm"
    rel_tolerance = 1e-4

    def sites(self, idx: GraphIndex) -> list[str]:
        return [scope_of(n.name) for n in idx.graph.node if n.op_type == "Pow" and n.name.endswith("/Pow")]

    def rewrite(self, idx: GraphIndex, scope: str, rw: Rewrite) -> bool:
        site = match_rms_norm(idx, scope)
        if site is None:
            return False
        name = f"{scope}/SimplifiedLayerNormalization"
        norm = helper.make_node("SimplifiedLayerNormalization", [site.x, site.weight], [out_name(name)],
                                name=name, axis=-1, epsilon=site.epsilon, stash_type=1)
        rw.replace(site.nodes, [norm], {site.output: out_name(name)})
        return True


# a ─┐                                       a ─┐
#    Add(residual) ─┬─ SLN(w) ─ normed   →      SkipSLN(w) ─┬─ output 0: normed
# b ─┘              └─ sum (next residual)   b ─┘            └─ output 3: a + b (input_skip_bias_sum)
class FuseSkipRMSNorm(FusionPass):
    """A residual Add feeding a SimplifiedLayerNormalization → SkipSimplifiedLayerNormalization.

    Runs after FuseRMSNorm (it matches the fused norm). The final norm is left alone on purpose:
    FINAL_HIDDEN's Identity sits between its residual Add and the norm and must stay there.
    """

    name = "fuse_skip_rms_norm"
    rel_tolerance = 1e-4

    def sites(self, idx: GraphIndex) -> list[str]:
        return [n.name for n in idx.graph.node
                if n.op_type == "SimplifiedLayerNormalization" and n.domain in ("", "ai.onnx")]

    def rewrite(self, idx: GraphIndex, site: str, rw: Rewrite) -> bool:
        norm = idx.by_name[site]
        add = idx.producer.get(norm.input[0])
        if add is None or add.op_type != "Add" or not add.name.endswith("/residual") or len(norm.output) != 1:
            return False
        if any(i in idx.initializers for i in add.input) or add.output[0] in idx.graph_outputs:
            return False
        name = f"{scope_of(site)}/SkipSimplifiedLayerNormalization"
        outputs = [out_name(name, 0), "", "", out_name(name, 3)]
        skip = helper.make_node("SkipSimplifiedLayerNormalization", [*add.input, norm.input[1]], outputs,
                                name=name, domain=MS_DOMAIN, epsilon=_attr(norm, "epsilon", 1e-5))
        rw.replace([add, norm], [skip], {norm.output[0]: outputs[0], add.output[0]: outputs[3]})
        return True
