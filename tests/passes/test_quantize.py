"""The quantize pass on the tiny presets: what it rewrites, what it shares, what it saves, and numerics."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest

from kiln.compiler.export.decoder_graph import build_decoder
from kiln.compiler.export.sources import load_source
from kiln.compiler.passes.base import run_pass
from kiln.contract.quant import QuantMode
from kiln.compiler.passes.quantize import QuantizePass, weight_bytes
from kiln.compiler.passes.quant_settings import QuantSettings
from kiln.compiler.passes.verify import compare_logits

QUANTIZED = [QuantMode.INT8, QuantMode.INT4]


@pytest.fixture(scope="module")
def models() -> dict[str, onnx.ModelProto]:
    out = {}
    for name in ("tiny-llama", "tiny-qwen2"):
        src = load_source(name)
        out[name] = build_decoder(src.spec, src.weights)
    return out


def ops(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


OFFSET_NODES = ("/block_sums", "/block_offset")      # block_offsets.py's side product, not a linear


def weight_matmuls(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    inits = {t.name for t in model.graph.initializer}
    return [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits
            and not n.name.endswith(OFFSET_NODES)]


# The logit error a sound recipe stays under on the tiny presets (a broken linear's is several times it).
SANE_REL_ERROR = {QuantMode.INT8: 0.15, QuantMode.INT4: 0.25}


def producer(model: onnx.ModelProto, tensor: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if tensor in n.output)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("mode", QUANTIZED)
def test_every_linear_and_the_embedding_are_quantized(models, name, mode):
    model = models[name]
    linears = len(weight_matmuls(model))               # 7 per layer + the LM head
    out, report = run_pass(QuantizePass(QuantSettings(mode)), model, compare_logits)
    assert ops(out)["MatMulNBits"] == linears == 15
    assert ops(out)["GatherBlockQuantized"] == 1 and ops(out)["Gather"] == ops(model)["Gather"] - 1
    assert weight_matmuls(out) == []
    # INT4's recipe: attention 4-bit (searched integer zero points), the MLP and the LM head 8-bit
    assert report.details["matmuls_by_bits"] == ({8: 15} if mode is QuantMode.INT8 else {4: 8, 8: 7})
    assert report.details["block_offsets"] is False
    assert ops(out)["MatMul"] == ops(model)["MatMul"] - linears        # no side path: MatMulNBits alone
    assert all(a.i == 4 for n in out.graph.node if n.op_type == "MatMulNBits"
               for a in n.attribute if a.name == "accuracy_level")
    d = report.details
    assert d["matmuls_quantized"] == 15 and d["bits"] == mode.bits and d["block_size"] == 32
    assert d["table_bits"] == 8
    assert all("not an initializer" in s["reason"] for s in d["skipped"])   # only attention's QK / PV
    assert report.max_rel_error <= SANE_REL_ERROR[mode]


def test_tied_4bit_table_is_a_view_of_the_lm_heads_table(models):
    p = QuantizePass(QuantSettings(QuantMode.INT4, table_bits=4))
    out = p.run(models["tiny-qwen2"])
    gather = next(n for n in out.graph.node if n.op_type == "GatherBlockQuantized")
    head = next(n for n in out.graph.node if n.name.startswith("/model/lm_head"))
    view = producer(out, gather.input[0])
    assert view.op_type == "Reshape" and view.input[0] == head.input[1]
    assert gather.input[2:] == head.input[2:]                  # the same scales and zero points
    names = {t.name for t in out.graph.initializer}
    assert "model.embed_tokens.weight" not in names and "lm_head.weight" not in names
    vocab_tables = sorted(n for n in names if n.startswith(("lm_head", "model.embed_tokens")))
    assert vocab_tables == ["lm_head.weight_Q4", "lm_head.weight_scales", "lm_head.weight_zero_points"]
    assert "sharing the LM head's quantized table" in p.details()["embedding"]


def test_tied_8bit_table_is_gathered_in_place(models):
    """The 8-bit gather reads MatMulNBits' 3-D weight directly: no Reshape of the big table."""
    p = QuantizePass(QuantSettings(QuantMode.INT4, table_bits=8))
    out, report = run_pass(p, models["tiny-qwen2"], compare_logits)
    gather = next(n for n in out.graph.node if n.op_type == "GatherBlockQuantized")
    head = next(n for n in out.graph.node if n.name.startswith("/model/lm_head"))
    assert gather.input[0] == head.input[1]                    # the very same data tensor
    assert gather.input[2:] == [f"{name}_3d" for name in head.input[2:]]
    names = {t.name for t in out.graph.initializer}
    vocab_tables = sorted(n for n in names if n.startswith(("lm_head", "model.embed_tokens")))
    assert vocab_tables == ["lm_head.weight_Q8", "lm_head.weight_scales", "lm_head.weight_scales_3d",
                            "lm_head.weight_zero_points", "lm_head.weight_zero_points_3d"]
    assert "in place" in p.details()["embedding"]


def test_untied_embedding_gets_its_own_table(models):
    p = QuantizePass(QuantSettings(QuantMode.INT8))
    out = p.run(models["tiny-llama"])
    gather = next(n for n in out.graph.node if n.op_type == "GatherBlockQuantized")
    assert gather.input[0] in {t.name for t in out.graph.initializer}
    assert "own table" in p.details()["embedding"]


PURE_INT4 = dict(table_bits=4, int8_linears=())


@pytest.mark.parametrize("mode,options,bound", [(QuantMode.INT8, {}, 0.35), (QuantMode.INT4, PURE_INT4, 0.22),
                                                (QuantMode.INT4, {}, 0.30)])
def test_weight_bytes_shrink(models, mode, options, bound):
    p = QuantizePass(QuantSettings(mode, **options))
    out = p.run(models["tiny-llama"])
    d = p.details()
    assert d["weight_bytes_before"] == weight_bytes(models["tiny-llama"].graph)
    assert d["weight_bytes_after"] == weight_bytes(out.graph)
    assert d["weight_bytes_after"] < bound * d["weight_bytes_before"]


def test_pure_int4_is_all_4_bit(models):
    p = QuantizePass(QuantSettings(QuantMode.INT4, **PURE_INT4))
    out, report = run_pass(p, models["tiny-qwen2"], compare_logits)
    assert report.details["matmuls_by_bits"] == {4: 15}
    assert {a.i for n in out.graph.node if n.domain == "com.microsoft" for a in n.attribute if a.name == "bits"} == {4}


def test_none_is_the_identity(models):
    model = models["tiny-llama"]
    out, report = run_pass(QuantizePass(QuantSettings(QuantMode.NONE)), model, compare_logits)
    assert out.SerializeToString() == model.SerializeToString()
    assert report.max_abs_error == 0.0


def test_mode_is_data():
    assert QuantMode("int4") is QuantMode.INT4 and QuantMode.INT8.value == "int8"
    assert [m.bits for m in QuantMode] == [None, 8, 4, 8, 16]


def test_flags_keep_the_tables_fp32(models):
    p = QuantizePass(QuantSettings(QuantMode.INT4, quantize_embedding=False, quantize_lm_head=False))
    out, _ = run_pass(p, models["tiny-qwen2"], compare_logits)
    assert ops(out)["MatMulNBits"] == 14 and ops(out)["GatherBlockQuantized"] == 0
    assert [n.name for n in weight_matmuls(out)] == ["/model/lm_head"]
    assert any("quantize_lm_head=False" in s["reason"] for s in p.details()["skipped"])
    assert p.details()["embedding"] == "fp32 (quantize_embedding=False)"


def test_tied_embedding_without_a_quantized_head_gets_its_own_table(models):
    p = QuantizePass(QuantSettings(QuantMode.INT8, quantize_lm_head=False))
    out, _ = run_pass(p, models["tiny-qwen2"], compare_logits)
    assert ops(out)["GatherBlockQuantized"] == 1 and "own table" in p.details()["embedding"]


def test_int4_recipe_keeps_the_tables_at_8_bits(models):
    out, _ = run_pass(QuantizePass(QuantSettings(QuantMode.INT4)), models["tiny-qwen2"], compare_logits)
    bits = {n.name: next(a.i for a in n.attribute if a.name == "bits")
            for n in out.graph.node if n.domain == "com.microsoft"}
    assert bits["/model/lm_head_Q8"] == 8 and bits["/model/embed_tokens_Q8"] == 8
    assert bits["/model/layers.1/mlp/down_proj/MatMul_Q8"] == 8 and bits["/model/layers.0/attn/v_proj/MatMul_Q4"] == 4


def test_int8_linears_keep_named_linears_at_8_bits_without_offsets(models):
    settings = QuantSettings(QuantMode.INT4, int8_linears=("down_proj",), block_offsets=True)
    out = QuantizePass(settings).run(models["tiny-qwen2"])
    names = {n.name for n in out.graph.node}
    assert "/model/layers.1/mlp/down_proj/MatMul_Q8" in names
    assert "/model/layers.1/mlp/down_proj/MatMul/block_offset" not in names
    assert "/model/layers.1/mlp/up_proj/MatMul/block_offset" in names


def test_int8_linears_match_whole_name_segments(models):
    p = QuantizePass(QuantSettings(QuantMode.INT4, int8_linears=("proj",)))    # no segment is exactly "proj": all 4-bit
    p.run(models["tiny-llama"])
    assert p.details()["matmuls_by_bits"] == {4: 14, 8: 1}


def test_any_matmul_with_a_weight_is_quantized_whatever_its_name(models):
    model = onnx.ModelProto()
    model.CopyFrom(models["tiny-llama"])
    for i, n in enumerate(model.graph.node):
        if n.op_type == "MatMul":
            n.name = f"fused_{i}" if i % 2 else ""
    out, _ = run_pass(QuantizePass(QuantSettings(QuantMode.INT4)), model, compare_logits)
    assert ops(out)["MatMulNBits"] == 15 and weight_matmuls(out) == []


def test_k_not_divisible_by_the_block_is_skipped(models):
    p = QuantizePass(QuantSettings(QuantMode.INT8, block_size=128))   # hidden 64: only down_proj (K=128) qualifies
    out, _ = run_pass(p, models["tiny-llama"], compare_logits)
    assert ops(out)["MatMulNBits"] == 2 and ops(out)["GatherBlockQuantized"] == 0
    reasons = [s["reason"] for s in p.details()["skipped"]]
    assert sum("not divisible by block_size=128" in r for r in reasons) == 13
    assert "not divisible" in p.details()["embedding"]


def test_a_weight_shared_by_two_matmuls_is_quantized_once(models):
    model = onnx.ModelProto()
    model.CopyFrom(models["tiny-llama"])
    q1 = next(n for n in model.graph.node if n.name == "/model/layers.1/attn/q_proj/MatMul")
    q1.input[1] = "model.layers.0.self_attn.q_proj.weight"
    out, _ = run_pass(QuantizePass(QuantSettings(QuantMode.INT8)), model, compare_logits)
    q_tables = [t.name for t in out.graph.initializer if "q_proj" in t.name and t.name.endswith("_Q8")]
    assert q_tables == ["model.layers.0.self_attn.q_proj.weight_Q8"]
    assert ops(out)["MatMulNBits"] == 15


def test_quantized_logits_stay_close_on_a_real_sequence(models):
    """Beyond the relative check: greedy next tokens mostly agree with fp32 at int8."""
    from kiln.compiler.passes.verify import logits, seeded_feeds

    model = models["tiny-llama"]
    feeds = seeded_feeds(model, batch=1, seq=16, past=0)
    a = logits(model, feeds)
    b = logits(QuantizePass(QuantSettings(QuantMode.INT8)).run(model), feeds)
    assert np.mean(a.argmax(-1) == b.argmax(-1)) >= 0.9


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_quantizes_the_fused_graph(models, name):
    """Fusion runs first: merged qkv / gate_up MatMuls are linears like any other."""
    from kiln.compiler.passes.fusion import fusion_passes

    model = models[name]
    spec = load_source(name).spec
    for p in fusion_passes(spec):
        model = p.run(model)
    linears = len(weight_matmuls(model))                  # per layer: qkv, o, gate_up, down; + head
    assert linears == 2 * 4 + 1
    out, report = run_pass(QuantizePass(QuantSettings(QuantMode.INT4)), model, compare_logits)
    assert weight_matmuls(out) == [] and ops(out)["GatherBlockQuantized"] == 1
    assert report.details["matmuls_by_bits"] == {4: 4, 8: 5}   # qkv, o 4-bit; gate_up, down, the head 8-bit


@pytest.mark.parametrize("mode", QUANTIZED)
def test_a_weight_shared_by_two_matmuls_keeps_one_copy_in_every_recipe(models, mode):
    """INT4's block offsets replace one MatMul by four nodes: the second user gets its own four,
    reading the same tables, and computes what a separately quantized copy of the weight would."""
    from kiln.compiler.passes.verify import logits, seeded_feeds

    shared, copied = onnx.ModelProto(), onnx.ModelProto()
    shared.CopyFrom(models["tiny-llama"])
    copied.CopyFrom(models["tiny-llama"])
    next(n for n in shared.graph.node if n.name == "/model/layers.1/attn/q_proj/MatMul").input[1] = \
        "model.layers.0.self_attn.q_proj.weight"
    w = next(t for t in copied.graph.initializer if t.name == "model.layers.0.self_attn.q_proj.weight")
    copied.graph.initializer.append(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(w), "/test/q_copy"))
    next(n for n in copied.graph.node if n.name == "/model/layers.1/attn/q_proj/MatMul").input[1] = "/test/q_copy"
    out = QuantizePass(QuantSettings(mode)).run(shared)
    q_tables = [t.name for t in out.graph.initializer if "q_proj" in t.name and "_Q" in t.name]
    assert q_tables == [f"model.layers.0.self_attn.q_proj.weight_Q{mode.bits}"]
    assert len({n.name for n in out.graph.node}) == len(out.graph.node)        # node names stay unique
    feeds = seeded_feeds(shared)
    apart = QuantizePass(QuantSettings(mode)).run(copied)
    np.testing.assert_allclose(logits(out, feeds), logits(apart, feeds), atol=1e-5)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_w8a8_runs_linears_on_dynamic_int8_except_the_down_projection_and_the_head(models, name):
    from kiln.compiler.passes.fusion import fusion_passes
    from kiln.compiler.passes.quantize import MIN_TOP1
    from kiln.compiler.passes.verify_quant import QuantCheck

    model = models[name]
    for p in fusion_passes(load_source(name).spec):
        model = p.run(model)
    quantize = QuantizePass(QuantSettings(QuantMode.W8A8))
    check = QuantCheck(quantize.name, list(range(3, 67)), MIN_TOP1[QuantMode.W8A8])
    out, report = run_pass(quantize, model, check)
    dynamic = [n for n in out.graph.node if n.op_type == "DynamicQuantizeMatMul"]
    nbits = [n for n in out.graph.node if n.op_type == "MatMulNBits"]
    assert sorted({n.name.split("/")[-2] for n in dynamic}) == ["gate_up_proj", "o_proj", "qkv_proj"]
    assert len(dynamic) == 2 * 3
    head = producer(out, "/model/lm_head_output_0")
    assert head in nbits and len(nbits) == 3
    assert {n.name.split("/")[-2] for n in nbits if n is not head} == {"down_proj"}
    assert weight_matmuls(out) == []
    assert report.details["int8_kernel"] == "dynamic" and report.details["matmuls_by_bits"] == {8: 9}
    for n in dynamic:           # int8 per output channel, symmetric: zero points all 0
        inits = {t.name: t for t in out.graph.initializer}
        q, scales, zp = (onnx.numpy_helper.to_array(inits[i]) for i in n.input[1:4])
        assert q.dtype == np.int8 and scales.shape == zp.shape == (q.shape[1],) and not zp.any()


def test_w8a8_weights_dequantize_to_the_fp32_weights():
    from kiln.compiler.passes.dynamic_int8 import per_channel_int8

    w = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)
    w[:, 5] = 0                                          # an all-zero column stays exact
    q, scale = per_channel_int8(w)
    assert (np.abs(q.astype(np.float32) * scale - w) <= 0.5 * scale + 1e-7).all()   # half a step at most
    assert (q[:, 5] == 0).all() and np.abs(q).max() == 127


def test_fp32_activations_turns_dynamic_int8_into_a_matmul_of_the_dequantized_weight(models):
    """The kv_io check runs quantized graphs at fp32 activations: a DynamicQuantizeMatMul becomes
    x @ (q * scale), which is what the per-call activation rounding approximates."""
    from kiln.compiler.passes.verify import logits, seeded_feeds
    from kiln.compiler.passes.verify_paged import fp32_activations

    model = models["tiny-llama"]
    out = QuantizePass(QuantSettings(QuantMode.W8A8)).run(model)
    fp32 = fp32_activations(out)
    assert ops(fp32)["DynamicQuantizeMatMul"] == 0 and ops(fp32)["DequantizeLinear"] == ops(out)["DynamicQuantizeMatMul"]
    feeds = seeded_feeds(model, batch=1, seq=8, past=0)
    exact, rounded, ref = logits(fp32, feeds), logits(out, feeds), logits(model, feeds)
    # dequantized weights at fp32 activations sit closer to fp32 than the rounded activations do
    assert np.abs(exact - ref).max() < np.abs(rounded - ref).max()
    assert np.abs(rounded - exact).max() > 0
