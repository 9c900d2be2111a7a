"""A tied LM head reads the embedding's table (kiln.compiler.backends.openvino.tied_head): one
constant instead of two, the same logits, and NNCF's int8 compresses the one table once."""

from __future__ import annotations

import numpy as np
import pytest

ov = pytest.importorskip("openvino")
ops = pytest.importorskip("openvino.opset13")

from kiln.compiler.backends.openvino.tied_head import LM_HEAD, share_tied_head  # noqa: E402

VOCAB, HIDDEN = 96, 32


def _model(head_values: np.ndarray) -> ov.Model:
    """ids -> Gather(table) -> MatMul(head) -> logits, as kiln's exporter writes a decoder's ends."""
    table = np.random.default_rng(0).standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    ids = ops.parameter([-1], ov.Type.i64, name="ids")
    hidden = ops.gather(ops.constant(table), ids, ops.constant(np.int64(0)))
    head = ops.matmul(hidden, ops.constant(head_values(table)), False, False)
    head.set_friendly_name(LM_HEAD)
    return ov.Model([head], [ids])


def _large_constants(model: ov.Model) -> list:
    return [op for op in model.get_ordered_ops() if op.get_type_name() == "Constant" and len(op.shape) == 2]


def _logits(model: ov.Model) -> np.ndarray:
    # NOTE: dynamic quantization off: beside int8 weights the plugin would round the activations to int8 too
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": "1",
                                                         "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"})
    return compiled({0: np.arange(VOCAB, dtype=np.int64)})[0]


def test_a_tied_head_reads_the_embedding_table_and_computes_the_same_logits():
    model = _model(lambda t: t.T.copy())
    before = _logits(model)
    assert len(_large_constants(model)) == 2
    assert share_tied_head(model)
    assert len(_large_constants(model)) == 1
    head = next(op for op in model.get_ordered_ops() if op.get_friendly_name() == LM_HEAD)
    assert head.get_transpose_b()
    np.testing.assert_allclose(_logits(model), before, rtol=1e-5, atol=1e-5)


def test_an_untied_head_is_left_alone():
    model = _model(lambda t: (t.T + np.float32(0.5)).copy())
    assert not share_tied_head(model)
    assert len(_large_constants(model)) == 2


def test_nncf_compresses_the_shared_table_once_with_per_row_scales():
    nncf = pytest.importorskip("nncf")
    model = _model(lambda t: t.T.copy())
    share_tied_head(model)
    nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_SYM)
    int8 = [op for op in _large_constants(model) if op.get_output_element_type(0) == ov.Type.i8]
    scales = [op for op in _large_constants(model) if tuple(op.shape) == (VOCAB, 1)]
    assert len(int8) == 1 and tuple(int8[0].shape) == (VOCAB, HIDDEN) and len(scales) == 1
    # the Gather and the LM head both read the one dequantized table, row by row
    table = int8[0].get_data().astype(np.float32) * scales[0].get_data().astype(np.float32)
    np.testing.assert_allclose(_logits(model), table @ table.T, rtol=1e-4, atol=1e-4)
