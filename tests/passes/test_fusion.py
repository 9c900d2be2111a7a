import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from kiln.contract.backends import get_backend
from kiln.compiler.passes.base import run_pass
from kiln.compiler.passes.fusion import (ALL_FUSIONS, FUSION_PASSES, FuseRMSNorm, FuseRotary, FuseSkipRMSNorm,
                                MergeProjections, fusion_passes)
from kiln.compiler.passes.verify import compare_logits


def norms(spec) -> int:
    return 2 * spec.num_layers + 1          # input_norm + post_attn_norm per layer, and final_norm


def test_rms_norm(tiny, checks):
    spec, model = tiny
    p = FuseRMSNorm()
    out, report = run_pass(p, model, compare_logits)
    ops = checks.op_counts(out)
    assert ops["Pow"] == ops["ReduceMean"] == ops["Reciprocal"] == ops["Sqrt"] == 0
    assert ops["SimplifiedLayerNormalization"] == norms(spec)
    assert p.details()["fused"] == norms(spec) and p.details()["skipped"] == 0
    sln = checks.node(out, "/model/layers.1/post_attn_norm/SimplifiedLayerNormalization")
    assert sln.input[1] == "model.layers.1.post_attention_layernorm.weight"
    assert {a.name: onnx.helper.get_attribute_value(a) for a in sln.attribute}["epsilon"] == pytest.approx(
        spec.rms_norm_eps)
    checks.must_keep(out, spec)
    checks.same_outputs(model, out)


def test_skip_rms_norm_takes_every_residual_but_the_final_one(tiny, checks):
    spec, model = tiny
    fused = FuseRMSNorm().run(model)
    p = FuseSkipRMSNorm()
    out, _ = run_pass(p, fused, compare_logits)
    ops = checks.op_counts(out)
    # Layer 0's input norm reads the embedding, and FINAL_HIDDEN sits before the final norm.
    assert ops["SkipSimplifiedLayerNormalization"] == norms(spec) - 2
    assert ops["SimplifiedLayerNormalization"] == 2
    assert p.details()["skipped_sites"] == ["/model/layers.0/input_norm/SimplifiedLayerNormalization",
                                            "/model/final_norm/SimplifiedLayerNormalization"]
    skip = checks.node(out, "/model/layers.0/post_attn_norm/SkipSimplifiedLayerNormalization")
    assert skip.domain == "com.microsoft" and skip.output[1] == skip.output[2] == ""
    assert not any(n.name.endswith("/residual") for n in out.graph.node if "layers.0/attn" in n.name)
    checks.must_keep(out, spec)
    checks.same_outputs(model, out)


def test_only_the_onnx_runtime_cpu_backend_fuses_the_residual_into_the_norm(tiny):
    """SkipSimplifiedLayerNormalization is an ONNX Runtime contrib op (kiln.contract.backends)."""
    spec, _ = tiny
    for backend in ("openvino", "tensorrt", "ort-cuda"):
        passes = fusion_passes(spec, get_backend(backend).skipped_fusions, "int4")
        assert not any(isinstance(p, FuseSkipRMSNorm) for p in passes), backend
    assert any(isinstance(p, FuseSkipRMSNorm) for p in fusion_passes(spec, get_backend("ort").skipped_fusions, "int4"))


def test_rotary(tiny, checks):
    spec, model = tiny
    p = FuseRotary.for_spec(spec)
    out, _ = run_pass(p, model, compare_logits)
    ops = checks.op_counts(out)
    assert ops["RotaryEmbedding"] == 2 * spec.num_layers
    assert ops["Neg"] == ops["Slice"] == ops["Sin"] == ops["Cos"] == 0
    rope = checks.node(out, "/model/layers.0/attn/k_rotary/RotaryEmbedding")
    assert rope.input[1] == "position_ids"
    caches = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer if t.name.endswith("_cache")}
    assert caches["/model/rotary/cos_cache"].shape == (spec.max_position_embeddings, spec.head_dim // 2)
    # new_key_kv_major still reads [B,S,kv_heads,head_dim], now rotated by the fused op.
    new_key = checks.node(out, "/model/layers.0/attn/new_key_kv_major")
    assert new_key.input[0] == "/model/layers.0/attn/k_rotary/Heads_output_0"
    checks.must_keep(out, spec)
    checks.same_outputs(model, out)


def test_merge_projections(tiny, checks):
    spec, model = tiny
    p = MergeProjections()
    out, _ = run_pass(p, model, compare_logits)
    ops = checks.op_counts(out)
    # Per layer: qkv, o, gate_up, down; plus the LM head.
    assert ops["MatMul"] == 4 * spec.num_layers + 1 + 2 * spec.num_layers   # + QK and PV
    assert ops["Split"] == 2 * spec.num_layers
    assert not any("q_proj" in n.name or "gate_proj" in n.name for n in out.graph.node)
    inits = {t.name: t for t in out.graph.initializer}
    qkv = inits["model.layers.0.self_attn.qkv_proj.weight"]
    assert list(qkv.dims) == [spec.hidden_size, (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim]
    assert ("model.layers.0.self_attn.qkv_proj.bias" in inits) == spec.attention_bias
    assert "model.layers.0.self_attn.q_proj.weight" not in inits
    checks.must_keep(out, spec)
    checks.same_outputs(model, out)


def test_all_fusions_in_order(tiny, checks):
    spec, model = tiny
    out = model
    for p in fusion_passes(spec):
        out, report = run_pass(p, out, compare_logits)
        assert report.details["fused"] > 0, p.name
    assert [type(p) for p in fusion_passes(spec)] == FUSION_PASSES
    checks.must_keep(out, spec)
    checks.same_outputs(model, out)


def test_openvino_builds_skip_the_rotary_fusion_and_merge_only_qkv(tiny, checks):
    """OpenVINO fuses the plain rotary pattern itself and splits a merged gate/up with a copy
    (kiln.contract.backends: skipped_fusions): at int8 q/k/v merge, gate/up stay two MatMuls."""
    spec, model = tiny
    skipped = get_backend("openvino").skipped_fusions
    passes = fusion_passes(spec, skipped, "int8")
    assert [type(p) for p in passes] == [c for c in FUSION_PASSES if c not in (FuseRotary, FuseSkipRMSNorm)]
    int4_merge = next(p for p in fusion_passes(spec, skipped, "int4") if isinstance(p, MergeProjections))
    assert [leaf for leaf, _, _ in int4_merge.groups] == ["attn", "mlp"]
    merge = next(p for p in passes if isinstance(p, MergeProjections))
    out, _ = run_pass(merge, model, compare_logits)
    assert checks.op_counts(out)["Split"] == spec.num_layers
    names = [n.name for n in out.graph.node]
    assert any("qkv_proj" in n for n in names) and not any("q_proj/" in n or "gate_up_proj" in n for n in names)
    assert any("gate_proj" in n for n in names) and any("up_proj" in n for n in names)
    checks.same_outputs(model, out)


@pytest.mark.parametrize("cls", ALL_FUSIONS)
def test_a_plain_graph_is_left_unchanged(cls, plain_graph):
    p = cls()
    out = p.run(plain_graph)
    assert out.SerializeToString() == plain_graph.SerializeToString()
    assert p.details()["fused"] == 0


def test_a_site_that_does_not_match_is_skipped(tiny_sources, checks):
    from kiln.compiler.export.decoder_graph import build_decoder

    src = tiny_sources["tiny-llama"]
    model = build_decoder(src.spec, src.weights)
    # x⁴ instead of x² in one norm: not an RMSNorm any more.
    model.graph.initializer.append(numpy_helper.from_array(np.array(4.0, np.float32), "/test/four"))
    checks.node(model, "/model/layers.1/input_norm/Pow").input[1] = "/test/four"
    p = FuseRMSNorm()
    out, _ = run_pass(p, model, compare_logits)
    assert p.details() == {"fused": norms(src.spec) - 1, "skipped": 1,
                           "skipped_sites": ["/model/layers.1/input_norm"]}
    assert checks.op_counts(out)["Pow"] == 1


def test_fusions_compose_with_kv_io(tiny, checks):
    """The whole fused chain, then paged IO, computes the unfused dense graph's logits and K/V
    (through ONNX Runtime: the dense past KV written into a shuffled block pool)."""
    from kiln.compiler.passes.kv_io import KvIoPass
    from kiln.compiler.passes.verify_paged import compare_paged

    spec, model = tiny
    fused = model
    for p in fusion_passes(spec):
        fused = p.run(fused)
    checks.same_outputs(model, fused)
    paged = KvIoPass(spec).run(fused)
    assert compare_paged(fused, paged, spec.num_layers, 16)[1] <= 1e-5
    assert compare_paged(model, paged, spec.num_layers, 16)[1] <= 1e-4


def test_the_fusion_check_fails_a_wrong_fusion(tiny):
    """compare_logits, the check every fusion runs under, catches a fused op with a wrong attribute."""
    spec, model = tiny
    fused = FuseRMSNorm().run(model)
    sln = next(n for n in fused.graph.node if n.op_type == "SimplifiedLayerNormalization")
    next(a for a in sln.attribute if a.name == "epsilon").f = 1.0      # eps 1e-6 -> 1
    _, rel = compare_logits(model, fused)
    assert rel > FuseRMSNorm().rel_tolerance
