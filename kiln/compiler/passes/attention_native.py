"""The kv_io layout "paged-native": kiln's own PagedAttention operator as the paged graph's attention
core (ORT CPU, kiln's op library: kiln/engines/ort/native/paged_attention.h).

Per layer, the standard graph's unfused core (QKᵀ, scale, mask, Softmax, PV, the head transposes,
the GQA broadcasts, the past+new Concats) and the past gathers that feed it (~25 nodes) become one
node that reads the layer's pool in place:

    q [B,S,heads·hd], k/v [B,S,kvh·hd] (rotated, flat) ──┐
    key_cache.i, value_cache.i (the pool, bound as is) ──┤
    block_tables, past_lens ─────────────────────────────┴─ kiln.PagedAttention ─ [B,S,heads·hd]

No past is copied: a decode reads each past token's K and V once, where they lie. Unlike
GroupQueryAttention it takes any batch of chunks with or without a past, so the ORT planner's
calls are the standard core's. Sliding windows (local_window_size), Gemma 2's soft-cap (softcap)
and a family's query scale (scale) are attributes, so every family kiln exports takes it. The
new tokens' K/V leave the graph token-major, [B, S, 2L·kvh·hd], as with the GQA core (the runtime
reads either layout). An fp32 pool only: the op reads float32 blocks.
"""

from __future__ import annotations

import onnx

from kiln.compiler.export.graph_builder import GraphBuilder
from kiln.compiler.passes.attention_gqa import core_site, flat_heads
from kiln.compiler.passes.fuse_common import GraphIndex
from kiln.contract.model_spec import ModelSpec
from kiln.engines.ort.native import OP_DOMAIN

LAYOUT = "paged-native"
OP_TYPE = "PagedAttention"


def attention_node(b: GraphBuilder, spec: ModelSpec, layer: int, q: str, k: str, v: str,
                   scale: float | None) -> str:
    attrs = {"num_heads": spec.num_heads, "kv_num_heads": spec.num_kv_heads,
             "scale": float(scale if scale is not None else spec.head_dim ** -0.5)}
    if spec.layer_window(layer):
        attrs["local_window_size"] = int(spec.layer_window(layer))
    if spec.attn_softcap:
        attrs["softcap"] = float(spec.attn_softcap)
    with b.scope("model"), b.scope(f"layers.{layer}"), b.scope("attn"):
        return b.op(OP_TYPE, [q, k, v, f"key_cache.{layer}", f"value_cache.{layer}", "block_tables", "past_lens"],
                    OP_TYPE, domain=OP_DOMAIN, **attrs)


def rewire_layers(g: onnx.GraphProto, b: GraphBuilder, spec: ModelSpec, pool_dtype: str = "float32",
                  weights_dir=None) -> tuple[dict[str, str], list[str]]:
    """Each layer's PagedAttention added to b. Returns the renames that point each o_proj at it (the
    old core and the dense past become unreachable) and every layer's new flat K and V, layer by
    layer, key before value."""
    if pool_dtype != "float32":
        raise ValueError(f"kv_io ({LAYOUT}): kiln's PagedAttention reads a float32 KV pool, not {pool_dtype}; "
                         "build with --attention standard for a narrower pool")
    idx = GraphIndex(g, weights_dir)
    renames, new_kv = {}, []
    for i in range(spec.num_layers):
        site = core_site(idx, spec, i)
        with b.scope("model"), b.scope(f"layers.{i}"), b.scope("attn"):
            q, k, v = (flat_heads(idx, b, t, f"{n}_flat") for t, n in ((site.q, "q"), (site.k, "k"), (site.v, "v")))
        renames[site.output] = attention_node(b, spec, i, q, k, v, site.scale)
        new_kv += [k, v]
    return renames, new_kv
