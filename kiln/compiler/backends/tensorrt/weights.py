"""Weight-only int4 for TensorRT: kiln's quantized graph in the ops TensorRT's parser takes.

TensorRT (11: only explicit quantization) runs int4 weight-only matmuls from a block-quantized
DequantizeLinear (ONNX opset 21, a scale per block along K) feeding a MatMul. Its ONNX parser takes
signed INT4 only, with zero points zero, so MatMulNBits' unsigned nibbles q (zero point zp) are
stored as q - 8 and the difference, scale·(8 - zp) per block, moves into the linear's per-block
offset term (passes/block_offsets.py), which already adds a float per block:
scale·(q - zp) + min = scale·(q - 8) + (min + scale·(8 - zp)). kiln's quantize pass emits ONNX
Runtime contrib ops; this rewrites them:

    MatMulNBits 4-bit (B [N, K/bs, bs/2] u8, scales, zp)  ─▶  DequantizeLinear(W_q [K, N] s4,
                                                              scale [K/bs, N], no zero point,
                                                              axis 0, block_size bs) ─ MatMul
    its block offset MatMul(block sums, mins [K/bs, N])   ─▶  mins + scale·(8 - zp)
    MatMulNBits 8-bit (the LM head in the int4 recipe)     ─▶  MatMul with the dequantized weight
    GatherBlockQuantized (the embedding)                   ─▶  Gather from the dequantized table

The 8-bit tables are dequantized here (TensorRT's block quantization is for 4-bit weights); the
fp16 conversion then halves them. Q4_1's per-block minimums (passes/block_offsets.py) are plain
MatMul/Add and stay as they are.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.compiler.graph_utils import prune, toposort

MIN_OPSET = 21          # block-quantized DequantizeLinear
INT4_SHIFT = 8          # unsigned nibble -> signed INT4 (TensorRT has no UINT4)


def int4_weight_only(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
    """A copy in standard ops (model's weights inline); returns it and a count of what changed."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inits = {t.name: t for t in g.initializer}
    done = {"int4_dequantize_linear": 0, "dequantized_8bit": 0, "embedding_tables": 0}
    links = _Links(g)
    nodes = []
    for node in g.node:
        if node.op_type == "MatMulNBits":
            bits = _attr(node, "bits")
            nodes += (_int4_matmul(g, inits, node, links) if bits == 4 else _dequantized_matmul(g, inits, node))
            done["int4_dequantize_linear" if bits == 4 else "dequantized_8bit"] += 1
        else:
            nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)
    for node in [n for n in g.node if n.op_type == "GatherBlockQuantized"]:
        _gather_from_table(out, node)
        done["embedding_tables"] += 1
    prune(g)
    toposort(g)
    _require_opset(out)
    return out, done


def _attr(node: onnx.NodeProto, name: str, default=None):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _unpack(node: onnx.NodeProto, inits: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(q [N, K] ints, scales [N, K/bs], zero points [N, K/bs], block size) of a MatMulNBits."""
    k, n, bits, bs = (_attr(node, a) for a in ("K", "N", "bits", "block_size"))
    blocks = -(-k // bs)
    packed = numpy_helper.to_array(inits[node.input[1]]).reshape(n, -1)
    q = _nibbles(packed) if bits == 4 else packed
    scales = numpy_helper.to_array(inits[node.input[2]]).astype(np.float32).reshape(n, blocks)
    if len(node.input) > 3 and node.input[3]:
        zp = numpy_helper.to_array(inits[node.input[3]]).reshape(n, -1)
        zp = (_nibbles(zp) if bits == 4 else zp)[:, :blocks]
    else:
        zp = np.full((n, blocks), 1 << (bits - 1), np.uint8)
    return q[:, :k], scales, zp, bs


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., M] -> [..., 2M]: the low nibble first (the even index), as MatMulNBits packs."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def _int4(name: str, values: np.ndarray) -> TensorProto:
    """Signed values in -8..7 as an INT4 tensor: two's-complement nibbles, the even index low."""
    flat = (values.astype(np.int8).reshape(-1) & 0x0F).astype(np.uint8)
    flat = np.concatenate([flat, np.zeros(len(flat) % 2, np.uint8)])
    return helper.make_tensor(name, TensorProto.INT4, values.shape, (flat[0::2] | (flat[1::2] << 4)).tobytes(),
                              raw=True)


class _Links:
    """Who produces and who consumes each tensor of the graph as it was before the rewrite."""

    def __init__(self, g: onnx.GraphProto):
        self.producer = {o: n for n in g.node for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in g.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)


def _int4_matmul(g: onnx.GraphProto, inits: dict, node: onnx.NodeProto, links: _Links) -> list[onnx.NodeProto]:
    q, scales, zp, bs = _unpack(node, inits)
    shift = scales * (INT4_SHIFT - zp.astype(np.float32))          # [N, K/bs]: taken off each block
    if shift.any():
        _fold_into_block_offset(g, inits, node, links, np.ascontiguousarray(shift.T))
    base = node.name or node.output[0]
    names = [f"{base}/W_s4", f"{base}/W_scale"]
    signed = q.astype(np.int8) - INT4_SHIFT
    g.initializer.extend([_int4(names[0], signed.T), numpy_helper.from_array(np.ascontiguousarray(scales.T), names[1])])
    weight = f"{base}/W"
    return [helper.make_node("DequantizeLinear", names, [weight], name=f"{base}/dequantize", axis=0, block_size=bs),
            *_matmul(node, weight, base)]


def _fold_into_block_offset(g: onnx.GraphProto, inits: dict, node: onnx.NodeProto, links: _Links,
                            shift: np.ndarray) -> None:
    """Add shift [K/bs, N] to the per-block offset the linear's output is added to
    (Add(MatMulNBits, MatMul(block sums, mins))): a new table, so a shared one stays as it was."""
    offset = _block_offset_of(node, inits, links, shift.shape)
    if offset is None:
        raise ValueError(f"{node.name}: TensorRT takes signed int4 with zero points zero, and this linear's "
                         "zero points are not 8 with no per-block offset to fold the difference into; "
                         "quantize it with block offsets (kiln's int4 recipe for the tensorrt backend)")
    mins = numpy_helper.to_array(inits[offset.input[1]]).astype(np.float32)
    name = f"{node.name or node.output[0]}/block_offsets_int4"
    table = numpy_helper.from_array(mins + shift, name)
    g.initializer.append(table)
    inits[name] = table
    offset.input[1] = name


def _block_offset_of(node: onnx.NodeProto, inits: dict, links: _Links, shape: tuple) -> onnx.NodeProto | None:
    """The MatMul(block sums, mins [K/bs, N]) whose output is added to this node's, if there is one."""
    adds = [n for n in links.consumers.get(node.output[0], []) if n.op_type == "Add"]
    if len(links.consumers.get(node.output[0], [])) != 1 or not adds:
        return None
    other = next((i for i in adds[0].input if i != node.output[0]), "")
    offset = links.producer.get(other)
    if offset is None or offset.op_type != "MatMul" or offset.input[1] not in inits:
        return None
    return offset if tuple(inits[offset.input[1]].dims) == tuple(shape) else None


def _dequantized_matmul(g: onnx.GraphProto, inits: dict, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    q, scales, zp, bs = _unpack(node, inits)
    w = (q.astype(np.float32) - np.repeat(zp, bs, axis=1)[:, :q.shape[1]]) * np.repeat(scales, bs, axis=1)[:, :q.shape[1]]
    base = node.name or node.output[0]
    g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w.T), f"{base}/W"))
    return _matmul(node, f"{base}/W", base)


def _matmul(node: onnx.NodeProto, weight: str, base: str) -> list[onnx.NodeProto]:
    bias = node.input[5] if len(node.input) > 5 and node.input[5] else ""
    if not bias:
        return [helper.make_node("MatMul", [node.input[0], weight], list(node.output), name=f"{base}/MatMul")]
    product = f"{base}/MatMul_output_0"
    return [helper.make_node("MatMul", [node.input[0], weight], [product], name=f"{base}/MatMul"),
            helper.make_node("Add", [product, bias], list(node.output), name=f"{base}/bias")]


def _gather_from_table(model: onnx.ModelProto, node: onnx.NodeProto) -> None:
    """Replace the quantized embedding (the node, and a block-merging Reshape after it) by a Gather
    from its table, dequantized by running that very subgraph over every token id on ONNX Runtime."""
    import onnxruntime as ort

    g = model.graph
    ids, end = node.input[1], _embedding_end(g, node)
    vocab = _vocab_size(g, node)
    sub = _subgraph(model, ids, end)
    table = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {ids: np.arange(vocab, dtype=np.int64)[None, :]})[0][0]
    name = f"{node.name or end}/table"
    g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(table, np.float32), name))
    g.node.append(helper.make_node("Gather", [name, ids], [end], name=f"{node.name or end}/Gather", axis=0))
    for n in [n for n in g.node if n is node or (end in n.output and n.op_type != "Gather")]:
        g.node.remove(n)


def _subgraph(model: onnx.ModelProto, ids: str, end: str) -> onnx.ModelProto:
    """The nodes between the token ids and `end`, with their initializers, as a model of its own."""
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    inits = {t.name: t for t in g.initializer}
    nodes, used, stack = [], set(), [end]
    while stack:
        name = stack.pop()
        if name in used or name == ids or name in inits or name not in producer:
            used.add(name)
            continue
        used.add(name)
        nodes.insert(0, producer[name])
        stack.extend(i for i in producer[name].input if i)
    graph = helper.make_graph(nodes, "embedding", [helper.make_tensor_value_info(ids, TensorProto.INT64, [1, None])],
                              [helper.make_tensor_value_info(end, TensorProto.FLOAT, None)],
                              [inits[n] for n in used if n in inits])
    return helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)


def _embedding_end(g: onnx.GraphProto, node: onnx.NodeProto) -> str:
    """The embedding's output: the node's, or that of the Reshape merging its blocks (3-D form)."""
    consumers = [n for n in g.node if node.output[0] in n.input]
    if len(consumers) == 1 and consumers[0].op_type == "Reshape" and consumers[0].name.endswith("/merge_blocks"):
        return consumers[0].output[0]
    return node.output[0]


def _vocab_size(g: onnx.GraphProto, node: onnx.NodeProto) -> int:
    logits = next(o for o in g.output if o.name == "logits")
    return logits.type.tensor_type.shape.dim[-1].dim_value


def _require_opset(model: onnx.ModelProto) -> None:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx") and o.version < MIN_OPSET:
            raise ValueError(f"int4 for TensorRT needs ONNX opset {MIN_OPSET} (block-quantized "
                             f"DequantizeLinear); this graph is opset {o.version}")
