"""int4 weight-only for TensorRT: kiln's MatMulNBits / GatherBlockQuantized graph rewritten into
block-quantized DequantizeLinear + MatMul (8-bit tables dequantized) computes the same numbers."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from kiln.contract.backends import get_backend
from kiln.contract.engine import BucketGrid, KvLayout
from kiln.compiler.backends.gpu.compare import probe_steps
from kiln.engines.ort.engine import OrtEngine
from kiln.compiler.backends.tensorrt.weights import int4_weight_only
from kiln.compiler.export.decoder_graph import build_decoder
from kiln.compiler.export.sources import load_source
from kiln.compiler.passes.kv_io import KvIoPass
from kiln.contract.quant import QuantMode
from kiln.compiler.passes.quantize import QuantizePass
from kiln.compiler.plan import BuildHost
from kiln.compiler.recipes import quant_recipe
from kiln.compiler.passes.verify_paged import fp32_activations


@pytest.fixture(scope="module")
def int4_paged():
    src = load_source("tiny-llama")
    return src.spec, KvIoPass(src.spec, 16).run(
        QuantizePass.for_recipe(quant_recipe(get_backend("tensorrt"), QuantMode.INT4, src.spec, BuildHost.probe()))
        .run(build_decoder(src.spec, src.weights)))


def test_rewrite_leaves_only_standard_ops(int4_paged):
    _, model = int4_paged
    converted, counts = int4_weight_only(model)
    onnx.checker.check_model(converted)
    assert counts == {"int4_dequantize_linear": 14, "dequantized_8bit": 1, "embedding_tables": 1}
    assert not [n.op_type for n in converted.graph.node if n.domain or not onnx.defs.has(n.op_type)]
    dq = next(n for n in converted.graph.node if n.op_type == "DequantizeLinear")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in dq.attribute}
    assert attrs == {"axis": 0, "block_size": 32}


def test_rewrite_is_exact_against_fp32_activations(int4_paged, tmp_path):
    """Same dequantized weights: equal to the quantized graph at fp32 activations up to float order.
    (ONNX Runtime's own optimizations are off: they would fuse DequantizeLinear + MatMul back into
    MatMulNBits with int8 activations.)"""
    spec, model = int4_paged
    onnx.save(fp32_activations(model), tmp_path / "kiln.onnx")
    onnx.save(int4_weight_only(model)[0], tmp_path / "trt.onnx")
    layout = KvLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, 16)
    ref, got = OrtEngine(tmp_path / "kiln.onnx", BucketGrid(), layout), OrtEngine(tmp_path / "trt.onnx", BucketGrid(), layout)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    got.session = ort.InferenceSession(str(tmp_path / "trt.onnx"), opts, providers=["CPUExecutionProvider"])
    for e in (ref, got):
        e.allocate_kv(16)
    for step in probe_steps(spec.vocab_size, 16):
        np.testing.assert_allclose(got.execute(step).logits, ref.execute(step).logits, atol=1e-5, rtol=1e-5)


def _initializer(model, name):
    return next((t for t in model.graph.initializer if t.name == name), None)


def _weights(model) -> dict[str, np.ndarray]:
    """Every 4-bit linear's effective weight [K, N] by its output name, as the graph computes it:
    MatMulNBits' scale·(q - zero point), or the DequantizeLinear before a MatMul (run by the onnx
    reference evaluator), plus the per-block offset its output is added to."""
    from onnx.reference import ReferenceEvaluator

    producer = {o: n for n in model.graph.node for o in n.output}
    consumers = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    out = {}
    for node in model.graph.node:
        if node.op_type == "MatMulNBits" and onnx.helper.get_attribute_value(
                next(a for a in node.attribute if a.name == "bits")) == 4:
            w = _nbits_weight(model, node)
        elif node.op_type == "MatMul" and node.input[1] in producer and producer[node.input[1]].op_type == "DequantizeLinear":
            dq = producer[node.input[1]]
            sub = onnx.helper.make_model(onnx.helper.make_graph(
                [dq], "dq", [], [onnx.helper.make_tensor_value_info(dq.output[0], onnx.TensorProto.FLOAT, None)],
                [_initializer(model, i) for i in dq.input]), opset_imports=list(model.opset_import))
            w = ReferenceEvaluator(sub).run(None, {})[0]
        else:
            continue
        add = consumers[node.output[0]][0]
        offset_node = producer[next(i for i in add.input if i != node.output[0])]
        mins = onnx.numpy_helper.to_array(_initializer(model, offset_node.input[1]))
        out[add.output[0]] = w + np.repeat(mins, w.shape[0] // mins.shape[0], axis=0)
    return out


def _nbits_weight(model, node) -> np.ndarray:
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    k, n, bs = attrs["K"], attrs["N"], attrs["block_size"]
    packed = onnx.numpy_helper.to_array(_initializer(model, node.input[1])).reshape(n, -1)
    q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1)[:, :k].astype(np.float32)
    scales = onnx.numpy_helper.to_array(_initializer(model, node.input[2])).reshape(n, -1)
    zp = onnx.numpy_helper.to_array(_initializer(model, node.input[3])).reshape(n, -1)
    zp = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(n, -1)[:, :scales.shape[1]].astype(np.float32)
    return ((q - np.repeat(zp, bs, axis=1)) * np.repeat(scales, bs, axis=1)).T


def test_int4_weights_are_signed_with_zero_points_zero(int4_paged):
    """TensorRT's ONNX parser takes signed INT4 only, with zero points zero (or none)."""
    _, model = int4_paged
    converted, _ = int4_weight_only(model)
    types = {t.name: t.data_type for t in converted.graph.initializer}
    assert onnx.TensorProto.UINT4 not in types.values()
    dqs = [n for n in converted.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dqs) == 14 and all(types[n.input[0]] == onnx.TensorProto.INT4 for n in dqs)
    for n in dqs:
        zero_point = n.input[2] if len(n.input) > 2 else ""
        assert not zero_point or not onnx.numpy_helper.to_array(_initializer(converted, zero_point)).any()


def test_int4_dequantized_weights_are_the_same_numbers(int4_paged):
    """q - 8 with 8·scale folded into the block offset: every linear's weight, dequantized as the
    graph does, equals kiln's (up to fp32 rounding of the moved offset)."""
    _, model = int4_paged
    before, after = _weights(model), _weights(int4_weight_only(model)[0])
    assert len(before) == len(after) == 14 and before.keys() == after.keys()
    for name, w in before.items():
        np.testing.assert_allclose(after[name], w, rtol=0, atol=1e-6 * np.abs(w).max(), err_msg=name)
