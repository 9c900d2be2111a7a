"""Weight-only blockwise quantization: every linear to MatMulNBits, the embedding to GatherBlockQuantized.

The quantized values come from onnxruntime.quantization's MatMulNBits quantizer (round-to-nearest
min/max per block of `block_size` weights along K); this pass only decides which nodes it touches,
how the embedding and the LM head are stored, and reports what it did.

    MatMul(x, W[K,N] fp32)          ─▶  MatMulNBits(x, W_Q[N, K/bs, bs·bits/8] u8, scales[N, K/bs], zp?)
    Gather(E[V,H] fp32, input_ids)  ─▶  GatherBlockQuantized(E_Q[V, H·bits/8] u8, input_ids, scales, zp?)

Tied embeddings share one table: MatMulNBits' B for the LM head [N=V, H/bs, blob] is the embedding
[V, H] quantized along H, so a Reshape to [V, H·bits/8] feeds GatherBlockQuantized the same bytes
(the layout onnxruntime-genai uses).

4-bit linears may keep a float minimum per block beside MatMulNBits (block_offsets.py): the INT4
recipe in quant_settings.py, and why. What the pass does is one QuantSettings (quant_settings.py).
"""

from __future__ import annotations

import enum
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from kiln.compiler.export.external import fill_tensor, stored_bytes, tensor_array, weights_dir
from kiln.compiler.passes.block_offsets import offset_linear
from kiln.compiler.passes.int4_calibration import InputMoments, linear_input_moments
from kiln.compiler.passes.int4_linear import searched_linear
from kiln.compiler.passes.dynamic_int8 import dynamic_int8_linear
from kiln.compiler.passes.q4min_linear import ensure_kiln_opset, q4min_linear, q8_linear
from kiln.compiler.passes.quant_tables import QuantizedTable, embedding_node, lm_head_node, quantize_embedding
from kiln.compiler.passes.quant_tables import weight_quantizer
from kiln.compiler.passes.quant_recipe import recipe_settings
from kiln.compiler.passes.quant_settings import Q8_ACCURACY_LEVELS, QuantSettings
from kiln.compiler.passes.verify_quant import QUANT_GATES
from kiln.compiler.plan import QuantRecipe
from kiln.contract.quant import QuantMode
from kiln.compiler.graph_utils import MS_DOMAIN, ensure_ms_opset
from kiln.engines.ort import native



# The quantize check's gate per mode is passes/verify_quant.py's QUANT_GATES; its top-1 minimums, by mode:
MIN_TOP1 = {mode: gate.min_top1 for mode, gate in QUANT_GATES.items()}


# MatMulNBits' accuracy_level: int8 activations. The record names it for MatMulNBits alone: kiln's
# MatMulQ8 linears take theirs from q8_activations (recorded beside it).
NBITS_ACCURACY_LEVEL = 4


class QuantizePass:
    name = "quantize"
    rel_tolerance = None       # its check gates on top-1 and perplexity (verify_quant.py)

    def __init__(self, settings: QuantSettings, calibration_ids: list[int] | None = None):
        """settings: what the pass does (quant_settings.py); calibration_ids: the tokens of a run whose
        linear inputs weigh the "search" rounding's errors (int4_calibration.py)."""
        self.settings = settings
        self.calibration_ids = list(calibration_ids) if calibration_ids else None
        self._details: dict = {"mode": settings.mode.value}

    @classmethod
    def for_recipe(cls, recipe: QuantRecipe, calibration_ids: list[int] | None = None) -> "QuantizePass":
        """The pass that applies a build plan's recipe (kiln.compiler.plan.QuantRecipe)."""
        return cls(recipe_settings(recipe), calibration_ids)

    def run(self, model: onnx.ModelProto) -> onnx.ModelProto:
        if self.settings.mode is QuantMode.NONE:
            self._details = {"mode": "none", "matmuls_quantized": 0}
            return model
        out = onnx.ModelProto()
        out.CopyFrom(model)     # NOTE: a graph of names and offsets when the weights are external
        before = weight_bytes(out.graph)
        rewrite = _Rewrite(self, out.graph, weights_dir(out))
        rewrite.moments = self._moments(model, rewrite.searched_inputs())
        rewrite.apply()
        ensure_ms_opset(out)
        if native.uses_native_ops(out.graph):
            ensure_kiln_opset(out)
        self._details["weight_bytes_before"] = before
        self._details["weight_bytes_after"] = weight_bytes(out.graph)
        return out

    def details(self) -> dict:
        return dict(self._details)

    def _moments(self, model: onnx.ModelProto, inputs: list[str]) -> dict[str, InputMoments]:
        """Calibration moments of the searched linears' inputs only (the rest need none)."""
        if not inputs or not self.calibration_ids:
            return {}
        self._details["calibration_tokens"] = len(self.calibration_ids)
        return linear_input_moments(model, self.calibration_ids, inputs)


class _Rewrite:
    """One run of the pass over a graph: linears first, then the embedding (it may reuse the head)."""

    def __init__(self, p: QuantizePass, graph: onnx.GraphProto, wdir: Path | None = None):
        self.p, self.graph, self.wdir = p, graph, wdir    # wdir: where external weights are read and written
        self.s = p.settings
        self.moments: dict[str, InputMoments] = {}        # searched linear input -> its calibration moments
        self.inits = {t.name: t for t in graph.initializer}
        self.head = lm_head_node(graph)
        self.embed = embedding_node(graph, self.inits)
        self.quantized: dict[str, onnx.NodeProto] = {}   # B initializer -> its MatMulNBits node
        self.groups: dict[str, list[onnx.NodeProto]] = {}  # B initializer -> all nodes replacing its MatMul
        self.skipped: list[dict] = []
        self.head_table: QuantizedTable | None = None

    def apply(self) -> None:
        nodes = [self._linear(n) if n.op_type == "MatMul" else [n] for n in self.graph.node]
        embed_note = self._embedding(nodes)
        self.graph.ClearField("node")
        self.graph.node.extend(n for group in nodes for n in group)
        _drop_unused_initializers(self.graph, self.replaced)
        self.p._details |= {
            "bits": self.s.mode.bits, "table_bits": self.s.table_bits, "block_size": self.s.block_size,
            "symmetric": self.s.symmetric, "nbits_accuracy_level": NBITS_ACCURACY_LEVEL,
            "block_offsets": self.s.block_offsets,
            "int4_rounding": self.s.int4_rounding, "offset_linears": list(self.s.offset_linears),
            "int8_kernel": self.s.int8_kernel, "nbits_linears": list(self.s.nbits_linears),
            "int8_linears": list(self.s.int8_linears), "matmuls_quantized": len(self.quantized),
            "matmuls_by_bits": dict(Counter(_bits(n) for n in self.quantized.values())), "skipped": self.skipped,
            "lm_head": self._head_note(), "embedding": embed_note, "head_kernel": self.s.head_kernel,
            "q8_activations": self.s.q8_activations, "fp32_linears": list(self.s.fp32_linears),
        }

    @property
    def replaced(self) -> set[str]:
        names = set(self.quantized)
        return names | ({self.embed.input[0]} if self.embed is not None else set())

    def searched_inputs(self) -> list[str]:
        """Inputs of the linears the zero-point search will round."""
        return list(dict.fromkeys(n.input[0] for n in self.graph.node if n.op_type == "MatMul" and not self._is_head(n)
                                  and _skip_reason(n, self.inits, self.s.block_size) is None
                                  and self._linear_bits(n) == 4 and self._int4_rounding(n) == "search"))

    def _is_head(self, node: onnx.NodeProto) -> bool:
        return self.head is not None and node.name == self.head.name and node.output == self.head.output

    def _linear(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        is_head = self._is_head(node)
        reason = _skip_reason(node, self.inits, self.s.block_size)
        if is_head and not self.s.quantize_lm_head:
            reason = "LM head kept fp32 (quantize_lm_head=False)"
        elif reason is None and set(node.name.split("/")) & set(self.s.fp32_linears):
            reason = "kept fp32 (fp32_linears)"
        if reason:
            self.skipped.append({"node": node.name, "reason": reason})
            return [node]
        b = node.input[1]
        if b in self.groups:    # NOTE: a weight shared by two MatMuls keeps one quantized copy
            return _rewire(self.groups[b], node)
        bits = self.s.table_bits if is_head else self._linear_bits(node)
        rounding = self._int4_rounding(node) if bits == 4 and not is_head else None
        if is_head and self.s.head_kernel != "nbits":
            group = [self._kiln_linear(self.s.head_kernel, node)]
            self.quantized[b], self.groups[b] = group[0], group
            return group            # NOTE: no head_table: the embedding quantizes its own
        if rounding == "search":
            group = [searched_linear(self.graph, self.inits[b], node, self.s.block_size,
                                     self.moments.get(node.input[0]), self.wdir)]
        elif rounding == "q4min":
            group = [q4min_linear(self.graph, self.inits[b], node, self.wdir)]
        elif rounding == "block_offsets":
            group = offset_linear(self.graph, self.inits[b], node, bits, self.s.block_size, self.wdir)
        elif bits == 8 and self.s.int8_kernel == "dynamic" and not is_head and self._dynamic(node):
            group = [dynamic_int8_linear(self.graph, self.inits[b], node, self.wdir, self.s.dynamic_weight_range())]
        elif bits == 8 and self.s.int8_kernel == "q8" and not is_head:
            group = [self._kiln_linear("q8", node)]
        else:
            group = [self._nbits_linear(node, bits)]
        self.quantized[b], self.groups[b] = group[0], group
        if is_head:
            self.head_table = QuantizedTable.of_matmul_nbits(group[0], bits)
        return group

    def _kiln_linear(self, kernel: str, node: onnx.NodeProto) -> onnx.NodeProto:
        """MatMul(x, W) on one of kiln's ops: "q4min" (MatMulQ4Min) or "q8" (MatMulQ8 at q8_activations)."""
        w = self.inits[node.input[1]]
        if kernel == "q4min":
            return q4min_linear(self.graph, w, node, self.wdir)
        return q8_linear(self.graph, w, node, self.wdir, Q8_ACCURACY_LEVELS[self.s.q8_activations])

    def _nbits_linear(self, node: onnx.NodeProto, bits: int) -> onnx.NodeProto:
        """MatMul(x, W) -> MatMulNBits, with onnxruntime's quantizer's values and names, one weight
        at a time (its quantize_matmul reads only inline weights)."""
        w = self.inits[node.input[1]]
        quantizer = weight_quantizer(bits, self.s.block_size, self.s.symmetric)
        packed, scales, zero_points = quantizer.qbits_block_quant(np.asarray(tensor_array(w, self.wdir)))
        tables = [(f"{w.name}_Q{bits}", packed), (f"{w.name}_scales", scales)]
        if not self.s.symmetric:
            tables.append((f"{w.name}_zero_points", zero_points))
        self.graph.initializer.extend(fill_tensor(TensorProto(), n, a, self.wdir) for n, a in tables)
        k, n = w.dims
        return helper.make_node("MatMulNBits", [node.input[0], *(name for name, _ in tables)], list(node.output),
                                name=f"{node.name}_Q{bits}", domain=MS_DOMAIN, K=k, N=n, bits=bits,
                                block_size=self.s.block_size, accuracy_level=NBITS_ACCURACY_LEVEL)

    def _dynamic(self, node: onnx.NodeProto) -> bool:
        return not set(node.name.split("/")) & set(self.s.nbits_linears)

    def _int4_rounding(self, node: onnx.NodeProto) -> str:
        if set(node.name.split("/")) & set(self.s.offset_linears):
            return "block_offsets"
        return self.s.int4_rounding

    def _linear_bits(self, node: onnx.NodeProto) -> int:
        return 8 if set(node.name.split("/")) & set(self.s.int8_linears) else self.s.mode.bits

    def _embedding(self, nodes: list[list[onnx.NodeProto]]) -> str:
        if self.embed is None:
            return "no Gather of a 2-D fp32 table by input_ids found"
        if not self.s.quantize_embedding:
            return "fp32 (quantize_embedding=False)"
        hidden = self.inits[self.embed.input[0]].dims[1]
        if hidden % self.s.block_size:
            return f"fp32 (hidden={hidden} is not divisible by block_size={self.s.block_size})"
        index = next(i for i, n in enumerate(self.graph.node) if n.output == self.embed.output)
        shared = self.head_table if self._tied() else None
        nodes[index], note = quantize_embedding(self.graph, self.inits, self.embed, shared, self.s.table_bits,
                                                self.s.block_size, self.s.symmetric, self.wdir)
        return note

    def _tied(self) -> bool:
        if self.head_table is None:
            return False
        head_w = tensor_array(self.inits[self.head.input[1]], self.wdir)
        table = tensor_array(self.inits[self.embed.input[0]], self.wdir)
        return head_w.shape == table.T.shape and np.array_equal(head_w.T, table)

    def _head_note(self) -> str:
        if self.head is None:
            return "no MatMul feeding the logits output found"
        if self.head is not None and self.head.input[1] in self.quantized and self.s.head_kernel != "nbits":
            return {"q4min": "MatMulQ4Min 4-bit (float minimum per block)", "q8": "MatMulQ8 8-bit"}[self.s.head_kernel]
        if self.head_table is None:
            return "fp32"
        return f"MatMulNBits {self.head_table.bits}-bit"


def _bits(node: onnx.NodeProto) -> int:
    if node.op_type == "DynamicQuantizeMatMul":
        return 8
    if node.domain == native.OP_DOMAIN:
        return 8 if node.op_type == native.OP_TYPE_Q8 else 4
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


def _rewire(group: list[onnx.NodeProto], node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """A copy of the nodes that replaced one MatMul, reading this MatMul's input and writing its output."""
    x, y = group[0].input[0], group[-1].output[0]
    inner = {o for n in group for o in n.output} - {y}
    rename = {x: node.input[0], y: node.output[0]} | {t: f"{node.name}/{t}" for t in inner}
    out = []
    for n in group:
        q = onnx.NodeProto()
        q.CopyFrom(n)
        q.input[:] = [rename.get(t, t) for t in n.input]
        q.output[:] = [rename.get(t, t) for t in n.output]
        q.name = f"{node.name}/{n.name}_shared"
        out.append(q)
    return out


def weight_bytes(graph: onnx.GraphProto) -> int:
    """Bytes of all initializers, as stored (packed sub-byte data counts as stored)."""
    return sum(stored_bytes(t) for t in graph.initializer)


def _drop_unused_initializers(graph: onnx.GraphProto, candidates: set[str]) -> None:
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    keep = [t for t in graph.initializer if t.name in used or t.name not in candidates]
    graph.ClearField("initializer")
    graph.initializer.extend(keep)
