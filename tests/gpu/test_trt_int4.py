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
