"""Numeric check of the kv_io rewrite: the paged graph against the dense graph it came from.

The dense graph's past KV (one row left-padded) is written into a pool through a shuffled block
table; logits at every position and the new tokens' K/V must match the dense run.

Both graphs run with fp32 activations (MatMulNBits at accuracy_level 0), so the layout pass is held
to its own tight tolerance on quantized graphs too: at level 4 MatMulNBits rounds activations to
int8, and a tiny difference in the attention's summation order flips whole rounding steps (measured
on SmolLM2 int8: the same tiny nudge to the past KV moved the logits thousands of times as far as in
fp32; docs/results/2026-12-06-figures-from-code-comments.md).
The quantized weights are the same at either level, so the check still covers the graph as built.
"""

from __future__ import annotations

import numpy as np
import onnx

from kiln.engines.ort import native
from kiln.engines.ort.kv_pool import quantize_rows
from kiln.engines.ort.batching import new_kv_layer_major
from kiln.compiler.passes.verify import _session, seeded_feeds

KINDS = ("key", "value")
# ops whose accuracy_level 4 rounds activations to int8 and 0 keeps them float (kiln.MatMulQ4Min too)
LEVELLED_OPS = ("MatMulNBits", native.OP_TYPE, native.OP_TYPE_Q8)
POOL_INPUTS = ("key_cache.", "value_cache.", "key_scale.", "value_scale.")   # shared by all rows


def fp32_activations(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph with every MatMulNBits (and MatMulQ4Min) at accuracy_level 0 and every DynamicQuantizeMatMul as a
    MatMul of its dequantized weight (same weights, fp32 activations)."""
    levels = [a for n in model.graph.node if n.op_type in LEVELLED_OPS for a in n.attribute
              if a.name == "accuracy_level" and a.i != 0]
    dynamic = [n for n in model.graph.node if n.op_type == "DynamicQuantizeMatMul"]
    if not levels and not dynamic:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for n in out.graph.node:
        for a in n.attribute:
            if n.op_type in LEVELLED_OPS and a.name == "accuracy_level":
                a.i = 0
    nodes = [_dequantized_matmul(n) if n.op_type == "DynamicQuantizeMatMul" else [n] for n in out.graph.node]
    out.graph.ClearField("node")
    out.graph.node.extend(n for group in nodes for n in group)
    return out


def _dequantized_matmul(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """DynamicQuantizeMatMul(x, q, scales, zero points) -> MatMul(x, DequantizeLinear(q) per column)."""
    x, q, scales, zero_points = node.input[:4]
    w = f"{node.name}/dequantized_weight"
    return [onnx.helper.make_node("DequantizeLinear", [q, scales, zero_points], [w], name=f"{node.name}/dequantize",
                                  axis=1),
            onnx.helper.make_node("MatMul", [x, w], list(node.output), name=f"{node.name}/fp32_matmul")]


def _pool_from_past(feeds: dict, num_layers: int, past_lens: np.ndarray, block_size: int, seed: int):
    past0 = feeds["past_key_values.0.key"]
    batch, kvh, past, hd = past0.shape
    per_seq = -(-past // block_size)
    num_blocks = batch * per_seq + 3
    order = np.random.default_rng(seed).permutation(num_blocks)
    tables = order[: batch * per_seq].reshape(batch, per_seq)
    pool = np.zeros((num_layers, 2, kvh, num_blocks, block_size, hd), np.float32)
    for b in range(batch):
        n = int(past_lens[b])
        slots = np.arange(n)
        blocks, offsets = tables[b][slots // block_size], slots % block_size
        for layer in range(num_layers):
            for k, kind in enumerate(KINDS):
                pool[layer, k][:, blocks, offsets] = feeds[f"past_key_values.{layer}.{kind}"][b][:, past - n:]
    return pool, tables


def _pool_feeds(pool: np.ndarray, kv_dtype: str) -> dict[str, np.ndarray]:
    """The pool as the runtime would hold it (engines/ort/kv_pool.py): cast, or int8 values + scales."""
    scales = None
    if kv_dtype == "int8":
        pool, scales = quantize_rows(pool)
    else:
        pool = pool.astype(kv_dtype)
    feeds = {}
    for layer in range(pool.shape[0]):
        for k, kind in enumerate(KINDS):
            feeds[f"{kind}_cache.{layer}"] = pool[layer, k]
            if scales is not None:
                feeds[f"{kind}_scale.{layer}"] = scales[layer, k]
    return feeds


def _run_rows(session, feeds: dict, batch: int, kv_heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(logits, new_kv [2L,kvh,B,S,hd]) of the paged graph, one sequence per run: a chunk with a
    past is what a GroupQueryAttention core (passes/attention_gqa.py) takes only at batch 1."""
    per_row = [session.run(["logits", "new_kv"], {k: v if k.startswith(POOL_INPUTS) else v[b:b + 1]
                                                  for k, v in feeds.items()}) for b in range(batch)]
    new_kv = [new_kv_layer_major(r[1], kv_heads, head_dim) for r in per_row]
    return np.concatenate([r[0] for r in per_row]), np.concatenate(new_kv, axis=2)


def compare_paged(before: onnx.ModelProto, after: onnx.ModelProto, num_layers: int, block_size: int,
                  seed: int = 0, kv_dtype: str = "float32") -> tuple[float, float]:
    """(max abs error, relative error) over logits and new K/V; the past K/V reach the paged graph
    through a pool of kv_dtype (rounded there, as the runtime's pool rounds them)."""
    before, after = fp32_activations(before), fp32_activations(after)
    feeds = seeded_feeds(before, seed=seed)
    dense = _session(before)
    ref = dict(zip([o.name for o in dense.get_outputs()], dense.run(None, feeds)))
    del dense      # NOTE: before the paged session loads, so the weights are not held twice
    mask = feeds["attention_mask"]
    batch, seq = feeds["input_ids"].shape
    past = mask.shape[1] - seq
    past_lens = mask[:, :past].sum(1)     # left padding drops out: the pool holds only real tokens
    pool, tables = _pool_from_past(feeds, num_layers, past_lens, block_size, seed)
    paged_feeds = {"input_ids": feeds["input_ids"], "position_ids": feeds["position_ids"],
                   "past_lens": past_lens.astype(np.int64), "block_tables": tables.astype(np.int64),
                   "logits_index": np.tile(np.arange(seq), (batch, 1))}
    paged_feeds |= _pool_feeds(pool, kv_dtype)
    logits, new_kv = _run_rows(_session(after), paged_feeds, batch, *feeds["past_key_values.0.key"].shape[1::2])
    err = float(np.abs(logits - ref["logits"]).max())
    for layer in range(num_layers):
        for k, kind in enumerate(KINDS):
            mine = new_kv[2 * layer + k].transpose(1, 0, 2, 3)       # [B,kvh,S,hd]
            err = max(err, float(np.abs(mine - ref[f"present.{layer}.{kind}"][:, :, past:]).max()))
    return err, err / max(float(np.abs(ref["logits"]).max()), 1e-12)

