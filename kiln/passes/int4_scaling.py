"""Activation-aware input scaling (AWQ-style) for 4-bit linears that read an RMSNorm's output.

A block's 16 levels are spread evenly, so a weight on a strongly driven input channel is rounded
as coarsely as one on a quiet channel. Scaling channel k of W up by α_k and the norm's weight down
by α_k leaves the fp32 function unchanged (x/α · αW = x·W) and gives the loud channels a finer
grid; α_k = rms(x_k)^p, normalised to a geometric mean of 1 over the block's extremes (AWQ).

    RMSNorm(h, γ) ─ x ─ MatMul(W)   ─▶   RMSNorm(h, γ/α) ─ x/α ─ MatMulNBits(quantized αW)

Only where the fold is exact and local: the norm's weight is a [K] initializer used by that norm
alone, and every reader of x is a linear the pass quantizes at 4 bits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from kiln.export.external import fill_tensor, tensor_array
from kiln.passes.int4_calibration import InputMoments

NORM_OPS = ("SimplifiedLayerNormalization", "Mul")      # fused RMSNorm, or the unfused graph's final Mul


def input_scales(moments: InputMoments, exponent: float) -> np.ndarray:
    """[K] α = rms(x)^p over the calibration tokens, scaled so that sqrt(max·min) = 1."""
    alpha = np.maximum(np.sqrt(moments.square), 1e-6) ** exponent
    return (alpha / np.sqrt(alpha.max() * alpha.min())).astype(np.float32)


def fold_input_scales(graph: onnx.GraphProto, moments: dict[str, InputMoments], exponent: float,
                      is_4bit_linear, weights_dir: Path | None = None) -> dict[str, np.ndarray]:
    """Divide each foldable norm's weight by α in `graph`; returns {linear input name: α}, the
    scales the quantizer multiplies into those linears' weights (and divides out of `moments`)."""
    inits = {t.name: t for t in graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    producer = {o: n for n in graph.node for o in n.output}
    folded = {}
    for x, m in moments.items():
        gamma = _norm_weight(producer.get(x), inits, readers, len(m.square))
        if gamma is None or not all(is_4bit_linear(r) for r in readers.get(x, [])):
            continue
        alpha = input_scales(m, exponent)
        scaled = np.asarray(tensor_array(gamma, weights_dir), np.float32) / alpha
        gamma.CopyFrom(fill_tensor(TensorProto(), gamma.name, scaled, weights_dir))
        folded[x] = alpha
    return folded


def scaled_moments(m: InputMoments, alpha: np.ndarray) -> InputMoments:
    """The moments of x/α."""
    return InputMoments(m.mean / alpha, m.square / alpha ** 2)


def _norm_weight(node: onnx.NodeProto | None, inits: dict[str, TensorProto],
                 readers: dict[str, list[onnx.NodeProto]], k: int) -> TensorProto | None:
    if node is None or node.op_type not in NORM_OPS or len(node.output) != 1:
        return None
    weights = [inits[i] for i in node.input if i in inits and list(inits[i].dims) == [k]
               and inits[i].data_type == TensorProto.FLOAT]
    if len(weights) != 1 or len(readers.get(weights[0].name, [])) != 1:
        return None
    return weights[0]
