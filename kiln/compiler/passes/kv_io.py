"""kv_io: rewrite the dense KV inputs/outputs to the paged layout the runtime feeds.

Before: attention_mask [B,T], past_key_values.{i}.{key,value} [B,kvh,P,hd] -> present.* [B,kvh,T,hd]
After:  past_lens [B], block_tables [B,MB], logits_index [B,K],
        key_cache.{i} / value_cache.{i} [kvh, num_blocks, block_size, hd]   (the runtime's pool, bound
        zero-copy; head-major so the gather needs no transpose) -> logits [B,K,V] and
        new_kv [2L, kvh, B, S, hd] (the new tokens' K/V, layer-major, key before value; the GQA core
        returns it token-major, [B, S, 2L·kvh·hd], which engines/ort_batching.new_kv_layer_major
        views as the first), which the runtime scatters into the pool slots of slot_mapping in one
        vectorised write.

Each layer gathers its sequences' blocks from the pool and attends over past + new tokens; a key is
visible to a query iff key_position <= query_position, with past keys beyond past_lens at FAR.
Decode cost in context length: one gather of the context (a read and a write) plus attention's own
read. A native paged-attention kernel can replace the gather without changing these inputs.
logits_index picks the positions whose logits are computed (the last token of each sequence when
decoding; every position for perplexity), so prefill does not pay the LM head for every token.

Three attention cores, one interface (the `attention` argument; recorded as details()["layout"]):
- "standard" (layout "paged-gather"): the standard graph's own ops over the gathered past + new K/V,
  standard ONNX only, so TensorRT and the OpenVINO/CUDA rewrites take it;
- "gqa" (layout "paged-gqa", passes/attention_gqa.py; `kiln build --attention gqa`): ONNX Runtime's
  fused GroupQueryAttention, which runs a chunk with a past only at batch 1 (the ORT planner keeps
  to that); fewer nodes, faster prefill and single decodes, slower large decode batches. The graph's
  metadata names the core, so an engine plans its calls by the graph it loads; graphs built
  before it existed carry no name and are the standard core, which still loads and runs;
- "native" (layout "paged-native", passes/attention_native.py): kiln's own PagedAttention op (its
  ONNX Runtime op library), which reads the pool in place: no gather, any batch, one node per layer.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from kiln.compiler.export.decoder_graph import (FAR, FINAL_HIDDEN, KEY_POSITIONS, QUERY_POSITIONS, new_kv_name,
                                       past_transpose_name)
from kiln.compiler.export.graph_builder import FLOAT, INT64, GraphBuilder
from kiln.contract.model_spec import ModelSpec
from kiln.compiler.passes import attention_gqa, attention_native
from kiln.compiler.graph_utils import prune, toposort
from kiln.compiler.passes.q4min_linear import ensure_kiln_opset

KV_KINDS = ("key", "value")
ATTENTION_CORES = {"standard": "paged-gather", "gqa": attention_gqa.LAYOUT,       # core -> layout name
                   "native": attention_native.LAYOUT}
# pool dtype -> (ONNX element type, the paged graph's tolerance against the dense one). fp16: past
# K/V rounded to 11 significant bits (relative 2^-11 each) before attention reads them; measured on
# tiny-llama and SmolLM2 the logits move by far less than the bound, so it holds with room.
# int8: each token's head rounded to 1/254 of its largest value (engines/ort/kv_pool.py); SmolLM2's
# logits move more, still inside the bound (docs/results/2026-12-06-figures-from-code-comments.md).
KV_DTYPES = {"float32": (TensorProto.FLOAT, 1e-4), "float16": (TensorProto.FLOAT16, 1e-2),
             "int8": (TensorProto.INT8, 5e-2)}


class KvIoPass:
    name = "kv_io"

    def __init__(self, spec: ModelSpec, block_size: int = 16, rel_tolerance: float | None = None,
                 attention: str = "standard", kv_dtype: str = "float32"):
        if attention not in ATTENTION_CORES:
            raise ValueError(f"kv_io: unknown attention core {attention!r}; one of {', '.join(ATTENTION_CORES)}")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_io: unknown KV dtype {kv_dtype!r}; one of {', '.join(KV_DTYPES)}")
        self.attention, self.kv_dtype = attention, kv_dtype
        if rel_tolerance is None:
            rel_tolerance = KV_DTYPES[kv_dtype][1]
        # NOTE: quantized graphs are held to this tolerance too: verify_paged.compare_paged runs both
        # graphs with fp32 activations (MatMulNBits' int8 activations would turn the paged attention's
        # other summation order into whole rounding steps).
        self.spec, self.block_size, self.rel_tolerance = spec, block_size, rel_tolerance
        self._rewired = 0

    def details(self) -> dict:
        return {"layout": ATTENTION_CORES[self.attention], "block_size": self.block_size, "kv_dtype": self.kv_dtype,
                "pool_shape": ["kv_heads", "num_blocks", "block_size", "head_dim"],
                "layers_rewired": self._rewired}

    def run(self, model: onnx.ModelProto) -> onnx.ModelProto:
        out = onnx.ModelProto()
        out.CopyFrom(model)
        g = out.graph
        b = GraphBuilder("kv_io")
        self._add_inputs(b)
        renames = {self._output_of(g, FINAL_HIDDEN): self._gather_logit_rows(b, g)}
        replaced = {FINAL_HIDDEN}
        if self.attention in ("gqa", "native"):
            # NOTE: the old core, the mask and the dense past become unreachable and are pruned.
            if self.attention == "gqa":
                core, new_kv_parts = attention_gqa.rewire_layers(g, b, self.spec, self.block_size,
                                                                 pool_dtype=self.kv_dtype)
                attention_gqa.mark(out)
            else:
                core, new_kv_parts = attention_native.rewire_layers(g, b, self.spec, pool_dtype=self.kv_dtype)
                ensure_kiln_opset(out)
            renames |= core
            with b.scope("model"), b.scope("new_kv"):
                new_kv = b.op("Concat", new_kv_parts, "Concat", axis=-1)
            new_kv_shape = ["batch", "seq", 2 * self.spec.num_layers * self.spec.num_kv_heads * self.spec.head_dim]
        else:
            renames |= self._rewire_standard(b, g, replaced)
            new_kv = self._concat_new_kv(b, g)
            new_kv_shape = [2 * self.spec.num_layers, self.spec.num_kv_heads, "batch", "seq", self.spec.head_dim]
        self._rewired = self.spec.num_layers
        _splice(g, b, replaced, renames)
        _replace_io(g, b, new_kv, new_kv_shape, self.spec)
        prune(g)
        toposort(g)
        return out

    def _rewire_standard(self, b: GraphBuilder, g: onnx.GraphProto, replaced: set[str]) -> dict[str, str]:
        """Past K/V from the pool and the mask from positions; the standard graph's core stays."""
        renames = self._positions(b)
        replaced |= {KEY_POSITIONS, QUERY_POSITIONS}
        for i in range(self.spec.num_layers):
            for kind in KV_KINDS:
                renames |= {self._output_of(g, past_transpose_name(i, kind)): self._gather_past(b, i, kind)}
                replaced.add(past_transpose_name(i, kind))
        return renames

    @staticmethod
    def _output_of(g: onnx.GraphProto, node_name: str) -> str:
        return next(n.output[0] for n in g.node if n.name == node_name)

    def _add_inputs(self, b: GraphBuilder) -> None:
        s = self.spec
        b.input("past_lens", INT64, ["batch"])
        b.input("block_tables", INT64, ["batch", "max_blocks"])
        b.input("logits_index", INT64, ["batch", "logits_positions"])
        for i in range(s.num_layers):
            for kind in KV_KINDS:
                b.input(f"{kind}_cache.{i}", KV_DTYPES[self.kv_dtype][0],
                        [s.num_kv_heads, "num_blocks", self.block_size, s.head_dim])
                if self.kv_dtype == "int8":     # one scale per token and head (engines/ort/kv_pool.py)
                    b.input(f"{kind}_scale.{i}", FLOAT, [s.num_kv_heads, "num_blocks", self.block_size, 1])

    # key_positions: [past slots: j if j < past_len else FAR | new tokens: past_len + s]
    # query_positions: past_len + s
    def _positions(self, b: GraphBuilder) -> dict[str, str]:
        with b.scope("model"), b.scope("paged_positions"):
            lens = b.op("Unsqueeze", ["past_lens", b.const([1])], "PastLensCol")            # [B,1]
            slots = b.op("Mul", [_dim(b, "block_tables", 1), b.const(self.block_size)], "PastSlots")
            past_idx = b.op("Range", [b.const(0), slots, b.const(1)], "PastIndex")           # [Tp]
            valid = b.op("Less", [b.op("Unsqueeze", [past_idx, b.const([0])], "PastRow"), lens], "PastValid")
            kp_past = b.op("Where", [valid, past_idx, b.const(FAR)], "PastKeyPositions")    # [B,Tp]
            new_idx = b.op("Range", [b.const(0), _dim(b, "input_ids", 1), b.const(1)], "NewIndex")
            qp = b.op("Add", [b.op("Unsqueeze", [new_idx, b.const([0])], "NewRow"), lens], "query_positions")
            kp = b.op("Concat", [kp_past, qp], "key_positions", axis=1)                     # [B,Tp+S]
        return {_out(KEY_POSITIONS): kp, _out(QUERY_POSITIONS): qp}

    # pool [kvh,NB,bs,hd] ─ Gather(block_tables, axis=1) ─ [kvh,B,MB,bs,hd] ─ Reshape ─ [kvh,B,MB*bs,hd]
    def _gather_past(self, b: GraphBuilder, i: int, kind: str) -> str:
        with b.scope("model"), b.scope(f"layers.{i}"), b.scope("attn"):
            blocks = b.op("Gather", [f"{kind}_cache.{i}", "block_tables"], f"gather_{kind}_blocks", axis=1)
            if self.kv_dtype != "float32":      # gathered at a fraction of the bytes, widened for the fp32 core
                blocks = b.op("Cast", [blocks], f"widen_{kind}_blocks", to=FLOAT)
            if self.kv_dtype == "int8":
                scales = b.op("Gather", [f"{kind}_scale.{i}", "block_tables"], f"gather_{kind}_scales", axis=1)
                blocks = b.op("Mul", [blocks, scales], f"scale_{kind}_blocks")
            return b.op("Reshape", [blocks, b.const([0, 0, -1, self.spec.head_dim])], f"past_{kind}s")

    # hidden [B,S,H] ─ GatherElements(axis=1, logits_index expanded to [B,K,H]) ─ [B,K,H]
    def _gather_logit_rows(self, b: GraphBuilder, g: onnx.GraphProto) -> str:
        hidden = next(n.input[0] for n in g.node if n.name == FINAL_HIDDEN)
        with b.scope("model"), b.scope("logits_rows"):
            idx = b.op("Unsqueeze", ["logits_index", b.const([-1])], "Unsqueeze")
            shape = b.op("Concat", [b.op("Shape", ["logits_index"], "IndexShape"),
                                    b.const([self.spec.hidden_size])], "Shape", axis=0)
            idx = b.op("Expand", [idx, shape], "Expand")
            return b.op("GatherElements", [hidden, idx], "GatherElements", axis=1)

    def _concat_new_kv(self, b: GraphBuilder, g: onnx.GraphProto) -> str:
        parts = []
        with b.scope("model"), b.scope("new_kv"):
            for i in range(self.spec.num_layers):
                for kind in KV_KINDS:
                    t = self._output_of(g, new_kv_name(i, kind))
                    parts.append(b.op("Unsqueeze", [t, b.const([0])], f"layers.{i}.{kind}"))
            return b.op("Concat", parts, "Concat", axis=0)


def _out(node_name: str) -> str:
    return f"{node_name}_output_0"


def _dim(b: GraphBuilder, tensor: str, axis: int) -> str:
    shape = b.op("Shape", [tensor], f"Shape_{tensor}_{axis}", start=axis, end=axis + 1)
    return b.op("Squeeze", [shape], f"Dim_{tensor}_{axis}")


def _splice(g: onnx.GraphProto, b: GraphBuilder, replaced: set[str], renames: dict[str, str]) -> None:
    """Drop the replaced nodes, add the new ones, and point consumers at the new tensors."""
    kept = [n for n in g.node if n.name not in replaced]
    for n in kept:
        for j, name in enumerate(n.input):
            if name in renames:
                n.input[j] = renames[name]
    del g.node[:]
    g.node.extend(b.nodes + kept)   # out of order until toposort
    g.initializer.extend(b.initializers)


def _replace_io(g: onnx.GraphProto, b: GraphBuilder, new_kv: str, new_kv_shape: list, spec: ModelSpec) -> None:
    old_inputs = [i for i in g.input if i.name not in ("attention_mask",) and not i.name.startswith("past_key_values.")]
    del g.input[:]
    g.input.extend(old_inputs + b.inputs)
    logits = next(o for o in g.output if o.name == "logits")
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("logits", FLOAT, ["batch", "logits_positions", spec.vocab_size]))
    g.node.append(helper.make_node("Identity", [new_kv], ["new_kv"], name="/outputs/new_kv"))
    g.output.append(helper.make_tensor_value_info("new_kv", FLOAT, new_kv_shape))
    del logits
