"""Activation statistics of linear inputs, from one fp32 run over a calibration text.

The int4 search (int4_search.py) weighs each weight's rounding error by how strongly its input
channel is driven: llama.cpp's importance matrix (E[x²] per input channel), plus the channel means,
because a rounding error of one sign across a block meets inputs of one sign in outlier channels
and adds up in the dot product. Second moments per channel, not the full K x K matrix: the search
stays a few element-wise passes over each weight.

The text is kiln/data/calibration.txt: neither the perplexity text (tests/data/perplexity.txt, the
evaluation) nor the quantize check's text (kiln/data/check.txt), so neither figure is fitted.
NOTE: the run returns every probed activation at once ([tokens, K] floats each); the quantize pass
probes only the linears it searches (SmolLM2: qkv and o, 60 x 920 x 576 floats = 127 MB), so a
bigger model costs tokens x Σ K x 4 bytes for those, plus one fp32 session like the quantize check's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

CALIBRATION_TEXT = Path(__file__).resolve().parents[2] / "data" / "calibration.txt"
CALIBRATION_TOKENS = 1024        # the whole text for SmolLM2's tokenizer (920 tokens); one forward pass


@dataclass(frozen=True)
class InputMoments:
    """Per input channel of one linear: mean E[x] and second moment E[x²] over the calibration tokens."""

    mean: np.ndarray        # [K]
    square: np.ndarray      # [K]

    @classmethod
    def of(cls, x: np.ndarray) -> InputMoments:
        rows = x.reshape(-1, x.shape[-1]).astype(np.float64)
        return cls(rows.mean(axis=0), (rows * rows).mean(axis=0))


def linear_inputs(model: onnx.ModelProto) -> list[str]:
    """Activation tensors that feed a MatMul by a 2-D initializer (the linears a quantizer touches)."""
    inits = {t.name: t for t in model.graph.initializer}
    names = [n.input[0] for n in model.graph.node
             if n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]].dims) == 2]
    return list(dict.fromkeys(names))


def linear_input_moments(model: onnx.ModelProto, token_ids: list[int],
                         names: list[str] | None = None) -> dict[str, InputMoments]:
    """{activation name: its moments} from one run of `model` over token_ids (batch 1, no past), for
    `names` (default: every linear's input, linear_inputs)."""
    from kiln.compiler.eval.perplexity import empty_cache, make_session

    names = linear_inputs(model) if names is None else names
    probe = _with_outputs(model, names)
    sess = make_session(probe)
    ids = np.asarray(token_ids, np.int64)[None]
    feeds = {"input_ids": ids, "position_ids": np.arange(ids.shape[1], dtype=np.int64)[None],
             "attention_mask": np.ones_like(ids), **empty_cache(sess)}
    return {name: InputMoments.of(x) for name, x in zip(names, sess.run(names, feeds))}


def _with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """A shallow copy of the graph that also returns `names` (initializers stay where they are)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    present = {o.name for o in probe.graph.output}
    probe.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                              for n in names if n not in present)
    return probe


def calibration_token_ids(tokenizer_dir: Path, max_tokens: int, text_path: Path = CALIBRATION_TEXT) -> list[int]:
    """The first max_tokens tokens of the calibration text (no special tokens added)."""
    from kiln.compiler.eval.perplexity import text_token_ids

    return text_token_ids(tokenizer_dir, text_path)[:max_tokens]
