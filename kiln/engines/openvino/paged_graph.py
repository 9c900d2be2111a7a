"""Rewrite kiln's standard decoder (read by OpenVINO's ONNX frontend) into a packed, paged model.

The standard graph takes dense [B,S] tokens and dense past K/V. The rewritten model takes T packed
tokens of B sequences and OpenVINO's CPU paged-attention operation reads and writes the KV cache
blocks itself (vLLM's interface):

    input_ids [T] i64, position_ids [T] i64 ─ Unsqueeze(0) ─▶ the old [1,T] token inputs
    per layer:  q (after rope) ─ Reshape [T, H·hd] ──┐
                k (after rope) ─ Reshape [T, kvh·hd] ─┤
                v heads        ─ Reshape [T, kvh·hd] ─┼─ PagedAttentionExtension ─ Unsqueeze(0) ─▶ out_merge's consumers
                key_cache.i, value_cache.i ───────────┤   (GQA, causal within a chunk, writes the new K/V)
                past_lens, subsequence_begins, block_indices, block_indices_begins, max_context_len
    /model/final_hidden [1,T,hidden] ─ Gather(logits_indices, axis 1) ─▶ final norm ─ LM head ─ Squeeze ─▶ logits [N,V]

The dense mask, the past inputs and the present outputs fall away (nothing reaches them any more).
Each layer's operation takes that layer's sliding window (0: full attention; kiln's rule "a key is
visible iff query_pos - key_pos < window" is the operation's, tests/engines/openvino/test_openvino_windows.py)
and the scale head_dim**-0.5: the exporter already multiplied q by query_scale * head_dim**0.5
(Gemma's query_pre_attn_scalar), before the q cut. Score soft-capping (Gemma 2) has no input in the
operation, so such a model is refused. longrope's short/long switch, which the dense graph takes
from the max position of each sequence's call, takes it here from each token's own sequence (the
packed rows hold several sequences).

At build time kiln.compiler.backends.openvino.cuts finds the cut tensors by the node names kiln's exporter keeps stable
(kiln/compiler/export/decoder_graph.py) and gives them canonical names that survive OpenVINO's IR.
The IR reader does not know the (experimental) paged-attention operation, and the CPU plugin needs
the head geometry in its rt_info, which neither the IR nor the plugin's exported blob keeps:
paged_attention_extension() teaches a Core both, so the build's compiled blob imports at load
(kiln.engines.openvino.loader), and the rewrite runs at load only when it cannot.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
from openvino import opset13 as ops
from openvino._pyopenvino.op import _PagedAttentionExtension

from kiln.contract.model_spec import ModelSpec
from kiln.engines.openvino import kiln_attention

I32, I64 = ov.Type.i32, ov.Type.i64

# The paged interface every layer shares: name -> (element type, shape). Its order is the
# order of the compiled model's inputs after the token inputs.
SEQUENCE_INPUTS = {
    "past_lens": (I32, [-1]),               # [B] tokens already cached per sequence
    "subsequence_begins": (I32, [-1]),      # [B+1] where each sequence's new tokens start in T
    "block_indices": (I32, [-1]),           # every sequence's block ids, concatenated
    "block_indices_begins": (I32, [-1]),    # [B+1] where each sequence's block ids start
    "max_context_len": (I32, []),           # max over sequences of past + new
}
LOGITS_INDICES = "logits_indices"           # [N] i64 rows of T whose logits are returned


CUTS = ("q", "k", "v", "out")
FINAL = "kiln.final_hidden"
# The rotary scopes whose longrope switch reads the max position of a call (decoder_graph._rotary_tables).
ROTARY_SCOPES = ("rotary", "rotary_local")


def cut_name(layer: int, cut: str) -> str:
    return f"kiln.layers.{layer}.attn.{cut}"


def last_position_name(scope: str) -> str:
    return f"kiln.{scope}.last_position"


def unsupported(spec: ModelSpec) -> str:
    """What of `spec` the operation cannot compute ("" when nothing)."""
    if spec.attn_softcap:
        # NOTE: PagedAttentionExtension (OpenVINO 2026.4) has no soft-capping input or attribute and
        # the CPU kernel applies none: cap * tanh(scores / cap) would be skipped, not approximated.
        return "attention soft-capping (OpenVINO's paged attention has no soft-capping input)"
    return ""


def paged_model(ov_model: ov.Model, spec: ModelSpec, attention: str = "") -> ov.Model:
    """ov_model: the standard graph with its cuts marked. Returns the packed, paged model, its
    attention the plugin's operation ("") or kiln's (a kiln_attention format's name)."""
    fmt = kiln_attention.cache_format(attention) if attention else None
    why_not = unsupported(spec) if fmt is None else kiln_attention.supports(spec)
    if why_not:
        raise ValueError(f"the openvino backend does not support {why_not}")
    outputs = outputs_by_tensor_name(ov_model)
    missing = [n for n in [FINAL, cut_name(spec.num_layers - 1, "out")] if n not in outputs]
    if missing:
        raise ValueError(f"the OpenVINO model has no tensor {missing[0]!r}: not built by kiln's openvino backend")
    params = _token_inputs(ov_model)
    seq = {name: _parameter(name, t, shape) for name, (t, shape) in SEQUENCE_INPUTS.items()}
    caches = []
    for i in range(spec.num_layers):
        cut = {c: outputs[cut_name(i, c)] for c in CUTS}
        key_cache, value_cache = (_cache_parameter(f"{kind}_cache.{i}", spec, fmt) for kind in ("key", "value"))
        caches += [key_cache, value_cache]
        attn = _paged_attention(spec, cut, key_cache, value_cache, seq, spec.layer_window(i), fmt)
        cut["out"].replace(ops.unsqueeze(attn, _i64([0])).output(0))
    _last_positions_per_sequence(outputs, params[1], seq["subsequence_begins"])
    logits_indices = _parameter(LOGITS_INDICES, I64, [-1])
    logits = _logits_for_rows(ov_model, outputs[FINAL], logits_indices)
    return ov.Model([logits], [*params, *seq.values(), *caches, logits_indices], "kiln-paged")


def outputs_by_tensor_name(ov_model: ov.Model) -> dict[str, ov.Output]:
    return {name: out for op in ov_model.get_ops() for out in op.outputs() for name in out.get_names()}


def _token_inputs(ov_model: ov.Model) -> list:
    """New packed [T] token inputs, feeding the graph's [B,S] ones as B=1."""
    new = []
    for name in ("input_ids", "position_ids"):
        old = next(p for p in ov_model.get_parameters() if p.get_friendly_name() == name)
        packed = _parameter(name, I64, [-1])
        old.output(0).replace(ops.unsqueeze(packed, _i64([0])).output(0))
        new.append(packed)
    return new


def _last_positions_per_sequence(outputs: dict, position_ids, begins) -> None:
    """longrope: each packed token gets the last position of its own sequence, [1,T,1] f32, where
    the dense graph took the max over the call's row ([B,1,1]: here B=1 row holds every sequence)."""
    marked = [outputs[last_position_name(s)] for s in ROTARY_SCOPES if last_position_name(s) in outputs]
    if not marked:
        return
    ends = ops.slice(begins, _i64([1]), _i64([np.iinfo(np.int64).max]), _i64([1]))        # [B]
    last = ops.gather(position_ids, ops.convert(ops.subtract(ends, _i32(1)), I64), _i64(0))  # [B]
    token = ops.range(_i32(0), ops.squeeze(ops.shape_of(position_ids, I32), _i64([0])), _i32(1), I32)
    # a token's sequence: how many sequences end at or before it
    seq_of_token = ops.reduce_sum(ops.convert(ops.greater_equal(ops.unsqueeze(token, _i64([1])),
                                                                ops.unsqueeze(ends, _i64([0]))), I32),
                                  _i64([1]), keep_dims=False)
    per_token = ops.convert(ops.gather(last, seq_of_token, _i64(0)), ov.Type.f32)
    per_token = ops.reshape(per_token, _i64([1, -1, 1]), special_zero=False)
    for out in marked:
        out.replace(per_token.output(0))


def _cache_parameter(name: str, spec: ModelSpec, fmt):
    if fmt is not None:
        return kiln_attention.cache_parameter(name, spec, fmt)
    return _parameter(name, ov.Type.dynamic, ov.PartialShape.dynamic(4))      # the plugin decides


def _paged_attention(spec: ModelSpec, cut: dict, key_cache, value_cache, seq: dict, window: int, fmt=None):
    hd, heads, kvh = spec.head_dim, spec.num_heads, spec.num_kv_heads
    q = ops.reshape(cut["q"], _i64([-1, heads * hd]), special_zero=False)
    k = ops.reshape(cut["k"], _i64([-1, kvh * hd]), special_zero=False)
    v = ops.reshape(cut["v"], _i64([-1, kvh * hd]), special_zero=False)
    if fmt is not None:
        # NOTE: the same scale and window rule as the plugin's operation (see _attention_inputs)
        inputs = kiln_attention.attention_inputs(q, k, v, key_cache, value_cache, seq, spec.head_dim ** -0.5, window,
                                                 spec.attn_softcap or 0.0)
        return kiln_attention.operation(fmt, inputs).output(0)
    return paged_attention_op(spec, _attention_inputs(spec, q, k, v, key_cache, value_cache, seq, window)).output(0)


def _attention_inputs(spec: ModelSpec, q, k, v, key_cache, value_cache, seq: dict, window: int) -> list:
    # NOTE: q arrives scaled by query_scale * head_dim**0.5 (decoder_graph), so the operation's own
    # scale stays head_dim**-0.5 for every family. Its sliding_window W keeps a key iff
    # query_pos - key_pos < W, kiln's rule (0: full attention).
    inputs = [q, k, v, key_cache, value_cache, seq["past_lens"], seq["subsequence_begins"],
              seq["block_indices"], seq["block_indices_begins"], _f32(spec.head_dim ** -0.5),
              _i32(window), _f32([]),                                      # sliding window, no alibi
              seq["max_context_len"], *_unused_features()]
    return [x.output(0) if hasattr(x, "output") else x for x in inputs]


def paged_attention_op(spec: ModelSpec, inputs: list) -> _PagedAttentionExtension:
    pa = _PagedAttentionExtension(inputs)
    # NOTE: the CPU plugin reads the head geometry from rt_info (the cache shapes are dynamic).
    for key, value in (("num_k_heads", spec.num_kv_heads), ("k_head_size", spec.head_dim),
                       ("num_v_heads", spec.num_kv_heads), ("v_head_size", spec.head_dim)):
        pa.get_rt_info()[key] = value
    return pa


def paged_attention_extension(spec: ModelSpec) -> ov.OpExtension:
    """Lets a Core read PagedAttentionExtension from an IR or an exported compiled blob, with the
    rt_info the CPU plugin requires (every kiln layer has the spec's head geometry).

    OpExtension calls the class for each node, then sets its inputs and reads its attributes; the
    class hands back a real PagedAttentionExtension (built on placeholder inputs the reader then
    replaces), so the plugin gets its own operation, not a Python one."""
    hd, heads, kvh = spec.head_dim, spec.num_heads, spec.num_kv_heads
    seq = {name: _parameter(name, t, shape) for name, (t, shape) in SEQUENCE_INPUTS.items()}
    q, k, v = (_parameter(n, ov.Type.f32, [-1, h * hd]) for n, h in (("q", heads), ("k", kvh), ("v", kvh)))
    caches = [_parameter(n, ov.Type.dynamic, ov.PartialShape.dynamic(4)) for n in ("key_cache", "value_cache")]
    placeholder = _attention_inputs(spec, q, k, v, *caches, seq, 0)

    class PagedAttentionReader(ov.Op):
        def __new__(cls, *args, **kwargs):
            return paged_attention_op(spec, placeholder)

        @staticmethod
        def get_type_info():
            return ov.DiscreteTypeInfo("PagedAttentionExtension", "extension")

    return ov.OpExtension(PagedAttentionReader)


def _unused_features() -> list:
    """Inputs 13..27 of PagedAttentionExtension (OpenVINO 2026.4), all switched off: score
    aggregation, cache rotation, XAttention, sinks, adaptive R-KV, token types, qq bias."""
    return [_i32([]), _i32([]), _i32([]), _f32([]),                 # score window, rotation x3
            _f32([]), _i32(64), _i32(8),                            # xattention threshold, block, stride
            _f32([]),                                               # sinks
            _i32(0), _i32([]), _i32([]), _i32([]),                  # adaptive R-KV
            _i32([]), ops.constant(np.zeros(0, np.uint8)), _i32([])]  # token types, qq bias, begins


def _logits_for_rows(ov_model: ov.Model, final_hidden: ov.Output, rows) -> ov.Output:
    """Only the rows asked for reach the final norm and the LM head."""
    consumers = list(final_hidden.get_target_inputs())
    picked = ops.gather(final_hidden, rows, _i64(1))
    for consumer in consumers:
        consumer.replace_source_output(picked.output(0))
    old = next(r for r in ov_model.get_results() if "logits" in r.output(0).get_names()
               or r.get_friendly_name() == "logits")
    logits = ops.squeeze(old.input_value(0), _i64([0]))
    logits.output(0).set_names({"logits"})
    return logits.output(0)


def _parameter(name: str, element_type, shape):
    p = ops.parameter(shape if isinstance(shape, ov.PartialShape) else ov.PartialShape(shape), element_type, name)
    p.output(0).set_names({name})
    return p


def _i64(v):
    return ops.constant(np.asarray(v, np.int64))


def _i32(v):
    return ops.constant(np.asarray(v, np.int32))


def _f32(v):
    return ops.constant(np.asarray(v, np.float32))
