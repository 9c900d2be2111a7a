"""The kv_io layout "paged-gqa": ONNX Runtime's fused GroupQueryAttention as the paged graph's
attention core (ORT CPU; `kiln build --attention gqa`, not the default: see below).

Per layer, the unfused core of the standard graph (QKᵀ MatMul, scale, mask Add, Softmax, PV
MatMul, the head transposes and GQA broadcasts around them, the past+new Concats: ~17 nodes)
becomes one com.microsoft GroupQueryAttention node fed by a token gather from the pool:

    key_cache.i ─ Reshape [kvh·NB·bs, hd] ─ Gather(token_index) ─ past_key [B,kvh,MB·bs,hd] ──┐
    value_cache.i ─ (the same) ─────────────────────────────────── past_value ───────────────┤
    q [B,S,heads·hd], k/v [B,S,kvh·hd] (rotated, flat) ──────────────────────────────────────┤
    seqlens_k, total_sequence_length (shared by all layers) ── GroupQueryAttention ─ [B,S,heads·hd]

How kiln's paged call meets GroupQueryAttention's contract (ORT 1.32 CPU):
- past_key/past_value [B,kvh,P,hd]: each sequence's past tokens, gathered token by token through a
  flat view of the pool (token_index [B,kvh,MB·bs], computed once per call). Measured against the
  block gather + Transpose on a decode batch, it was several times cheaper per tensor
  (docs/results/2026-12-06-figures-from-code-comments.md).
- seqlens_k[b] = past_len_b + S - 1 for every row: padding tokens (right of the real ones in a
  [B,S] bucket) only ever sit after a row's real tokens, where causality hides them.
- total_sequence_length = P + S, P = MB·bs the past buffer's length: ORT 1.32 takes a total of
  P + S ("dynamic cache") or at most P ("static"), and reads total == S as a first prompt (any
  batch). A call of S > 1 tokens with a past buffer is taken at batch 1 only ("batch_size must be 1
  when sequence_length > 1 and past context is given"). So the ORT planner (engines/ort/batching.py)
  sends first chunks (no past) with block tables of width 0 (P = 0, batched), runs each chunk that
  continues a sequence in a call of its own, and batches decodes (S = 1) freely.
- Sliding windows: local_window_size = W (a key is visible iff q - k < W, as HF's; measured against
  a numpy reference). Gemma 2's attention softcap: softcap. Gemma's query_pre_attn_scalar: the
  graph's q_scale Mul folds into the scale attribute. So every family kiln exports (llama, mistral,
  qwen2, qwen3, phi3, gemma2, gemma3) takes this layout (tests/models passed with it as the default).
Not absorbed: rotary (do_rotary). GroupQueryAttention would rotate K inside, but the graph must
return the rotated new K for the runtime to scatter into the pool, and only `present` holds it, at
each row's own offset; RotaryEmbedding (passes/fuse_rotary.py) stays before the core.
present_key/present_value are required outputs (without them the op skips the past) and unused.

Why it is opt-in (figures and commands: docs/benchmarks.md, "Attention core: gqa vs standard"): the
op itself is no faster than the unfused MatMul/Softmax core at decode, and its token gathers cost
more than the block gathers. What it saves is nodes, which pays at one sequence and in prefill. Chunks that continue their sequences (prefix-cache hits, batched
speculative verification) lose most: they run one sequence per call. So the standard core stays
the default, and this one is opt-in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from kiln.engines.ort.batching import GQA_METADATA
from kiln.compiler.export.graph_builder import FLOAT, INT32, MS_DOMAIN, GraphBuilder
from kiln.contract.model_spec import ModelSpec
from kiln.compiler.passes.fuse_common import GraphIndex

LAYOUT = "paged-gqa"


@dataclass
class SharedInputs:
    """Tensors every layer's attention reads, computed once per call."""
    token_index: str          # [B, kvh, MB·bs] int64: row of each past token in the flat pool
    seqlens_k: str            # [B] int32: past_len + S - 1
    total: str                # scalar int32: MB·bs + S


# token_index = ((block_tables[:,None,:] + h·NB)[..., None]·bs + arange(bs)).reshape(B, kvh, MB·bs)
def shared_inputs(b: GraphBuilder, spec: ModelSpec, block_size: int, pool: str = "key_cache.0",
                  new_tokens: str = "input_ids") -> SharedInputs:
    with b.scope("model"), b.scope("paged_attention"):
        num_blocks = b.op("Shape", [pool], "NumBlocks", start=1, end=2)                       # [1]
        heads = b.const(np.arange(spec.num_kv_heads).reshape(1, -1, 1))
        blocks = b.op("Add", [b.op("Unsqueeze", ["block_tables", b.const([1])], "TablesPerHead"),
                              b.op("Mul", [heads, num_blocks], "HeadOffsets")], "PoolBlocks")  # [B,kvh,MB]
        first = b.op("Mul", [b.op("Unsqueeze", [blocks, b.const([-1])], "BlockCol"), b.const(block_size)], "FirstRow")
        rows = b.op("Add", [first, b.const(np.arange(block_size))], "TokenRows")               # [B,kvh,MB,bs]
        token_index = b.op("Reshape", [rows, b.const([0, 0, -1])], "token_index")
        seq = b.op("Squeeze", [b.op("Shape", [new_tokens], "Seq", start=1, end=2)], "SeqScalar")
        last = b.op("Add", ["past_lens", b.op("Sub", [seq, b.const(1)], "SeqMinusOne")], "LastIndex")
        seqlens = b.op("Cast", [last], "seqlens_k", to=INT32)
        width = b.op("Squeeze", [b.op("Shape", ["block_tables"], "TableWidth", start=1, end=2)], "TableWidthScalar")
        past_slots = b.op("Mul", [width, b.const(block_size)], "PastSlots")
        total = b.op("Cast", [b.op("Add", [past_slots, seq], "Total")], "total_sequence_length", to=INT32)
    return SharedInputs(token_index, seqlens, total)


def gather_past(b: GraphBuilder, spec: ModelSpec, layer: int, kind: str, shared: SharedInputs,
                pool_dtype: str = "float32") -> str:
    """[B, kvh, MB·bs, hd]: the call's past K or V of one layer, read from its pool. An fp16 pool is
    gathered at half the bytes and widened for the fp32 core; an int8 one also gathers each token's
    scale ([kvh, NB, bs, 1] beside the pool: engines/ort/kv_pool.py) and multiplies it back."""
    with b.scope("model"), b.scope(f"layers.{layer}"), b.scope("attn"):
        flat = b.op("Reshape", [f"{kind}_cache.{layer}", b.const([-1, spec.head_dim])], f"{kind}_pool_rows")
        past = b.op("Gather", [flat, shared.token_index], f"past_{kind}s_pool", axis=0)
        if pool_dtype == "float32":
            return past
        wide = b.op("Cast", [past], f"past_{kind}s_wide", to=FLOAT)
        if pool_dtype != "int8":
            return wide
        scale_rows = b.op("Reshape", [f"{kind}_scale.{layer}", b.const([-1, 1])], f"{kind}_scale_rows")
        scales = b.op("Gather", [scale_rows, shared.token_index], f"past_{kind}_scales", axis=0)
        return b.op("Mul", [wide, scales], f"past_{kind}s")


def attention_node(b: GraphBuilder, spec: ModelSpec, layer: int, q: str, k: str, v: str,
                   past: tuple[str, str], shared: SharedInputs, scale: float | None = None) -> str:
    """One GroupQueryAttention over flat q [B,S,heads·hd], k/v [B,S,kvh·hd]; returns [B,S,heads·hd]."""
    attrs = {"num_heads": spec.num_heads, "kv_num_heads": spec.num_kv_heads}
    if scale is not None:
        attrs["scale"] = float(scale)
    if spec.layer_window(layer):
        attrs["local_window_size"] = int(spec.layer_window(layer))
    if spec.attn_softcap:
        attrs["softcap"] = float(spec.attn_softcap)
    with b.scope("model"), b.scope(f"layers.{layer}"), b.scope("attn"):
        out, _, _ = b.op("GroupQueryAttention", [q, k, v, *past, shared.seqlens_k, shared.total],
                         "GroupQueryAttention", n_out=3, domain=MS_DOMAIN, **attrs)
    return out


@dataclass
class CoreSite:
    """Where one layer's unfused core sits in the standard graph (decoder_graph._attention)."""
    q: str                    # the rotated queries (flat [B,S,heads·hd] where the graph has them)
    k: str
    v: str
    output: str               # the core's merged output, which o_proj reads
    scale: float | None       # the q_scale Mul's net scale, folded into the op; None: head_dim^-0.5


def core_site(idx: GraphIndex, spec: ModelSpec, layer: int) -> CoreSite:
    scope = f"/model/layers.{layer}/attn"
    q, scale = _input_of(idx, f"{scope}/q_groups"), None
    q_scale = idx.producer.get(q)
    if q_scale is not None and q_scale.name == f"{scope}/q_scale":
        q, scale = next(i for i in q_scale.input if i not in idx.initializers), spec.query_scale
    k, v = _input_of(idx, f"{scope}/new_key_kv_major"), _input_of(idx, f"{scope}/new_value_kv_major")
    output = idx.by_name[f"{scope}/out_merge"].output[0]
    return CoreSite(q, k, v, output, scale)


def flat_heads(idx: GraphIndex, b: GraphBuilder, tensor: str, name: str) -> str:
    """tensor as [B,S,heads·hd]: the input of the Reshape that split it into heads when there is one
    (the projection's or RotaryEmbedding's output), else a Reshape back."""
    split = idx.producer.get(tensor)
    if split is not None and split.op_type == "Reshape":
        shape = idx.const(split.input[1])
        if shape is not None and shape.shape == (4,) and list(shape[:2]) == [0, 0] and min(shape[2:]) > 0:
            return split.input[0]
    return b.op("Reshape", [tensor, b.const([0, 0, -1])], name)


def _input_of(idx: GraphIndex, node_name: str) -> str:
    node = idx.by_name.get(node_name)
    if node is None:
        raise ValueError(f"kv_io ({LAYOUT}): the standard graph has no {node_name}; was it built by "
                         "export.decoder_graph?")
    return node.input[0]


def rewire_layers(g: onnx.GraphProto, b: GraphBuilder, spec: ModelSpec, block_size: int,
                  weights_dir=None, pool_dtype: str = "float32") -> tuple[dict[str, str], list[str]]:
    """Add the shared inputs, each layer's past gather and GroupQueryAttention to b. Returns the
    renames that point each o_proj at its layer's new core (the old core is then unreachable) and
    the new tokens' flat K and V of every layer [B,S,kvh·hd], layer by layer, key before value."""
    idx = GraphIndex(g, weights_dir)
    shared = shared_inputs(b, spec, block_size)
    renames, new_kv = {}, []
    for i in range(spec.num_layers):
        site = core_site(idx, spec, i)
        with b.scope("model"), b.scope(f"layers.{i}"), b.scope("attn"):
            q, k, v = (flat_heads(idx, b, t, f"{n}_flat") for t, n in ((site.q, "q"), (site.k, "k"), (site.v, "v")))
        past = tuple(gather_past(b, spec, i, kind, shared, pool_dtype) for kind in ("key", "value"))
        renames[site.output] = attention_node(b, spec, i, q, k, v, past, shared, site.scale)
        new_kv += [k, v]
    return renames, new_kv


def mark(model: onnx.ModelProto) -> None:
    """Name the core in the model's metadata: the ORT engine plans its calls by it (a graph without
    it has the standard core, which takes any batch)."""
    entry = model.metadata_props.add()
    entry.key, entry.value = GQA_METADATA

