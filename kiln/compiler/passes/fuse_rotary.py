"""Rotary fusion: the emitter's rotate-half `apply_rope` to com.microsoft.RotaryEmbedding.

The op reads cos/sin from [max_positions, head_dim/2] caches indexed by the graph's own
position_ids tensor (the one the rotary tables were built from), so the per-step Cos/Sin
tables die with the last rope they fed. It takes the projection's 3-D [B,S,heads*head_dim]
output directly (num_heads attribute), so no Transpose is added: the Reshape to heads moves
after it, and new_{key,value}_kv_major still see [B,S,kv_heads,head_dim].
ORT checks positions against the cache and fails loudly on an out-of-range one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from kiln.compiler.passes.fuse_common import MS_DOMAIN, FusionPass, GraphIndex, Rewrite, out_name, scope_of

DEFAULT_MAX_POSITIONS = 8192


@dataclass
class RotaryTables:
    """cos/sin [B,S,1,head_dim] computed in-graph from int64 positions and an inv_freq initializer."""
    positions: str
    inv_freq: np.ndarray
    key: str            # the Concat both tables come from; one cache pair per key
    scale: float = 1.0  # yarn/longrope: HF multiplies cos and sin by an attention factor


def match_rotary_tables(idx: GraphIndex, cos: str, sin: str) -> RotaryTables | None:
    # positions ─ Cast ─ Unsqueeze(-1) ─ Mul(inv_freq) ─ Concat(f, f) ─ Cos / Sin ─ [Mul(scale)] ─ Unsqueeze(2)
    cos_trig, sin_trig = (_through_unsqueeze(idx, t, [2]) for t in (cos, sin))
    (cos_trig, cos_scale), (sin_trig, sin_scale) = _through_scale(idx, cos_trig), _through_scale(idx, sin_trig)
    if cos_scale != sin_scale:
        return None
    if cos_trig is None or sin_trig is None or cos_trig.op_type != "Cos" or sin_trig.op_type != "Sin":
        return None
    concat = idx.producer.get(cos_trig.input[0])
    if concat is None or concat.op_type != "Concat" or sin_trig.input[0] != concat.output[0]:
        return None
    if len(set(concat.input)) != 1 or len(concat.input) != 2:
        return None
    freqs = idx.producer.get(concat.input[0])
    if freqs is None or freqs.op_type != "Mul":
        return None
    inv_freq = next((idx.const(i) for i in freqs.input if i in idx.initializers), None)
    pos_col = next((i for i in freqs.input if i not in idx.initializers), None)
    cast = _through_unsqueeze(idx, pos_col, [-1]) if pos_col else None
    if inv_freq is None or inv_freq.ndim != 1 or cast is None or cast.op_type != "Cast":
        return None
    return RotaryTables(cast.input[0], inv_freq.astype(np.float32), concat.name, cos_scale)


def _through_scale(idx: GraphIndex, node: onnx.NodeProto | None) -> tuple[onnx.NodeProto | None, float | None]:
    """(the node under a Mul by a scalar constant, that scalar), or (node, 1.0) when there is no Mul."""
    if node is None or node.op_type != "Mul":
        return node, 1.0
    scale = next((idx.const(i) for i in node.input if i in idx.initializers), None)
    other = next((i for i in node.input if i not in idx.initializers), None)
    if scale is None or scale.size != 1 or other is None:
        return None, None
    return idx.producer.get(other), float(scale.reshape(()))


def _through_unsqueeze(idx: GraphIndex, tensor: str, axes: list[int]) -> onnx.NodeProto | None:
    """The producer of the Unsqueeze(axes) that produced `tensor`."""
    unsq = idx.producer.get(tensor)
    if unsq is None or unsq.op_type != "Unsqueeze" or not idx.const_equals(unsq.input[1], axes):
        return None
    return idx.producer.get(unsq.input[0])


def rotary_caches(tables: RotaryTables, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    # NOTE: the angle is an fp32 product, as in the graph (and in HF), so large positions round
    # the same way; only cos/sin themselves are taken in float64.
    angles = np.arange(max_positions, dtype=np.float32)[:, None] * tables.inv_freq[None, :]
    cos = (np.cos(angles.astype(np.float64)).astype(np.float32) * np.float32(tables.scale)).astype(np.float32)
    sin = (np.sin(angles.astype(np.float64)).astype(np.float32) * np.float32(tables.scale)).astype(np.float32)
    return cos, sin


@dataclass
class RopeSite:
    nodes: list[onnx.NodeProto]   # Heads, SliceLow, SliceHigh, Neg, RotateHalf, MulCos, MulSin, Add
    tables: RotaryTables
    num_heads: int
    head_dim: int


ROPE_NODES = [("Heads", "Reshape"), ("SliceLow", "Slice"), ("SliceHigh", "Slice"), ("Neg", "Neg"),
              ("RotateHalf", "Concat"), ("MulCos", "Mul"), ("MulSin", "Mul"), ("Add", "Add")]


def match_rope(idx: GraphIndex, scope: str) -> RopeSite | None:
    nodes = [idx.node(f"{scope}/{leaf}", op) for leaf, op in ROPE_NODES]
    if any(n is None for n in nodes):
        return None
    heads, lo, hi, neg, rot, mul_cos, mul_sin, add = nodes
    shape = idx.const(heads.input[1])
    if shape is None or shape.shape != (4,) or list(shape[:2]) != [0, 0] or min(shape[2:]) <= 0:
        return None
    x, (num_heads, head_dim) = heads.output[0], (int(s) for s in shape[2:])
    half = head_dim // 2
    wired = (
        _is_slice(idx, lo, x, 0, half) and _is_slice(idx, hi, x, half, head_dim)
        and list(neg.input) == [hi.output[0]] and list(rot.input) == [neg.output[0], lo.output[0]]
        and _attr_int(rot, "axis") in (-1, 3) and mul_cos.input[0] == x and mul_sin.input[0] == rot.output[0]
        and sorted(add.input) == sorted([mul_cos.output[0], mul_sin.output[0]])
    )
    if not wired or not idx.feeds_only(x, [lo, hi, mul_cos]):
        return None
    inner = [(lo, rot), (hi, neg), (neg, rot), (rot, mul_sin), (mul_cos, add), (mul_sin, add)]
    if not all(idx.feeds_only(a.output[0], [b]) for a, b in inner if a is not lo) \
            or not idx.feeds_only(lo.output[0], [rot]):
        return None
    tables = match_rotary_tables(idx, mul_cos.input[1], mul_sin.input[1])
    if tables is None or tables.inv_freq.size != half:
        return None
    return RopeSite(nodes, tables, num_heads, head_dim)


def _is_slice(idx: GraphIndex, node: onnx.NodeProto, x: str, start: int, end: int) -> bool:
    if node.input[0] != x or len(node.input) not in (4, 5):
        return False
    steps_ok = len(node.input) == 4 or idx.const_equals(node.input[4], [1])
    return (idx.const_equals(node.input[1], [start]) and idx.const_equals(node.input[2], [end])
            and idx.const_equals(node.input[3], [-1]) and steps_ok)


def _attr_int(node: onnx.NodeProto, name: str) -> int | None:
    a = next((a for a in node.attribute if a.name == name), None)
    return None if a is None else int(a.i)


# flat [B,S,heads*hd] ─ RotaryEmbedding(position_ids, cos_cache, sin_cache) ─ Reshape(Heads) ─ [B,S,heads,hd]
class FuseRotary(FusionPass):
    """apply_rope (Slice/Slice/Neg/Concat/Mul/Mul/Add on [B,S,heads,hd]) → RotaryEmbedding."""

    name = "fuse_rotary"
    rel_tolerance = 1e-4

    def __init__(self, max_positions: int = DEFAULT_MAX_POSITIONS):
        super().__init__()
        self.max_positions = max_positions

    @classmethod
    def for_spec(cls, spec) -> "FuseRotary":
        return cls(spec.max_position_embeddings)

    def sites(self, idx: GraphIndex) -> list[str]:
        return [scope_of(n.name) for n in idx.graph.node if n.op_type == "Concat" and n.name.endswith("/RotateHalf")]

    def rewrite(self, idx: GraphIndex, scope: str, rw: Rewrite) -> bool:
        site = match_rope(idx, scope)
        if site is None:
            return False
        cos_cache, sin_cache = self._caches(site.tables, rw)
        heads, add = site.nodes[0], site.nodes[-1]
        name = f"{scope}/RotaryEmbedding"
        rope = helper.make_node("RotaryEmbedding", [heads.input[0], site.tables.positions, cos_cache, sin_cache],
                                [out_name(name)], name=name, domain=MS_DOMAIN, interleaved=0,
                                num_heads=site.num_heads)
        # Same node name and output tensor as before: only its input moves to the rotated values.
        reshape = helper.make_node("Reshape", [out_name(name), heads.input[1]], list(heads.output), name=heads.name)
        rw.replace(site.nodes, [rope, reshape], {add.output[0]: heads.output[0]})
        return True

    def _caches(self, tables: RotaryTables, rw: Rewrite) -> tuple[str, str]:
        prefix = scope_of(tables.key)                       # '/model/rotary'
        cos_name, sin_name = f"{prefix}/cos_cache", f"{prefix}/sin_cache"
        if cos_name not in rw.initializers:
            cos, sin = rotary_caches(tables, self.max_positions)
            rw.add_initializer(cos_name, cos)
            rw.add_initializer(sin_name, sin)
        return cos_name, sin_name
