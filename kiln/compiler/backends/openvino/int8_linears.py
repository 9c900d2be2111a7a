"""The layers' linears of an openvino int8 build as kiln's own int8 operations (kiln/engines/openvino/native).

Each MatMul of a decoder layer on a constant f32 weight, and the LM head, becomes kiln.LinearI8 over
the weight's int8 codes per output channel (scale absmax / 127, as NNCF's int8_sym); Llama's gated
MLP input (silu(gate) * up over one normed input) becomes one kiln.GateUpI8, so the activation and the
product run inside the operation. The kernel quantizes each activation row with one scale, which alone
fails the build's check (outlier channels set the row's scale); SmoothQuant's per-channel factors,
from activation maxima over kiln/data/calibration.txt, move those channels' range into the weights.
The embedding table stays with NNCF (a tied head gets codes of its own). The graph is written to
model.xml with these operation types; compiling or importing it needs the library (the loader adds
it).
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from kiln.compiler.backends.openvino.q4_weights import LM_HEAD
from kiln.engines.openvino import native
from kiln.engines.openvino.native.stand_in import stand_in

LAYER_SCOPE = "/model/layers."
SMOOTHING = 0.5             # SmoothQuant's migration strength: its paper's default, and on SmolLM2 the
                            # check's top-1 0.932 against 0.879 without smoothing
COLUMN_BLOCK = 16           # the kernel's output columns per vector; N must be a multiple


def quantize_weight(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """weight [N, K] f32 -> (codes packed [N/16][ceil(K/4)][16][4] int8, scale [N] f32, comp [N] f32 =
    128 x each column's sum of codes: the kernel shifts activations by 128 into u8 and takes that off)."""
    scale = (np.abs(weight).max(axis=1) / 127.0).astype(np.float32)
    scale[scale == 0] = 1.0
    codes = np.clip(np.rint(weight / scale[:, None]), -127, 127).astype(np.int8)
    comp = (128.0 * codes.sum(axis=1, dtype=np.int64)).astype(np.float32)
    return pack_codes(codes), scale, comp


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """[N, K] int8 -> the kernel's layout, flat: 16 columns x 4 consecutive k per 64-byte vector."""
    n, k = codes.shape
    kp = -(-k // 4) * 4
    padded = np.zeros((n, kp), np.int8)
    padded[:, :k] = codes
    return np.ascontiguousarray(padded.reshape(n // COLUMN_BLOCK, COLUMN_BLOCK, kp // 4, 4).transpose(0, 2, 1, 3)).reshape(-1)


def _packed_output(node: ov.Node) -> ov.PartialShape:
    """x's shape with its last dimension the linear's N (its scale's length)."""
    shape = node.get_input_partial_shape(0)
    shape[shape.rank.get_length() - 1] = node.get_input_partial_shape(2)[0]
    return shape


LinearI8 = stand_in(native.LINEAR, _packed_output)
GateUpI8 = stand_in(native.GATE_UP, _packed_output)


def smoothing(x_absmax: np.ndarray, weights: list[np.ndarray]) -> np.ndarray:
    """SmoothQuant's factor per input channel, s = max|x|^a / max|W|^(1-a) (a = SMOOTHING), for the
    linears that read x: the kernel quantizes x / s per row and the weights hold W * s."""
    w = np.max([np.abs(wt).max(axis=0) for wt in weights], axis=0)
    s = np.maximum(x_absmax, 1e-5) ** SMOOTHING / np.maximum(w, 1e-5) ** (1 - SMOOTHING)
    return np.maximum(s, 1e-5).astype(np.float32)


def _weight_inputs(weight: np.ndarray, s: np.ndarray) -> list:
    """weight [N, K] and its input's smoothing -> the operation's (codes, scale, comp) constants."""
    return [ops.constant(a).output(0) for a in quantize_weight(weight * s[None, :])]


def _weight(matmul) -> np.ndarray:
    """A linear's weight as [N, K] (a layer's MatMul holds [K, N]; the tied LM head reads the [vocab,
    hidden] embedding table with transpose_b)."""
    data = matmul.input_value(1).get_node().get_data()
    return data if matmul.get_attributes()["transpose_b"] else data.T


def _is_layer_linear(op, lm_head: bool = False) -> bool:
    name = op.get_friendly_name()
    if op.get_type_name() != "MatMul" or not (name.startswith(LAYER_SCOPE) or (lm_head and name == LM_HEAD)):
        return False
    w = op.input_value(1).get_node()
    attrs = op.get_attributes()
    return (w.get_type_name() == "Constant" and w.get_output_element_type(0).get_type_name() == "f32"
            and len(w.shape) == 2 and not attrs["transpose_a"]
            and w.shape[0 if attrs["transpose_b"] else 1] % COLUMN_BLOCK == 0)


def _gated_pairs(model: ov.Model) -> list[tuple]:
    """(input, gate weight [N, K], up weight [N, K], the Multiply of silu(gate) and up) per layer, by
    kiln's exporter's names: gate and up as two MatMuls (openvino int8 builds keep them apart), or
    merged into gate_up_proj and split in halves."""
    by_name = {op.get_friendly_name(): op for op in model.get_ordered_ops()}
    pairs = []
    for name, op in by_name.items():
        if op.get_type_name() != "Multiply" or not name.endswith("/mlp/GateUp"):
            continue
        scope = name[: -len("GateUp")]
        silu = by_name.get(scope + "SiLU")
        if silu is None or silu.get_type_name() != "Multiply" or op.input_value(0).get_node() is not silu:
            continue
        gate, up = by_name.get(scope + "gate_proj/MatMul"), by_name.get(scope + "up_proj/MatMul")
        merged, split = by_name.get(scope + "gate_up_proj/MatMul"), by_name.get(scope + "gate_up_proj/Split")
        if gate is not None and up is not None and _is_layer_linear(gate) and _is_layer_linear(up) \
                and gate.input_value(0) == up.input_value(0) and op.input_value(1).get_node() is up:
            pairs.append((gate.input_value(0), _weight(gate), _weight(up), op))
        elif merged is not None and split is not None and _is_layer_linear(merged) and split.get_output_size() == 2 \
                and op.input_value(1) == split.output(1) and split.input_value(0).get_node() is merged:
            w = _weight(merged)
            half = w.shape[0] // 2
            if half % COLUMN_BLOCK == 0 and w.shape[0] == 2 * half:
                pairs.append((merged.input_value(0), w[:half], w[half:], op))
    return pairs


def _key(output) -> tuple[str, int]:
    """An output by its node's friendly name and port: the same output in a clone of the model."""
    return output.get_node().get_friendly_name(), output.get_index()


def input_absmax(model: ov.Model, inputs: list, token_ids: list[int]) -> dict[tuple[str, int], np.ndarray]:
    """{_key(x): max |x| per channel} for the linears' inputs `inputs`, over one f32 run of the
    standard graph (batch 1, no past) on token_ids. The maxima are reduced in the graph, so the run
    returns [K] per input, not [tokens, K]."""
    probe = model.clone()
    by_name = {op.get_friendly_name(): op for op in probe.get_ordered_ops()}
    keys = list(dict.fromkeys(_key(x) for x in inputs))
    for name, port in keys:
        x = by_name[name].output(port)
        axes = ops.constant(np.arange(x.get_partial_shape().rank.get_length() - 1, dtype=np.int64))
        probe.add_outputs(ops.reduce_max(ops.abs(x), axes).output(0))
    compiled = ov.Core().compile_model(probe, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    ids = np.asarray(token_ids, np.int64)[None]
    results = compiled(_standard_feeds(compiled, ids))
    first = len(model.get_results())
    return {key: results[compiled.outputs[first + i]] for i, key in enumerate(keys)}


def _standard_feeds(compiled: ov.CompiledModel, ids: np.ndarray) -> dict:
    """Feeds of kiln's standard decoder graph for one sequence with no past: empty caches."""
    by_input = {"input_ids": ids, "position_ids": np.arange(ids.shape[1], dtype=np.int64)[None],
                "attention_mask": np.ones_like(ids)}
    feeds = {}
    for port in compiled.inputs:
        name = port.get_any_name()
        if name in by_input:
            feeds[name] = by_input[name]
        else:       # past_key_values.*: [batch 1, heads, 0 past tokens, head_dim]
            dims = [d.get_length() if d.is_static else 0 for d in port.get_partial_shape()]
            feeds[name] = np.zeros([1, *dims[1:]], np.float32)
    return feeds


def use_kiln_linears(model: ov.Model, calibration_ids: list[int]) -> tuple[ov.Model, dict]:
    """The model with its layers' linears (and the LM head) on kiln's operations (a new Model over the
    same nodes), smoothed by activation maxima over calibration_ids, and the record of what changed.
    NOTE: save it without fp16 compression: comp exceeds f16's range."""
    pairs = _gated_pairs(model)
    linears = [op for op in model.get_ordered_ops() if _is_layer_linear(op, lm_head=True)]
    stats = input_absmax(model, [x for x, *_ in pairs] + [op.input_value(0) for op in linears], calibration_ids)
    for x, gate, up, product in pairs:
        s = smoothing(stats[_key(x)], [gate, up])
        node = GateUpI8([x, *_weight_inputs(gate, s), *_weight_inputs(up, s), ops.constant(1 / s).output(0)])
        node.set_friendly_name(product.get_friendly_name())
        product.output(0).replace(node.output(0))
    # NOTE: a new Model drops the gate/up MatMuls the fused nodes replaced (they no longer reach a result).
    model = ov.Model(model.get_results(), model.get_parameters(), model.get_friendly_name())
    linears = [op for op in model.get_ordered_ops() if _is_layer_linear(op, lm_head=True)]
    for op in linears:
        w = _weight(op)
        s = smoothing(stats[_key(op.input_value(0))], [w])
        node = LinearI8([op.input_value(0), *_weight_inputs(w, s), ops.constant(1 / s).output(0)])
        node.set_friendly_name(op.get_friendly_name())
        op.output(0).replace(node.output(0))
    model = ov.Model(model.get_results(), model.get_parameters(), model.get_friendly_name())
    return model, {"gated_pairs": len(pairs), "linears": len(linears), "smoothing": SMOOTHING,
                   "calibration_tokens": len(calibration_ids)}
