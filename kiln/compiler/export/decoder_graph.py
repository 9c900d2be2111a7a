"""Emit the standard decoder graph: HF semantics, explicit dense KV inputs and outputs.

Inputs:  input_ids [B,S] i64, position_ids [B,S] i64, attention_mask [B,T] i64 (T = P + S),
         past_key_values.{i}.key/.value [B, kv_heads, P, head_dim]
Outputs: logits [B,S,V], present.{i}.key/.value [B, kv_heads, T, head_dim]

Inside, attention works kv-head-major ([kv_heads, B, ...]) so that grouped query heads share
one K/V without a repeat copy, and so the kv_io pass can swap the dense past for a gather from
a head-major paged pool. The mask is expressed through two tensors the kv_io pass rewrites:
key_positions [B,T] (absolute position of each key, or FAR for a padded one) and
query_positions [B,S]; a query attends to a key iff key_position <= query_position, and, with a
sliding window W, also query_position - key_position < W (HF's sliding_window_overlay).
Variants (ModelSpec): rope scaling types (export.rope), partial rotary, per-head q/k RMSNorm, and
Gemma's: (1 + w) norms, scaled embeddings, GeGLU, sandwich norms, tanh soft-capping, sliding and
full layers interleaved with their own rope bases.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from kiln.compiler.export.graph_builder import FLOAT, INT64, GraphBuilder, release_freed_memory
from kiln.compiler.export.rope import rotary_for
from kiln.contract.model_spec import ModelSpec

# key position of a padded key: never <= any query position. Within int32: OpenVINO's CPU plugin
# computes int64 tensors as int32, where 1 << 40 wraps to 0 (a padded key made visible).
FAR = 1 << 30
MASKED = -1e30         # additive bias of a masked score; finite, so an all-masked row gives no NaN

# Deterministic names the passes look for.
KEY_POSITIONS = "/model/attn_mask/key_positions"
QUERY_POSITIONS = "/model/attn_mask/query_positions"
FINAL_HIDDEN = "/model/final_hidden"


def past_transpose_name(layer: int, kind: str) -> str:
    return f"/model/layers.{layer}/attn/past_{kind}_kv_major"


def new_kv_name(layer: int, kind: str) -> str:
    return f"/model/layers.{layer}/attn/new_{kind}_kv_major"


def build_decoder(spec: ModelSpec, weights, weights_dir: Path | None = None):
    """The standard graph; with weights_dir, its large weights are external data there (a graph of
    any size, and passes that copy megabytes, not the model: export.external)."""
    g = GraphBuilder(f"kiln-{spec.family}", weights_dir)
    w = _Weights(g, weights)
    ids = g.input("input_ids", INT64, ["batch", "seq"])
    pos = g.input("position_ids", INT64, ["batch", "seq"])
    mask = g.input("attention_mask", INT64, ["batch", "total"])
    with g.scope("model"):
        x = g.op("Gather", [w.add("model.embed_tokens.weight"), ids], "embed_tokens")
        if spec.embed_scale != 1.0:
            x = g.op("Mul", [x, g.const(spec.embed_scale, np.float32)], "embed_scale")
        ropes = _layer_ropes(g, spec, pos)
        biases = _attention_biases(g, spec, mask, ids)
        for i in range(spec.num_layers):
            with g.scope(f"layers.{i}"):
                x = _decoder_layer(g, spec, w, i, x, *ropes[i], biases[spec.layer_window(i)])
        x = g.op("Identity", [x], "final_hidden")
        with g.scope("final_norm"):
            x = rms_norm(g, spec, x, w.norm(spec, "model.norm.weight"))
        logits = g.op("MatMul", [x, w.lm_head(spec)], "lm_head")
        if spec.final_softcap:
            with g.scope("logit_softcap"):
                logits = softcap(g, logits, spec.final_softcap)
    g.output(logits, "logits", FLOAT, ["batch", "seq", spec.vocab_size])
    model = g.model()
    release_freed_memory()
    return model


class _Weights:
    """Adds HF weights as initializers, linears transposed to ONNX's [in, out]."""

    def __init__(self, g: GraphBuilder, weights: dict[str, np.ndarray]):
        self.g, self.weights = g, weights

    def add(self, name: str) -> str:
        return self.g.weight(name, self.weights[name])

    def norm(self, spec: ModelSpec, name: str) -> str:
        if not spec.norm_offset:
            return self.add(name)
        # Gemma: (1 + w) in fp32, as HF computes it, folded into the stored weight.
        return self.g.weight(name, (self.weights[name] + np.float32(spec.norm_offset)).astype(np.float32))

    def linear(self, name: str) -> str:
        return self.g.weight(name, self.weights[name].T)

    def lm_head(self, spec: ModelSpec) -> str:
        if spec.tie_word_embeddings:
            return self.g.weight("lm_head.weight", self.weights["model.embed_tokens.weight"].T)
        return self.linear("lm_head.weight")


# rms_norm: x ─ Pow(2) ─ ReduceMean ─ Add(eps) ─ Sqrt ─ Reciprocal ─┐
#           └─────────────────────────────────────────────────── Mul ─ Mul(weight)
def rms_norm(g: GraphBuilder, spec: ModelSpec, x: str, weight: str) -> str:
    sq = g.op("Pow", [x, g.const(2.0, np.float32)], "Pow")
    var = g.op("ReduceMean", [sq, g.const([-1])], "ReduceMean", keepdims=1)
    var = g.op("Add", [var, g.const(spec.rms_norm_eps, np.float32)], "AddEps")
    inv = g.op("Reciprocal", [g.op("Sqrt", [var], "Sqrt")], "Reciprocal")
    return g.op("Mul", [g.op("Mul", [x, inv], "Normalize"), weight], "Scale")


# rotary tables: position_ids ─ Cast ─ Unsqueeze ─ Mul(inv_freq) ─ Concat(f, f) ─ Cos / Sin ─ Unsqueeze(2)
# longrope:      freqs = Where(max position of the sequence >= original_max, p·long_inv_freq, p·inv_freq)
# yarn/longrope: cos, sin ─ Mul(attention_scaling)   (HF scales both; the fused rotary then does not match)
def _rotary_tables(g: GraphBuilder, spec: ModelSpec, pos: str, scope: str = "rotary") -> tuple[str, str]:
    rot = rotary_for(spec)
    with g.scope(scope):
        p = g.op("Unsqueeze", [g.op("Cast", [pos], "Cast", to=FLOAT), g.const([-1])], "Unsqueeze")
        freqs = g.op("Mul", [p, g.weight(f"/model/{scope}/inv_freq", rot.inv_freq)], "Freqs")
        if rot.long_inv_freq is not None:
            long = g.op("Mul", [p, g.weight(f"/model/{scope}/long_inv_freq", rot.long_inv_freq)], "LongFreqs")
            # As HF: a sequence's call takes the long factors once its last position passes the
            # original context (HF decides per call over the batch; kiln per sequence, batch-invariant).
            last = g.op("ReduceMax", [p, g.const([1])], "LastPosition", keepdims=1)         # [B,1,1]
            past_original = g.op("GreaterOrEqual", [last, g.const(float(rot.original_max), np.float32)], "IsLong")
            freqs = g.op("Where", [past_original, long, freqs], "PickFreqs")
        emb = g.op("Concat", [freqs, freqs], "Concat", axis=-1)
        cos, sin = g.op("Cos", [emb], "Cos"), g.op("Sin", [emb], "Sin")
        if rot.attention_scaling != 1.0:
            scale = g.const(rot.attention_scaling, np.float32)
            cos, sin = g.op("Mul", [cos, scale], "ScaleCos"), g.op("Mul", [sin, scale], "ScaleSin")
        cos = g.op("Unsqueeze", [cos, g.const([2])], "cos")
        sin = g.op("Unsqueeze", [sin, g.const([2])], "sin")
    return cos, sin


def _layer_ropes(g: GraphBuilder, spec: ModelSpec, pos: str) -> list[tuple[str, str]]:
    """(cos, sin) per layer: Gemma 3's sliding layers rotate with their own (default) rope base."""
    tables = _rotary_tables(g, spec, pos)
    if not spec.local_rope_theta:
        return [tables] * spec.num_layers
    local_spec = replace(spec, rope_type="default", rope_scaling="", rope_theta=spec.local_rope_theta)
    local = _rotary_tables(g, local_spec, pos, "rotary_local")
    return [local if spec.layer_window(i) else tables for i in range(spec.num_layers)]


# partial rotary (Phi-3, rotary_dim < head_dim): rope(x[..., :rotary_dim]) ─ Concat ─ x[..., rotary_dim:]
def apply_rope(g: GraphBuilder, spec: ModelSpec, x: str, cos: str, sin: str) -> str:
    dim = spec.rotary_dim
    if dim == spec.head_dim:
        return _rotate(g, x, dim, cos, sin)
    rotary = g.op("Slice", [x, g.const([0]), g.const([dim]), g.const([-1])], "RotaryPart")
    rest = g.op("Slice", [x, g.const([dim]), g.const([spec.head_dim]), g.const([-1])], "PassPart")
    return g.op("Concat", [_rotate(g, rotary, dim, cos, sin), rest], "PartialRotary", axis=-1)


# rope(x): x ─ Slice[:h] ─────────┐
#          └ Slice[h:] ─ Neg ─ Concat(-x2, x1) ─ Mul(sin) ─ Add ─ out
#          └────────────────────── Mul(cos) ──────────────┘
def _rotate(g: GraphBuilder, x: str, dim: int, cos: str, sin: str) -> str:
    half = dim // 2
    x1 = g.op("Slice", [x, g.const([0]), g.const([half]), g.const([-1])], "SliceLow")
    x2 = g.op("Slice", [x, g.const([half]), g.const([dim]), g.const([-1])], "SliceHigh")
    rot = g.op("Concat", [g.op("Neg", [x2], "Neg"), x1], "RotateHalf", axis=-1)
    return g.op("Add", [g.op("Mul", [x, cos], "MulCos"), g.op("Mul", [rot, sin], "MulSin")], "Add")


def _attention_biases(g: GraphBuilder, spec: ModelSpec, mask: str, ids: str) -> dict[int, str]:
    """window -> [1,B,1,S,T] additive bias (0: full attention); causal by position, padded keys
    masked, and with a window, keys it leaves behind masked."""
    with g.scope("attn_mask"):
        total = g.op("Squeeze", [g.op("Shape", [mask], "Total", start=1, end=2)], "TotalScalar")
        seq = g.op("Squeeze", [g.op("Shape", [ids], "Seq", start=1, end=2)], "SeqScalar")
        key_index = g.op("Range", [g.const(0), total, g.const(1)], "KeyIndex")
        is_key = g.op("Cast", [mask], "IsKey", to=9)  # BOOL
        kp = g.op("Where", [is_key, key_index, g.const(FAR)], "key_positions")
        past = g.op("Sub", [total, seq], "PastLen")
        qp = g.op("Add", [g.op("Range", [g.const(0), seq, g.const(1)], "QueryIndex"), past], "QueryPos")
        qp = g.op("Unsqueeze", [qp, g.const([0])], "query_positions")
        key_col = g.op("Unsqueeze", [kp, g.const([1])], "KeyCol")
        query_row = g.op("Unsqueeze", [qp, g.const([2])], "QueryRow")
        allowed = g.op("LessOrEqual", [key_col, query_row], "Allowed")
        return {window: _bias(g, allowed, key_col, query_row, window)
                for window in sorted({spec.layer_window(i) for i in range(spec.num_layers)})}


def _bias(g: GraphBuilder, allowed: str, key_col: str, query_row: str, window: int) -> str:
    if window:
        oldest = g.op("Sub", [query_row, g.const(window)], "WindowStart")
        allowed = g.op("And", [allowed, g.op("Greater", [key_col, oldest], "InWindow")], "AllowedInWindow")
    bias = g.op("Where", [allowed, g.const(0.0, np.float32), g.const(MASKED, np.float32)],
                "WindowBias" if window else "Bias")
    return g.op("Unsqueeze", [bias, g.const([0, 2])], "window_bias" if window else "bias")


# tanh soft-capping (Gemma 2): x ─ Div(cap) ─ Tanh ─ Mul(cap)
def softcap(g: GraphBuilder, x: str, cap: float) -> str:
    c = g.const(cap, np.float32)
    return g.op("Mul", [g.op("Tanh", [g.op("Div", [x, c], "Div")], "Tanh"), c], "Cap")


# Llama:  x + attn(norm(x)), then + mlp(norm(.))
# Gemma:  x + out_norm(attn(norm(x))), then + out_norm(mlp(norm(.)))   (sandwich norms; HF's
#         post_attention_layernorm is the attention's out norm there, pre_feedforward_layernorm the MLP's in norm)
def _decoder_layer(g, spec, w, i, x, cos, sin, bias) -> str:
    p = f"model.layers.{i}."
    with g.scope("input_norm"):
        h = rms_norm(g, spec, x, w.norm(spec, p + "input_layernorm.weight"))
    with g.scope("attn"):
        a = _attention(g, spec, w, i, h, cos, sin, bias)
    mlp_norm = "post_attention_layernorm.weight"
    if spec.sandwich_norms:
        with g.scope("attn_out_norm"):
            a = rms_norm(g, spec, a, w.norm(spec, p + "post_attention_layernorm.weight"))
        mlp_norm = "pre_feedforward_layernorm.weight"
    with g.scope("attn"):
        x = g.op("Add", [x, a], "residual")
    with g.scope("post_attn_norm"):
        h = rms_norm(g, spec, x, w.norm(spec, p + mlp_norm))
    with g.scope("mlp"):
        m = _mlp(g, spec, w, p, h)
    if spec.sandwich_norms:
        with g.scope("mlp_out_norm"):
            m = rms_norm(g, spec, m, w.norm(spec, p + "post_feedforward_layernorm.weight"))
    with g.scope("mlp"):
        return g.op("Add", [x, m], "residual")


def _projection(g, w, prefix: str, name: str, h: str, bias: bool) -> str:
    with g.scope(name):
        y = g.op("MatMul", [h, w.linear(prefix + name + ".weight")], "MatMul")
        return g.op("Add", [y, w.add(prefix + name + ".bias")], "Bias") if bias else y


def _attention(g, spec, w, i, h, cos, sin, bias) -> str:
    p = f"model.layers.{i}.self_attn."
    kvh, nrep, hd = spec.num_kv_heads, spec.num_queries_per_kv, spec.head_dim
    q, k, v = (_projection(g, w, p, n, h, spec.attention_bias) for n in ("q_proj", "k_proj", "v_proj"))
    if spec.qk_norm:
        q, k = _head_norm(g, spec, w, p + "q_norm", q), _head_norm(g, spec, w, p + "k_norm", k)
    with g.scope("q_rotary"):
        q = apply_rope(g, spec, g.op("Reshape", [q, g.const([0, 0, spec.num_heads, hd])], "Heads"), cos, sin)
    with g.scope("k_rotary"):
        k = apply_rope(g, spec, g.op("Reshape", [k, g.const([0, 0, kvh, hd])], "Heads"), cos, sin)
    if spec.query_scale != hd ** -0.5:
        # NOTE: the attention core always scales by head_dim^-1/2, so a backend that swaps the core
        # for a native kernel (OpenVINO's paged attention) needs no model-specific scale.
        q = g.op("Mul", [q, g.const(spec.query_scale * hd ** 0.5, np.float32)], "q_scale")
    v = g.op("Reshape", [v, g.const([0, 0, kvh, hd])], "v_heads")
    keys = _cache_io(g, spec, i, "key", g.op("Transpose", [k], "new_key_kv_major", perm=[2, 0, 1, 3]))
    values = _cache_io(g, spec, i, "value", g.op("Transpose", [v], "new_value_kv_major", perm=[2, 0, 1, 3]))
    q = g.op("Transpose", [g.op("Reshape", [q, g.const([0, 0, kvh, nrep, hd])], "q_groups")],
             "q_kv_major", perm=[2, 0, 3, 1, 4])                          # [kvh,B,nrep,S,hd]
    out = _scaled_dot_product(g, spec, q, keys, values, bias)               # [kvh,B,nrep,S,hd]
    out = g.op("Transpose", [out], "out_token_major", perm=[1, 3, 0, 2, 4])
    out = g.op("Reshape", [out, g.const([0, 0, spec.num_heads * hd])], "out_merge")
    with g.scope("o_proj"):
        return g.op("MatMul", [out, w.linear(p + "o_proj.weight")], "MatMul")


# Qwen3: flat [B,S,heads*hd] ─ Reshape(heads) ─ rms_norm(head_dim) ─ Reshape(flat)
# NOTE: back to flat so the rotary scope sees the same Reshape(Heads) input as everywhere (FuseRotary).
def _head_norm(g, spec, w, name: str, x: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    with g.scope(leaf):
        heads = g.op("Reshape", [x, g.const([0, 0, -1, spec.head_dim])], "Heads")
        normed = rms_norm(g, spec, heads, w.norm(spec, name + ".weight"))
        return g.op("Reshape", [normed, g.const([0, 0, -1])], "Flat")


def _cache_io(g, spec, i, kind: str, new: str) -> str:
    """Dense past [B,kvh,P,hd] in, present [B,kvh,T,hd] out; returns all keys [kvh,B,T,hd]."""
    past = g.input(f"past_key_values.{i}.{kind}", FLOAT, ["batch", spec.num_kv_heads, "past", spec.head_dim])
    past = g.op("Transpose", [past], f"past_{kind}_kv_major", perm=[1, 0, 2, 3])
    full = g.op("Concat", [past, new], f"all_{kind}s", axis=2)
    present = g.op("Transpose", [full], f"present_{kind}", perm=[1, 0, 2, 3])
    g.output(present, f"present.{i}.{kind}", FLOAT, ["batch", spec.num_kv_heads, "total", spec.head_dim])
    return full


# scores = q·Kᵀ·scale + bias ─ Softmax ─ ·V      (K, V broadcast over the nrep query heads of a group)
def _scaled_dot_product(g, spec, q, keys, values, bias) -> str:
    k = g.op("Unsqueeze", [keys, g.const([2])], "k_group")
    v = g.op("Unsqueeze", [values, g.const([2])], "v_group")
    kt = g.op("Transpose", [k], "k_transposed", perm=[0, 1, 2, 4, 3])
    scores = g.op("MatMul", [q, kt], "QK")
    scores = g.op("Mul", [scores, g.const(spec.head_dim ** -0.5, np.float32)], "Scale")
    if spec.attn_softcap:
        scores = softcap(g, scores, spec.attn_softcap)
    probs = g.op("Softmax", [g.op("Add", [scores, bias], "Mask")], "Softmax", axis=-1)
    return g.op("MatMul", [probs, v], "PV")


def _mlp(g, spec, w, p: str, h: str) -> str:
    gate = _projection(g, w, p + "mlp.", "gate_proj", h, False)
    up = _projection(g, w, p + "mlp.", "up_proj", h, False)
    if spec.activation == "gelu_tanh":
        act = g.op("Gelu", [gate], "GELU", approximate="tanh")
    else:
        act = g.op("Mul", [gate, g.op("Sigmoid", [gate], "Sigmoid")], "SiLU")
    return _projection(g, w, p + "mlp.", "down_proj", g.op("Mul", [act, up], "GateUp"), False)
