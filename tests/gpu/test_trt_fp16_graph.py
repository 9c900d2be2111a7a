"""The fp16 graph TensorRT parses keeps two islands in fp32: the rotary angles (position x inv_freq,
then cos/sin; fp16 has 11 significant bits, so positions above 2048 would not even be exact) and
RMSNorm's statistics (x², its mean, the reciprocal root; x² of an activation above 256 overflows
fp16). Checked by walking the types ONNX infers through the graph."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto

from kiln.compiler.backends.tensorrt.graph import in_precision
from kiln.compiler.export.decoder_graph import build_decoder
from kiln.compiler.export.sources import load_source
from kiln.compiler.passes.kv_io import KvIoPass

FLOAT, HALF = TensorProto.FLOAT, TensorProto.FLOAT16


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def half_graph(request):
    src = load_source(request.param)
    return in_precision(KvIoPass(src.spec, 16).run(build_decoder(src.spec, src.weights)), "fp16")


def _types(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]}
    types.update({t.name: t.data_type for t in g.initializer})
    return types


def _outputs(model, op_type, where=lambda n: True):
    return [n.output[0] for n in model.graph.node if n.op_type == op_type and where(n)]


def test_rotary_angles_are_computed_in_fp32(half_graph):
    types = _types(half_graph)
    inv_freq = [t.name for t in half_graph.graph.initializer if t.name.endswith("inv_freq")]
    assert inv_freq and all(types[name] == FLOAT for name in inv_freq)
    angles = _outputs(half_graph, "Mul", lambda n: any(i in inv_freq for i in n.input))
    tables = _outputs(half_graph, "Cos") + _outputs(half_graph, "Sin")
    assert angles and tables
    assert {name: types[name] for name in angles + tables} == {name: FLOAT for name in angles + tables}


def test_rms_norm_statistics_are_computed_in_fp32(half_graph):
    types = _types(half_graph)
    stats = [*_outputs(half_graph, "Pow"), *_outputs(half_graph, "ReduceMean"), *_outputs(half_graph, "Sqrt"),
             *_outputs(half_graph, "Reciprocal")]
    assert len(stats) == 4 * 5                       # input and post-attention norm x 2 layers, final norm
    assert {name: types[name] for name in stats} == {name: FLOAT for name in stats}
    assert all(types[n.input[0]] == FLOAT for n in half_graph.graph.node if n.op_type == "Pow")


def test_the_rest_stays_fp16(half_graph):
    types = _types(half_graph)
    matmuls = _outputs(half_graph, "MatMul")
    assert matmuls and all(types[name] == HALF for name in matmuls if not name.startswith("/model/lm_head"))
    normalized = _outputs(half_graph, "Mul", lambda n: n.name.endswith("/Normalize"))
    assert normalized and all(types[name] == HALF for name in normalized)
    assert types["logits"] == FLOAT and types["key_cache.0"] == HALF
