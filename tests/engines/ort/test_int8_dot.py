"""w8a8's integer GEMM and the CPU: full-range int8 weights only where VNNI sums them in 32 bits."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.compiler.passes.dynamic_int8 import dynamic_int8_linear, full_range_weights
from kiln.engines.ort.int8_dot import FULL_RANGE, REDUCED_RANGE, cpu_flags, u8s8_saturates


def test_vnni_in_any_form_sums_without_saturating(tmp_path):
    assert u8s8_saturates({"avx2", "fma"}) is True
    assert u8s8_saturates({"avx512f", "avx512bw"}) is True          # AVX-512 without VNNI saturates too
    assert u8s8_saturates({"avx2", "avx_vnni"}) is False
    assert u8s8_saturates({"avx512_vnni"}) is False and u8s8_saturates({"amx_int8"}) is False
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512_vnni\n\nprocessor\t: 1\nflags\t: fpu\n")
    assert cpu_flags(info) == {"fpu", "sse", "avx2", "avx512_vnni"}
    assert cpu_flags(tmp_path / "missing") is None


def _linear_model(w: np.ndarray, limit: int) -> onnx.ModelProto:
    """y = x @ w as one DynamicQuantizeMatMul with weights within +-limit."""
    graph = helper.make_graph([], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, w.shape[0]])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, w.shape[1]])])
    matmul = helper.make_node("MatMul", ["x", "w"], ["y"], name="/linear/MatMul")
    graph.node.append(dynamic_int8_linear(graph, numpy_helper.from_array(w, "w"), matmul, limit=limit))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.fixture
def worst_case():
    """Activations all near the top of uint8 and weights all at +max: every pmaddubsw pair is at
    its largest, 2 x 255 x 127 at full range (past int16), 2 x 255 x 63 reduced (within it)."""
    w = np.tile(np.linspace(1.0, 2.0, 16, dtype=np.float32), (256, 1))   # each column constant: every code at +limit
    x = np.concatenate([np.full((4, 256), 1.0, np.float32), np.full((1, 256), -0.01, np.float32)])
    return w, x


def test_reduced_range_weights_are_exact_on_any_cpu(worst_case):
    w, x = worst_case
    model = _linear_model(w, REDUCED_RANGE)
    assert not full_range_weights(model.graph)
    np.testing.assert_allclose(_run(model, x), x @ w, rtol=2e-2, atol=1e-2 * np.abs(x @ w).max())


def test_full_range_weights_are_exact_where_the_cpu_has_vnni(worst_case):
    if u8s8_saturates() is not False:
        pytest.skip("this CPU has no VNNI: full-range weights saturate here (the loader refuses them)")
    w, x = worst_case
    model = _linear_model(w, FULL_RANGE)
    assert full_range_weights(model.graph)
    np.testing.assert_allclose(_run(model, x), x @ w, rtol=2e-2, atol=1e-2 * np.abs(x @ w).max())
