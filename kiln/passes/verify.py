"""Numeric checks of a pass: run the graph before and after on seeded inputs through ONNX Runtime.

Works on the standard decoder interface (input_ids, position_ids, attention_mask, past KV).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _dim(model: onnx.ModelProto, input_name: str, axis: int) -> int | None:
    for i in model.graph.input:
        if i.name == input_name:
            d = i.type.tensor_type.shape.dim[axis]
            return d.dim_value or None
    return None


def seeded_feeds(model: onnx.ModelProto, batch: int = 2, seq: int = 5, past: int = 3, seed: int = 0) -> dict:
    """Inputs for a standard decoder graph: random ids, a left-padded row, random past KV."""
    rng = np.random.default_rng(seed)
    vocab = model.graph.output[0].type.tensor_type.shape.dim[-1].dim_value
    logits_out = next(o for o in model.graph.output if o.name == "logits")
    vocab = logits_out.type.tensor_type.shape.dim[-1].dim_value or vocab
    total = past + seq
    mask = np.ones((batch, total), np.int64)
    mask[-1, :2] = 0                                  # the last row is left-padded
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)[:, past:]
    feeds = {"input_ids": rng.integers(0, vocab, (batch, seq)), "position_ids": pos, "attention_mask": mask}
    for i in model.graph.input:
        if i.name.startswith("past_key_values."):
            kvh, hd = _dim(model, i.name, 1), _dim(model, i.name, 3)
            feeds[i.name] = rng.normal(0, 1, (batch, kvh, past, hd)).astype(np.float32)
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
