"""The ort-cuda rewrite, checked as far as a CPU can: the onnx checker (unfused graph), ONNX
Runtime's own resolution of every node against its schemas (fused and quantized graphs too,
PagedAttention included), and the refusals. Numerics need the GPU (test_on_gpu.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from kiln.compiler.backends.gpu.compare import probe_steps
from kiln.compiler.backends.gpu.onnx_files import save_onnx
from kiln.compiler.backends.ort_cuda.checks import PagedGraphError, check_resolves
from kiln.engines.ort_cuda.feeds import cuda_feeds
from kiln.compiler.backends.ort_cuda.paged_graph import paged_attention_graph
from kiln.compiler.export.decoder_graph import build_decoder
from kiln.compiler.export.sources import load_source
from kiln.contract.quant import QuantMode
from kiln.compiler.passes.quantize import QuantizePass
from kiln.compiler.passes.quant_settings import QuantSettings


@pytest.fixture(scope="module")
def tiny():
    src = load_source("tiny-llama")
    return src.spec, build_decoder(src.spec, src.weights)


def _paged_layers(model):
    return [n for n in model.graph.node if n.op_type == "PagedAttention"]


def test_unfused_rewrite_passes_the_onnx_checker_and_has_the_ops_interface(tiny):
    spec, model = tiny
    paged = paged_attention_graph(model, spec)
    onnx.checker.check_model(paged)
    inputs = {i.name: i.type.tensor_type.elem_type for i in paged.graph.input}
    assert list(inputs)[:7] == ["input_ids", "position_ids", "cumulative_sequence_length", "past_seqlens",
                                "block_table", "slot_mapping", "logits_indices"]
    assert inputs["key_cache.1"] == onnx.TensorProto.FLOAT16 and inputs["block_table"] == onnx.TensorProto.INT32
    assert [o.name for o in paged.graph.output] == ["logits", "key_cache_out.0", "value_cache_out.0",
                                                    "key_cache_out.1", "value_cache_out.1"]
    layers = _paged_layers(paged)
    assert len(layers) == spec.num_layers
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in layers[0].attribute}
    assert attrs == {"num_heads": 4, "kv_num_heads": 2, "scale": pytest.approx(16 ** -0.5)}
    assert list(layers[0].input[8:]) == ["", "", "slot_mapping"]
    # the dense attention, its mask and the past/present IO are gone
    assert not any(n.op_type == "Softmax" for n in paged.graph.node)
    assert not any("attn_mask" in n.name for n in paged.graph.node)


@pytest.mark.parametrize("quant", [QuantMode.NONE, QuantMode.INT4])
def test_fused_and_quantized_rewrites_resolve_in_onnx_runtime(tiny, tmp_path, quant):
    from kiln.compiler.passes.fusion import fusion_passes

    spec, model = tiny
    for p in fusion_passes(spec):
        model = p.run(model)
    model = QuantizePass(QuantSettings(quant)).run(model)
    path, _ = save_onnx(paged_attention_graph(model, spec, "bfloat16"), tmp_path)
    assert check_resolves(path)["passed"]


def test_a_broken_rewrite_fails_the_resolution_check(tiny, tmp_path):
    spec, model = tiny
    paged = paged_attention_graph(model, spec)
    attn = _paged_layers(paged)[0]
    attn.input[0] = attn.input[0].replace("q_cast", "q_tokens")        # fp32 query: T must be fp16
    path, _ = save_onnx(paged, tmp_path)
    with pytest.raises(PagedGraphError, match="does not resolve"):
        check_resolves(path)


def test_refusals(tiny):
    from dataclasses import replace

    from kiln.compiler.passes.kv_io import KvIoPass

    spec, model = tiny
    with pytest.raises(ValueError, match="sliding-window"):
        paged_attention_graph(model, replace(spec, sliding_window=8))
    with pytest.raises(ValueError, match="standard graph"):
        paged_attention_graph(KvIoPass(spec, 16).run(model), spec)


def test_feeds_are_the_ops_inputs():
    prefill, decode, _ = probe_steps(vocab_size=50, block_size=16)
    feeds = cuda_feeds(prefill, block_size=16, num_blocks=12)
    np.testing.assert_array_equal(feeds["cumulative_sequence_length"], [0, 19, 24])
    np.testing.assert_array_equal(feeds["past_seqlens"], [0, 0])
    np.testing.assert_array_equal(feeds["block_table"], [[7, 2], [4, -1]])
    assert feeds["block_table"].dtype == np.int32 and feeds["slot_mapping"].dtype == np.int32
    np.testing.assert_array_equal(feeds["slot_mapping"][16:19], [32, 33, 34])     # block 2, offsets 0-2
    np.testing.assert_array_equal(feeds["logits_indices"], [18, 23])
    feeds = cuda_feeds(decode, 16, 12)
    np.testing.assert_array_equal(feeds["past_seqlens"], [19, 5])
    np.testing.assert_array_equal(feeds["slot_mapping"], [2 * 16 + 3, 4 * 16 + 5])


def test_feeds_refuse_short_tables_and_foreign_blocks():
    prefill = probe_steps(50, 16)[0]
    with pytest.raises(ValueError, match="out of range"):
        cuda_feeds(prefill, 16, num_blocks=7)                 # block 7 of sequence 0
    prefill.block_tables[0] = prefill.block_tables[0][:1]
    with pytest.raises(ValueError, match="sequence 0: block table has 1 blocks"):
        cuda_feeds(prefill, 16, 12)


# How onnxruntime says the CPU provider has no PagedAttention kernel, per release: 1.32 fails the
# kernel lookup by name; 1.31 first casts the op's fp16 inputs to fp32 itself (its CPU cast
# insertion for ops without an fp16 kernel) and then fails type resolution on that inserted cast.
NO_CPU_KERNEL_MESSAGES = {
    "1.32": ("NotImplemented", "[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Could not find an implementation "
             "for PagedAttention(1) node with name '/model/layers.0/attn/paged/PagedAttention'"),
    "1.31": ("InvalidGraph", "[ONNXRuntimeError] : 10 : INVALID_GRAPH : This is an invalid model. In Node, "
             "(\"/model/layers.0/attn/paged/PagedAttention\", PagedAttention, \"com.microsoft\", -1) : "
             "(\"InsertedPrecisionFreeCast_/model/layers.0/attn/paged/q_cast\": tensor(float),"
             "\"InsertedPrecisionFreeCast_/model/layers.0/attn/paged/k_cast\": tensor(float),) -> "
             "(\"/model/layers.0/attn/paged/attn\": tensor(float16),) , Error Type Error: Type 'tensor(float)' "
             "of input parameter (InsertedPrecisionFreeCast_/model/layers.0/attn/paged/q_cast) of operator "
             "(PagedAttention) in node (/model/layers.0/attn/paged/PagedAttention) is invalid."),
}
DEFECT_MESSAGES = {
    "fp32 query from the rewrite": ("InvalidGraph", "[ONNXRuntimeError] : 10 : INVALID_GRAPH : Load model from "
                                    "m.onnx failed:This is an invalid model. Type Error: Type 'tensor(float)' of "
                                    "input parameter (/model/layers.0/attn/paged/q_tokens) of operator "
                                    "(PagedAttention) in node (/model/layers.0/attn/paged/PagedAttention) is invalid."),
    "another op without a kernel": ("NotImplemented", "[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Could not find "
                                    "an implementation for MatMulNBits(1) node with name 'x'"),
    "an inserted cast on another op": ("InvalidGraph", "[ONNXRuntimeError] : 10 : INVALID_GRAPH : Type Error: "
                                       "Type 'tensor(float)' of input parameter (InsertedPrecisionFreeCast_x) of "
                                       "operator (GroupQueryAttention) in node (y) is invalid."),
}


def _session_raising(monkeypatch, kind: str, message: str):
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    from kiln.compiler.backends.ort_cuda import checks

    def refuse(*args, **kwargs):
        raise getattr(state, kind)(message)

    monkeypatch.setattr(checks.ort, "InferenceSession", refuse)


@pytest.mark.parametrize("release", sorted(NO_CPU_KERNEL_MESSAGES))
def test_the_check_accepts_each_onnxruntime_releases_no_cpu_kernel_failure(monkeypatch, tmp_path, release):
    _session_raising(monkeypatch, *NO_CPU_KERNEL_MESSAGES[release])
    record = check_resolves(tmp_path / "model.onnx")
    assert record["passed"] and "PagedAttention has no CPU kernel" in record["note"]


@pytest.mark.parametrize("case", sorted(DEFECT_MESSAGES))
def test_the_check_still_refuses_real_defects(monkeypatch, tmp_path, case):
    _session_raising(monkeypatch, *DEFECT_MESSAGES[case])
    with pytest.raises(PagedGraphError, match="does not resolve"):
        check_resolves(tmp_path / "model.onnx")
