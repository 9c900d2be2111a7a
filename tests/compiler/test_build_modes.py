"""kiln build for every preset x quant mode (tiny ones here), and for an HF folder source."""

from __future__ import annotations

import importlib.util

import pytest

from kiln import LLM, RuntimeConfig, SamplingParams
from kiln.contract.artifact import EngineArtifact
from kiln.compiler.build import build
from kiln.config import BuildConfig
from kiln.compiler.export.presets import write_tiny_checkpoint
from kiln.contract.quant import QuantMode


@pytest.mark.parametrize("source", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("quant", [QuantMode.INT8, QuantMode.INT4])
def test_quantized_tiny_builds_load_and_generate(source, quant, tmp_path):
    path = build(BuildConfig(source=source, out=tmp_path / "a", quant=quant))
    art = EngineArtifact.load(path)
    assert art.manifest.quant["mode"] == quant.value
    assert any(p["name"].startswith("quantize") for p in art.manifest.passes)
    out = LLM(art, RuntimeConfig(kv_cache_memory=8 << 20)).generate(
        [[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


@pytest.mark.skipif(importlib.util.find_spec("openvino") is None, reason="f16 weights build on openvino")
@pytest.mark.parametrize("source", ["tiny-llama", "tiny-qwen2"])
def test_an_f16_build_loads_generates_and_says_f16(source, tmp_path):
    """--quant f16 picks openvino (the CPU backend that builds it), stores every weight f16, and holds
    its check to f16's bound. Greedy tokens equal to fp32's are not asserted: a random tiny model's
    near-uniform logits let an f16 rounding flip a near-tie."""
    from click.testing import CliRunner

    from kiln.cli import main
    from kiln.compiler.passes.verify_quant import QUANT_GATES

    path = tmp_path / "a"
    built = CliRunner().invoke(main, ["build", source, "--out", str(path), "--quant", "f16"], terminal_width=400)
    assert built.exit_code == 0, built.output
    assert "chose openvino f16" in built.output
    art = EngineArtifact.load(path)
    q, engine = art.manifest.quant, art.manifest.engines[0]
    assert q["mode"] == "f16" and engine["backend"] == "openvino" and engine["options"]["weights"] == "f16"
    assert engine["options"]["inference_precision"] == "f32" and art.manifest.plan["recipe"]["mode"] == "f16"
    gate = QUANT_GATES[QuantMode.F16]
    for figures in (q, q["chat"]):
        assert figures["top1_agreement"] >= gate.min_top1
        assert figures["perplexity_increase"] <= gate.max_perplexity_increase
    out = LLM(art, RuntimeConfig(kv_cache_memory=8 << 20)).generate(
        [[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    res = CliRunner().invoke(main, ["inspect", str(path)], terminal_width=400)
    assert res.exit_code == 0 and "f16 (user)" in res.output and "openvino (16-bit, f16)" in res.output


def test_build_from_hf_folder(tmp_path):
    folder = write_tiny_checkpoint("tiny-llama", tmp_path / "hf")
    path = build(BuildConfig(source=str(folder), out=tmp_path / "a"))
    m = EngineArtifact.load(path).manifest
    assert m.spec.family == "llama" and str(folder) in m.source
