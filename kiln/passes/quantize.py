"""Weight-only blockwise quantization: every linear to MatMulNBits, the embedding to GatherBlockQuantized.

The quantized values come from onnxruntime.quantization's MatMulNBits quantizer (round-to-nearest
min/max per block of `block_size` weights along K); this pass only decides which nodes it touches,
how the embedding and the LM head are stored, and reports what it did.

    MatMul(x, W[K,N] fp32)          ─▶  MatMulNBits(x, W_Q[N, K/bs, bs·bits/8] u8, scales[N, K/bs], zp?)
    Gather(E[V,H] fp32, input_ids)  ─▶  GatherBlockQuantized(E_Q[V, H·bits/8] u8, input_ids, scales, zp?)

Tied embeddings share one table: MatMulNBits' B for the LM head [N=V, H/bs, blob] is the embedding
[V, H] quantized along H, so a Reshape to [V, H·bits/8] feeds GatherBlockQuantized the same bytes
(the layout onnxruntime-genai uses).
"""

from __future__ import annotations

import enum
from collections import Counter

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.passes.quant_tables import QuantizedTable, embedding_node, lm_head_node, quantize_embedding
from kiln.passes.quant_tables import weight_quantizer

MS_DOMAIN = "com.microsoft"


class QuantMode(enum.Enum):
    """Weight precision of an engine; stored in the manifest by value."""

    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def bits(self) -> int | None:
        return {QuantMode.NONE: None, QuantMode.INT8: 8, QuantMode.INT4: 4}[self]


# Max abs logit error / max |logit| on verify.seeded_feeds (random ids after a past the model
# computed itself): a sanity check that the graph computes the same function, not a quality
# metric (that is kiln.eval.perplexity). Measured, seeds 0-2, default recipes: tiny presets int8
# <= 0.019, int4 <= 0.15; SmolLM2 (fused) int8 0.027-0.14, int4 0.19-0.55. A broken graph
# (a mis-laid-out table, wrong scales) gives errors of order 1.
_REL_TOLERANCE = {QuantMode.NONE: 0.0, QuantMode.INT8: 0.3, QuantMode.INT4: 0.8}


# The INT4 recipe keeps the most sensitive weights at 8 bits (like llama.cpp's Q4_K_M). SmolLM2,
# perplexity over int8-everywhere when one kind goes 4-bit: tables +8.8%, down_proj +6.0%, v_proj
# +4.0%, up +2.8%, q/k/gate +1.5-1.7%, o +0.3%. On the fused graph: all-4-bit +37%, this recipe
# +7.7%, int8 +0.8% (bench/bench_quant_ppl.py --fuse). Block 16 gains one point for 16% more bytes.
_TABLE_BITS = {QuantMode.INT8: 8, QuantMode.INT4: 8}
# NOTE: after MergeProjections, v_proj lives inside qkv_proj, so the whole fused projection stays 8-bit.
_INT8_LINEARS = {QuantMode.INT8: (), QuantMode.INT4: ("v_proj", "qkv_proj", "down_proj")}


class QuantizePass:
    name = "quantize"

    def __init__(self, mode: QuantMode, block_size: int = 32, quantize_embedding: bool = True,
                 quantize_lm_head: bool = True, symmetric: bool = False, table_bits: int | None = None,
                 int8_linears: tuple[str, ...] | None = None):
        """table_bits: bits of the embedding and LM head; int8_linears: node-name segments (e.g.
        "down_proj") of linears kept at 8 bits. None takes the mode's recipe; (4, ()) is pure int4."""
        self.mode, self.block_size, self.symmetric = mode, block_size, symmetric
        self.quantize_embedding, self.quantize_lm_head = quantize_embedding, quantize_lm_head
        self.table_bits = table_bits or _TABLE_BITS.get(mode)
        self.int8_linears = tuple(_INT8_LINEARS.get(mode, ()) if int8_linears is None else int8_linears)
        self.rel_tolerance = _REL_TOLERANCE[mode]
        self._details: dict = {"mode": mode.value}

    def run(self, model: onnx.ModelProto) -> onnx.ModelProto:
        if self.mode is QuantMode.NONE:
            self._details = {"mode": "none", "matmuls_quantized": 0}
            return model
        out = onnx.ModelProto()
        out.CopyFrom(model)
        before = weight_bytes(out.graph)
        _Rewrite(self, out.graph).apply()
        _ensure_ms_opset(out)
        self._details["weight_bytes_before"] = before
        self._details["weight_bytes_after"] = weight_bytes(out.graph)
        return out

    def details(self) -> dict:
        return dict(self._details)


class _Rewrite:
    """One run of the pass over a graph: linears first, then the embedding (it may reuse the head)."""

    def __init__(self, p: QuantizePass, graph: onnx.GraphProto):
        self.p, self.graph = p, graph
        self.inits = {t.name: t for t in graph.initializer}
        self.head = lm_head_node(graph)
        self.embed = embedding_node(graph, self.inits)
        self.quantized: dict[str, onnx.NodeProto] = {}   # B initializer -> its MatMulNBits node
        self.skipped: list[dict] = []
        self.head_table: QuantizedTable | None = None

    def apply(self) -> None:
        nodes = [self._linear(n) if n.op_type == "MatMul" else [n] for n in self.graph.node]
        embed_note = self._embedding(nodes)
        self.graph.ClearField("node")
        self.graph.node.extend(n for group in nodes for n in group)
        _drop_unused_initializers(self.graph, self.replaced)
        self.p._details |= {
            "bits": self.p.mode.bits, "table_bits": self.p.table_bits, "block_size": self.p.block_size,
            "symmetric": self.p.symmetric, "accuracy_level": 4,
            "int8_linears": list(self.p.int8_linears), "matmuls_quantized": len(self.quantized),
            "matmuls_by_bits": dict(Counter(_bits(n) for n in self.quantized.values())), "skipped": self.skipped,
            "lm_head": self._head_note(), "embedding": embed_note,
        }

    @property
    def replaced(self) -> set[str]:
        names = set(self.quantized)
        return names | ({self.embed.input[0]} if self.embed is not None else set())

    def _linear(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        is_head = self.head is not None and node.name == self.head.name and node.output == self.head.output
        reason = _skip_reason(node, self.inits, self.p.block_size)
        if is_head and not self.p.quantize_lm_head:
            reason = "LM head kept fp32 (quantize_lm_head=False)"
        if reason:
            self.skipped.append({"node": node.name, "reason": reason})
            return [node]
        b = node.input[1]
        if b in self.quantized:    # NOTE: a weight shared by two MatMuls keeps one quantized copy
            return [_rewire(self.quantized[b], node)]
        bits = self.p.table_bits if is_head else self._linear_bits(node)
        (q,) = weight_quantizer(bits, self.p.block_size, self.p.symmetric).quantize_matmul(node, [self.graph])
        self.quantized[b] = q
        if is_head:
            self.head_table = QuantizedTable.of_matmul_nbits(q, bits)
        return [q]

    def _linear_bits(self, node: onnx.NodeProto) -> int:
        return 8 if set(node.name.split("/")) & set(self.p.int8_linears) else self.p.mode.bits

    def _embedding(self, nodes: list[list[onnx.NodeProto]]) -> str:
        if self.embed is None:
            return "no Gather of a 2-D fp32 table by input_ids found"
        if not self.p.quantize_embedding:
            return "fp32 (quantize_embedding=False)"
        hidden = self.inits[self.embed.input[0]].dims[1]
        if hidden % self.p.block_size:
            return f"fp32 (hidden={hidden} is not divisible by block_size={self.p.block_size})"
        index = next(i for i, n in enumerate(self.graph.node) if n.output == self.embed.output)
        shared = self.head_table if self._tied() else None
        nodes[index], note = quantize_embedding(self.graph, self.inits, self.embed, shared,
                                                self.p.table_bits, self.p.block_size, self.p.symmetric)
        return note

    def _tied(self) -> bool:
        if self.head_table is None:
            return False
        head_w = numpy_helper.to_array(self.inits[self.head.input[1]])
        table = numpy_helper.to_array(self.inits[self.embed.input[0]])
        return head_w.shape == table.T.shape and np.array_equal(head_w.T, table)

    def _head_note(self) -> str:
        if self.head is None:
            return "no MatMul feeding the logits output found"
        if self.head_table is None:
            return "fp32"
        return f"MatMulNBits {self.head_table.bits}-bit"


def _bits(node: onnx.NodeProto) -> int:
    return next(a.i for a in node.attribute if a.name == "bits")


def _skip_reason(node: onnx.NodeProto, inits: dict[str, TensorProto], block_size: int) -> str | None:
    w = inits.get(node.input[1])
    if w is None:
        return "B is not an initializer (activation x activation)"
    if len(w.dims) != 2:
        return f"B is {len(w.dims)}-D, not 2-D"
    if w.data_type != TensorProto.FLOAT:
        return f"B is {TensorProto.DataType.Name(w.data_type)}, not FLOAT"
    if w.dims[0] % block_size:
        return f"K={w.dims[0]} is not divisible by block_size={block_size}"
    return None


def _rewire(quantized: onnx.NodeProto, node: onnx.NodeProto) -> onnx.NodeProto:
    q = onnx.NodeProto()
    q.CopyFrom(quantized)
    q.input[0], q.output[0], q.name = node.input[0], node.output[0], node.name + "_Q"
    return q


def weight_bytes(graph: onnx.GraphProto) -> int:
    """Bytes of all initializers, as stored (packed sub-byte data counts as stored)."""
    return sum(_tensor_bytes(t) for t in graph.initializer)


def _tensor_bytes(t: TensorProto) -> int:
    if t.HasField("raw_data"):
        return len(t.raw_data)
    return numpy_helper.to_array(t).nbytes


def _drop_unused_initializers(graph: onnx.GraphProto, candidates: set[str]) -> None:
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    keep = [t for t in graph.initializer if t.name in used or t.name not in candidates]
    graph.ClearField("initializer")
    graph.initializer.extend(keep)


def _ensure_ms_opset(model: onnx.ModelProto) -> None:
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
