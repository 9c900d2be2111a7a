"""Numeric checks of a pass: run the graph before and after on seeded inputs through ONNX Runtime.

Works on the standard decoder interface (input_ids, position_ids, attention_mask, past KV).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

from kiln.engines.ort.session import cpu_session
from kiln.compiler.export.external import session_config


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opts.log_severity_level = 3
    for key, value in session_config(model).items():     # where external weights live
        opts.add_session_config_entry(key, value)
    return cpu_session(model.SerializeToString(), opts)


def _dim(model: onnx.ModelProto, input_name: str, axis: int) -> int | None:
    for i in model.graph.input:
        if i.name == input_name:
            d = i.type.tensor_type.shape.dim[axis]
            return d.dim_value or None
    return None


def seeded_feeds(model: onnx.ModelProto, batch: int = 2, seq: int = 5, past: int = 6, seed: int = 0) -> dict:
    """Inputs for a standard decoder graph: random ids, one left-padded row, and a past KV that
    the model itself computed for a random prefix (random KV values would be far outside what
    real activations look like, and make quantization errors look arbitrarily large)."""
    rng = np.random.default_rng(seed)
    vocab = next(o for o in model.graph.output if o.name == "logits").type.tensor_type.shape.dim[-1].dim_value
    mask = np.ones((batch, past + seq), np.int64)
    mask[-1, :2] = 0                                  # the last row is left-padded
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    ids = rng.integers(0, vocab, (batch, past + seq))
    feeds = {"input_ids": ids[:, past:], "position_ids": pos[:, past:], "attention_mask": mask}
    past_names = [i.name for i in model.graph.input if i.name.startswith("past_key_values.")]
    prefix = {"input_ids": ids[:, :past], "position_ids": pos[:, :past], "attention_mask": mask[:, :past]}
    for name in past_names:
        kvh, hd = _dim(model, name, 1), _dim(model, name, 3)
        prefix[name] = np.zeros((batch, kvh, 0, hd), np.float32)
    if past_names:
        sess = _session(model)
        presents = [n.replace("past_key_values.", "present.") for n in past_names]
        feeds |= dict(zip(past_names, sess.run(presents, prefix)))
    return feeds


def logits(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    sess = _session(model)
    names = {i.name for i in sess.get_inputs()}
    return sess.run(["logits"], {k: v for k, v in feeds.items() if k in names})[0]


def compare_logits(before: onnx.ModelProto, after: onnx.ModelProto, seed: int = 0) -> tuple[float, float]:
    """(max abs error, max abs error / max |logit|) on the non-padded positions."""
    feeds = seeded_feeds(before, seed=seed)
    a, b = logits(before, feeds), logits(after, feeds)
    err = float(np.abs(a - b).max())
    return err, err / max(float(np.abs(a).max()), 1e-12)
