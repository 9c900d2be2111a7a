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
recipe below, and why.
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
from kiln.compiler.passes.quant_recipe import pass_options
from kiln.compiler.passes.verify_quant import QUANT_GATES
from kiln.compiler.plan import QuantRecipe
from kiln.contract.quant import QuantMode
from kiln.compiler.graph_utils import MS_DOMAIN, ensure_ms_opset
from kiln.engines.ort import native



# The quantize check's gate per mode is passes/verify_quant.py's QUANT_GATES; its top-1 minimums, by mode:
MIN_TOP1 = {mode: gate.min_top1 for mode, gate in QUANT_GATES.items()}


# The INT4 defaults, the ort backend's recipe without kiln's op library (kiln/compiler/recipes.py):
# MatMulNBits alone, no side path. The attention's linears (qkv, o) 4-bit with integer zero points
# from a calibrated search, the MLP (gate_up, down) and the embedding / LM head 8-bit. SmolLM2 perplexity
# over fp32 stays within a few percent and it answers Paris (the all-4-bit block-offset recipe before it
# came closer with many more nodes; all 4-bit searched far worse: docs/results/2026-11-29-the-int4-recipe.md,
# docs/results/2026-12-06-figures-from-code-comments.md); the measured splits and the same-run speed A/B
# are in int4_search.py.
_TABLE_BITS = {QuantMode.INT8: 8, QuantMode.INT4: 8, QuantMode.W8A8: 8}
# NOTE: after MergeProjections, v_proj lives inside qkv_proj: a name listed here keeps the whole
# fused projection at 8 bits.
_INT8_LINEARS: dict[QuantMode, tuple[str, ...]] = {
    QuantMode.INT8: (), QuantMode.INT4: ("gate_up_proj", "gate_proj", "up_proj", "down_proj"), QuantMode.W8A8: ()}
# How 4-bit linears round (INT4_ROUNDINGS): "block_offsets" (a float minimum per block on a side
# path, block_offsets.py), "min_max" (onnxruntime's quantizer), "search" (integer zero points from a
# weighted search, int4_search.py), "q4min" (a float minimum per block on kiln's own kernel,
# q4min_linear.py; needs the op library, kiln/engines/ort/native).
INT4_ROUNDINGS = ("block_offsets", "min_max", "search", "q4min")
_INT4_ROUNDING = {QuantMode.INT4: "search"}
# Which of these a build takes, per backend, mode and CPU, is the build plan's quantization recipe
# (kiln/compiler/recipes.py, with why); QuantizePass.for_recipe applies one.


# How 8-bit linears run (not the LM head): "dynamic" (the w8a8 mode) = DynamicQuantizeMatMul, int8 per output channel with
# activations quantized per call (passes/dynamic_int8.py: much faster than MatMulNBits from 8 rows
# up, no slower at 1); "nbits" = MatMulNBits blocks of 32; "q8" = kiln.MatMulQ8 (Q8_0 codes,
# activations rounded per block of 32 to q8_activations, so no outlier trouble: nbits_linears does
# not apply; needs the op library). The LM head stays MatMulNBits (unless head_kernel says): it
# shares its table with the embedding and runs only at the logits rows.
INT8_KERNELS = ("dynamic", "nbits", "q8")
# MatMulNBits' accuracy_level: int8 activations. The record names it for MatMulNBits alone: kiln's
# MatMulQ8 linears take theirs from q8_activations (recorded beside it).
NBITS_ACCURACY_LEVEL = 4
# MatMulQ8's activations (QuantizePass q8_activations) -> its accuracy_level: int8 or int16 per block of 32.
Q8_ACCURACY_LEVELS = {"int8": 4, "int16": 2}
# How the LM head runs (QuantizePass head_kernel): MatMulNBits, or one of kiln's ops.
HEAD_KERNELS = ("nbits", "q8", "q4min")
# ...except these, whose input has outliers that one activation scale per call cannot hold: the
# MLP's down projection reads SiLU(gate)*up. SmolLM2 perplexity over fp32 (bench/bench_quant_ppl.py
# --fuse): down_proj dynamic, alone or with the rest, costs most of the loss; all but down_proj stays
# close (answers Paris); all MatMulNBits is closest but answers "L'Étoile" (fp32's first-token margin
# is thin). The figures: docs/results/2026-12-06-figures-from-code-comments.md.
NBITS_LINEARS = ("down_proj",)


class QuantizePass:
    name = "quantize"

    def __init__(self, mode: QuantMode, block_size: int = 32, quantize_embedding: bool = True,
                 quantize_lm_head: bool = True, symmetric: bool = False, table_bits: int | None = None,
                 int8_linears: tuple[str, ...] | None = None, block_offsets: bool | None = None,
                 int8_kernel: str | None = None, nbits_linears: tuple[str, ...] = NBITS_LINEARS,
                 int4_rounding: str | None = None, calibration_ids: list[int] | None = None,
                 offset_linears: tuple[str, ...] = (), head_kernel: str = "nbits", q8_activations: str = "int8",
                 weight_range: int | None = None, fp32_linears: tuple[str, ...] = ()):
        """table_bits: bits of the embedding and LM head; int8_linears: node-name segments (e.g.
        "down_proj") of linears kept at 8 bits. None takes the mode's recipe; (4, ()) is pure int4.
        block_offsets: 4-bit linears keep a float minimum per block (passes/block_offsets.py).
        int8_kernel: how 8-bit linears run (INT8_KERNELS). int4_rounding: INT4_ROUNDINGS (block_offsets,
        when given, picks "block_offsets" or "min_max"); "search" weighs errors by the inputs of a run
        over calibration_ids (int4_calibration.py; without them: plain squared error).
        offset_linears: node-name segments (e.g. "layers.29") of 4-bit linears that keep block offsets
        whatever int4_rounding says (a mixed split). head_kernel: "nbits" (the LM head MatMulNBits at
        table_bits, sharing its table with the embedding), "q8" (8-bit on kiln.MatMulQ8) or "q4min"
        (4-bit on kiln.MatMulQ4Min); with either of kiln's, the embedding keeps a table of its own.
        q8_activations: what every kiln.MatMulQ8 quantizes its activations to, "int8" or "int16".
        weight_range: the "dynamic" linears' largest weight magnitude (None: what this CPU runs right,
        kiln/compiler/recipes.py w8a8_weight_range). fp32_linears: node-name segments (e.g. "layers.0") of
        linears left fp32. A build passes none of these: for_recipe sets them."""
        if q8_activations not in Q8_ACCURACY_LEVELS:
            raise ValueError(f"q8_activations must be one of {tuple(Q8_ACCURACY_LEVELS)}, not {q8_activations!r}")
        self.q8_activations = q8_activations
        if head_kernel not in HEAD_KERNELS:
            raise ValueError(f"head_kernel must be one of {HEAD_KERNELS}, not {head_kernel!r}")
        self.head_kernel = head_kernel
        int8_kernel = int8_kernel or ("dynamic" if mode is QuantMode.W8A8 else "nbits")
        if int8_kernel not in INT8_KERNELS:
            raise ValueError(f"int8_kernel must be one of {INT8_KERNELS}, not {int8_kernel!r}")
        self.int8_kernel = int8_kernel
        self.nbits_linears = tuple(nbits_linears)     # name segments kept on MatMulNBits regardless
        self.mode, self.block_size, self.symmetric = mode, block_size, symmetric
        self.int4_rounding = _int4_rounding(mode, int4_rounding, block_offsets)
        if ("q4min" in (self.int4_rounding, head_kernel) or "q8" in (head_kernel, int8_kernel)) and block_size != 32:
            raise ValueError("kiln's kernels (int4_rounding='q4min', a 'q8' head or int8_kernel) take block_size=32 "
                             "(their block)")
        self.block_offsets = self.int4_rounding == "block_offsets"
        self.offset_linears = tuple(offset_linears)
        self.calibration_ids = list(calibration_ids) if calibration_ids else None
        self.quantize_embedding, self.quantize_lm_head = quantize_embedding, quantize_lm_head
        self.table_bits = table_bits or _TABLE_BITS.get(mode)
        self.int8_linears = tuple(_INT8_LINEARS.get(mode, ()) if int8_linears is None else int8_linears)
        self.rel_tolerance = None       # its check gates on top-1 and perplexity (verify_quant.py)
        self.weight_range = weight_range
        self.fp32_linears = tuple(fp32_linears)
        self._details: dict = {"mode": mode.value}

    @classmethod
    def for_recipe(cls, recipe: QuantRecipe, calibration_ids: list[int] | None = None) -> "QuantizePass":
        """The pass that applies a build plan's recipe (kiln.compiler.plan.QuantRecipe)."""
        return cls(QuantMode(recipe.mode), calibration_ids=calibration_ids, **pass_options(recipe))

    def run(self, model: onnx.ModelProto) -> onnx.ModelProto:
        if self.mode is QuantMode.NONE:
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

    def dynamic_weight_range(self) -> int:
        if self.weight_range is None:
            from kiln.compiler.recipes import w8a8_weight_range
            from kiln.contract.cpu import host

            self.weight_range = w8a8_weight_range(host())
        return self.weight_range

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
            "bits": self.p.mode.bits, "table_bits": self.p.table_bits, "block_size": self.p.block_size,
            "symmetric": self.p.symmetric, "nbits_accuracy_level": NBITS_ACCURACY_LEVEL,
            "block_offsets": self.p.block_offsets,
            "int4_rounding": self.p.int4_rounding, "offset_linears": list(self.p.offset_linears),
            "int8_kernel": self.p.int8_kernel, "nbits_linears": list(self.p.nbits_linears),
            "int8_linears": list(self.p.int8_linears), "matmuls_quantized": len(self.quantized),
            "matmuls_by_bits": dict(Counter(_bits(n) for n in self.quantized.values())), "skipped": self.skipped,
            "lm_head": self._head_note(), "embedding": embed_note, "head_kernel": self.p.head_kernel,
            "q8_activations": self.p.q8_activations, "fp32_linears": list(self.p.fp32_linears),
        }

    @property
    def replaced(self) -> set[str]:
        names = set(self.quantized)
        return names | ({self.embed.input[0]} if self.embed is not None else set())

    def searched_inputs(self) -> list[str]:
        """Inputs of the linears the zero-point search will round."""
        return list(dict.fromkeys(n.input[0] for n in self.graph.node if n.op_type == "MatMul" and not self._is_head(n)
                                  and _skip_reason(n, self.inits, self.p.block_size) is None
                                  and self._linear_bits(n) == 4 and self._int4_rounding(n) == "search"))

    def _is_head(self, node: onnx.NodeProto) -> bool:
        return self.head is not None and node.name == self.head.name and node.output == self.head.output

    def _linear(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        is_head = self._is_head(node)
        reason = _skip_reason(node, self.inits, self.p.block_size)
        if is_head and not self.p.quantize_lm_head:
            reason = "LM head kept fp32 (quantize_lm_head=False)"
        elif reason is None and set(node.name.split("/")) & set(self.p.fp32_linears):
            reason = "kept fp32 (fp32_linears)"
        if reason:
            self.skipped.append({"node": node.name, "reason": reason})
            return [node]
        b = node.input[1]
        if b in self.groups:    # NOTE: a weight shared by two MatMuls keeps one quantized copy
            return _rewire(self.groups[b], node)
        bits = self.p.table_bits if is_head else self._linear_bits(node)
        rounding = self._int4_rounding(node) if bits == 4 and not is_head else None
        if is_head and self.p.head_kernel != "nbits":
            group = [self._kiln_linear(self.p.head_kernel, node)]
            self.quantized[b], self.groups[b] = group[0], group
            return group            # NOTE: no head_table: the embedding quantizes its own
        if rounding == "search":
            group = [searched_linear(self.graph, self.inits[b], node, self.p.block_size,
                                     self.moments.get(node.input[0]), self.wdir)]
        elif rounding == "q4min":
            group = [q4min_linear(self.graph, self.inits[b], node, self.wdir)]
        elif rounding == "block_offsets":
            group = offset_linear(self.graph, self.inits[b], node, bits, self.p.block_size, self.wdir)
        elif bits == 8 and self.p.int8_kernel == "dynamic" and not is_head and self._dynamic(node):
            group = [dynamic_int8_linear(self.graph, self.inits[b], node, self.wdir, self.p.dynamic_weight_range())]
        elif bits == 8 and self.p.int8_kernel == "q8" and not is_head:
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
        return q8_linear(self.graph, w, node, self.wdir, Q8_ACCURACY_LEVELS[self.p.q8_activations])

    def _nbits_linear(self, node: onnx.NodeProto, bits: int) -> onnx.NodeProto:
        """MatMul(x, W) -> MatMulNBits, with onnxruntime's quantizer's values and names, one weight
        at a time (its quantize_matmul reads only inline weights)."""
        w = self.inits[node.input[1]]
        quantizer = weight_quantizer(bits, self.p.block_size, self.p.symmetric)
        packed, scales, zero_points = quantizer.qbits_block_quant(np.asarray(tensor_array(w, self.wdir)))
        tables = [(f"{w.name}_Q{bits}", packed), (f"{w.name}_scales", scales)]
        if not self.p.symmetric:
            tables.append((f"{w.name}_zero_points", zero_points))
        self.graph.initializer.extend(fill_tensor(TensorProto(), n, a, self.wdir) for n, a in tables)
        k, n = w.dims
        return helper.make_node("MatMulNBits", [node.input[0], *(name for name, _ in tables)], list(node.output),
                                name=f"{node.name}_Q{bits}", domain=MS_DOMAIN, K=k, N=n, bits=bits,
                                block_size=self.p.block_size, accuracy_level=NBITS_ACCURACY_LEVEL)

    def _dynamic(self, node: onnx.NodeProto) -> bool:
        return not set(node.name.split("/")) & set(self.p.nbits_linears)

    def _int4_rounding(self, node: onnx.NodeProto) -> str:
        if set(node.name.split("/")) & set(self.p.offset_linears):
            return "block_offsets"
        return self.p.int4_rounding

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
        nodes[index], note = quantize_embedding(self.graph, self.inits, self.embed, shared, self.p.table_bits,
                                                self.p.block_size, self.p.symmetric, self.wdir)
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
        if self.head is not None and self.head.input[1] in self.quantized and self.p.head_kernel != "nbits":
            return {"q4min": "MatMulQ4Min 4-bit (float minimum per block)", "q8": "MatMulQ8 8-bit"}[self.p.head_kernel]
        if self.head_table is None:
            return "fp32"
        return f"MatMulNBits {self.head_table.bits}-bit"


def _int4_rounding(mode: QuantMode, rounding: str | None, block_offsets: bool | None) -> str:
    if rounding is None and block_offsets is not None:
        rounding = "block_offsets" if block_offsets else "min_max"
    rounding = rounding or _INT4_ROUNDING.get(mode, "min_max")
    if rounding not in INT4_ROUNDINGS:
        raise ValueError(f"int4_rounding must be one of {INT4_ROUNDINGS}, not {rounding!r}")
    return rounding


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
