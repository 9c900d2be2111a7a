"""Build checks that fail a wrong graph: the quantize check (top-1 agreement and logit error on the
shipped text), block offsets that store a Q4_1 weight exactly, and kv_io held to its own tolerance
on quantized graphs (fp32 activations)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from kiln.compiler.passes.base import PassCheckError, run_pass
from kiln.compiler.export.decoder_graph import build_decoder
from kiln.compiler.passes.kv_io import KvIoPass
from kiln.contract.quant import QuantMode
from kiln.compiler.passes.quantize import MIN_TOP1, QuantizePass
from kiln.compiler.passes.quant_settings import QuantSettings
from kiln.compiler.passes.verify import logits, seeded_feeds
from kiln.compiler.passes.verify_paged import compare_paged, fp32_activations
from kiln.compiler.passes.verify_quant import QuantCheck, check_token_ids

QUANTIZED = [QuantMode.INT8, QuantMode.INT4]


@pytest.fixture(scope="module")
def check_ids(tiny_sources):
    return {name: check_token_ids(src.tokenizer_dir, 512) for name, src in tiny_sources.items()}


def quant_check(ids, mode: QuantMode) -> QuantCheck:
    return QuantCheck("quantize", ids, MIN_TOP1[mode])


# where kiln's ops keep their float16 scales inside a tile-block (kiln/compiler/passes/q4min_linear.py)
KILN_SCALE_BYTES = {"MatMulQ4Min": slice(256, 288), "MatMulQ8": slice(512, 544)}


def _edit_scales(model: onnx.ModelProto, edit) -> onnx.ModelProto:
    """`edit(scales)` applied to every MatMulNBits' scale table ([N, K/bs]) and to the scales inside
    every kiln op's tiles (as [tiles, K/32, 16] float16: blocks along axis 1)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inits = {t.name: t for t in out.graph.initializer}
    for n in out.graph.node:
        if n.op_type == "MatMulNBits":
            scales = numpy_helper.to_array(inits[n.input[2]])
            inits[n.input[2]].CopyFrom(numpy_helper.from_array(edit(scales, -1), n.input[2]))
        elif n.op_type in KILN_SCALE_BYTES:
            tiles = numpy_helper.to_array(inits[n.input[1]]).copy()
            part = KILN_SCALE_BYTES[n.op_type]
            scales = np.ascontiguousarray(tiles[..., part]).view(np.float16)
            tiles[..., part] = np.ascontiguousarray(edit(scales, 1)).view(np.uint8)
            inits[n.input[1]].CopyFrom(numpy_helper.from_array(tiles, n.input[1]))
    return out


def scrambled_scales(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every 4/8-bit linear's scale table shuffled: the tables a mis-laid-out quantizer would write."""
    rng = np.random.default_rng(0)
    return _edit_scales(model, lambda s, axis: rng.permutation(s.ravel()).reshape(s.shape))


def shifted_groups(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every block reads its neighbour's scale (a wrong group: an off-by-one along K)."""
    return _edit_scales(model, lambda s, axis: np.roll(s, 1, axis=axis))


class BrokenQuantize(QuantizePass):
    def __init__(self, settings: QuantSettings, breaker, calibration_ids: list[int] | None = None):
        super().__init__(settings, calibration_ids)
        self.breaker = breaker

    def run(self, model: onnx.ModelProto) -> onnx.ModelProto:
        return self.breaker(super().run(model))


@pytest.mark.parametrize("mode", QUANTIZED)
def test_a_correct_quantized_graph_passes_and_reports_its_quality(tiny, tiny_sources, check_ids, mode):
    spec, model = tiny
    name = next(n for n, s in tiny_sources.items() if s.spec == spec)
    out, report = run_pass(QuantizePass(QuantSettings(mode)), model, quant_check(check_ids[name], mode))
    d = report.details
    assert d["check_tokens"] == 512 and d["check_text"] == "kiln/data/check.txt"
    assert MIN_TOP1[mode] <= d["top1_agreement"] <= 1.0
    assert report.max_rel_error == d["max_rel_logit_error"] and report.tolerance is None    # reported, no gate
    assert d["perplexity"] > 1 and d["perplexity_fp32"] > 1 and d["perplexity"] != d["perplexity_fp32"]


def test_none_measures_fp32_once(tiny_sources, check_ids, tiny):
    spec, model = tiny
    name = next(n for n, s in tiny_sources.items() if s.spec == spec)
    none = QuantizePass(QuantSettings(QuantMode.NONE))
    _, report = run_pass(none, model, quant_check(check_ids[name], QuantMode.NONE))
    assert report.details["top1_agreement"] == 1.0 and report.max_abs_error == 0.0
    assert report.details["perplexity"] == report.details["perplexity_fp32"]


@pytest.mark.parametrize("breaker", [scrambled_scales, shifted_groups])
@pytest.mark.parametrize("mode", QUANTIZED)
def test_a_broken_quantized_graph_fails_with_the_pass_name(tiny_sources, check_ids, mode, breaker):
    """On tiny-llama. tiny-qwen2's tied unit-scale table makes every position predict its own input
    token by a margin no broken linear moves (its perplexity is astronomic), so its greedy answers
    and its perplexity stay: the gate measures what a user sees, and there nothing changes."""
    src = tiny_sources["tiny-llama"]
    model = build_decoder(src.spec, src.weights)
    with pytest.raises(PassCheckError, match="pass 'quantize' failed its numeric check"):
        run_pass(BrokenQuantize(QuantSettings(mode), breaker), model, quant_check(check_ids["tiny-llama"], mode))


def test_a_build_with_a_broken_quantizer_fails(monkeypatch, tmp_path):
    import kiln.compiler.build
    from kiln.config import BuildConfig

    class ScrambledQuantize(BrokenQuantize):       # what the build makes from its plan's recipe, broken
        def __init__(self, settings: QuantSettings, calibration_ids: list[int] | None = None):
            super().__init__(settings, scrambled_scales, calibration_ids)

    monkeypatch.setattr(kiln.compiler.build, "QuantizePass", ScrambledQuantize)
    with pytest.raises(PassCheckError, match="'quantize'.*top-1 agreement with fp32"):
        kiln.compiler.build.build(BuildConfig(source="tiny-llama", out=tmp_path / "art", quant=QuantMode.INT4))
    assert not (tmp_path / "art").exists()


def q4_1(w: np.ndarray, block: int = 32) -> np.ndarray:
    """llama.cpp's Q4_1 round trip of W [K, N] along K: w = d·q + min, q in 0..15."""
    k, n = w.shape
    b = w.reshape(k // block, block, n)
    lo, hi = b.min(1, keepdims=True), b.max(1, keepdims=True)
    d = (hi - lo) / 15
    return (np.round((b - lo) / d) * d + lo).reshape(k, n).astype(np.float32)


def with_q4_1_linears(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    weights = {n.input[1] for n in out.graph.node if n.op_type == "MatMul"}
    for t in out.graph.initializer:
        if t.name in weights and len(t.dims) == 2:
            t.CopyFrom(numpy_helper.from_array(q4_1(numpy_helper.to_array(t)), t.name))
    return out


@pytest.mark.parametrize("offsets,bound", [(True, 1e-5), (False, None)])
def test_block_offsets_store_a_q4_1_weight_exactly(tiny, offsets, bound):
    """SmolLM2's GGUF is Q4_1: with a float minimum per block the 4-bit graph is the fp32 graph
    (up to MatMulNBits' int8 activations, turned off here); an integer zero point is not."""
    _, model = tiny
    source = with_q4_1_linears(model)
    p = QuantizePass(QuantSettings(QuantMode.INT4, block_offsets=offsets, int8_linears=(), quantize_embedding=False,
                                   quantize_lm_head=False))
    out = fp32_activations(p.run(source))
    feeds = seeded_feeds(source)
    ref = logits(source, feeds)
    rel = np.abs(logits(out, feeds) - ref).max() / np.abs(ref).max()
    if offsets:
        assert rel < bound
    else:
        assert rel > 1e-3          # the offset grid costs real error: what the recipe avoids


@pytest.mark.parametrize("mode", QUANTIZED)
def test_kv_io_keeps_its_own_tolerance_on_a_quantized_graph(tiny, mode):
    spec, model = tiny
    quantized = QuantizePass(QuantSettings(mode)).run(model)
    kv_io = KvIoPass(spec)
    assert kv_io.rel_tolerance == 1e-4
    paged, report = run_pass(kv_io, quantized, lambda a, b: compare_paged(a, b, spec.num_layers, 16))
    assert report.max_rel_error <= 1e-4
    # and the check can fail: a paged graph that reads layer 0's K pool as its V pool and back
    swap = {"key_cache.0": "value_cache.0", "value_cache.0": "key_cache.0"}
    for n in paged.graph.node:
        n.input[:] = [swap.get(i, i) for i in n.input]
    assert compare_paged(quantized, paged, spec.num_layers, 16)[1] > 1e-2


def test_fp32_activations_only_touches_the_accuracy_level(tiny):
    _, model = tiny
    q = QuantizePass(QuantSettings(QuantMode.INT4)).run(model)
    f = fp32_activations(q)
    assert {a.i for n in f.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
            if a.name == "accuracy_level"} == {0}
    assert [t.name for t in f.graph.initializer] == [t.name for t in q.graph.initializer]
    assert fp32_activations(model) is model


@pytest.mark.parametrize("mode", [QuantMode.NONE, QuantMode.INT4])
def test_the_manifest_and_kiln_inspect_carry_the_perplexity(tmp_path, mode):
    from click.testing import CliRunner

    from kiln.contract.artifact import EngineArtifact
    from kiln.compiler.build import build
    from kiln.cli import main
    from kiln.config import BuildConfig

    path = build(BuildConfig(source="tiny-llama", out=tmp_path / "art", quant=mode))
    q = EngineArtifact.load(path).manifest.quant
    assert q["mode"] == mode.value and q["check_tokens"] == 512 and q["min_top1_agreement"] == MIN_TOP1[mode]
    assert (q["perplexity"] == q["perplexity_fp32"]) == (mode is QuantMode.NONE)
    res = CliRunner().invoke(main, ["inspect", str(path)], terminal_width=400)
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if "perplexity" in ln)
    assert f"{q['perplexity']:.3f} (fp32 {q['perplexity_fp32']:.3f}" in line and "kiln/data/check.txt" in line
