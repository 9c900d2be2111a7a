"""kiln build for every preset x quant mode (tiny ones here), and for an HF folder source."""

from __future__ import annotations

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


def test_build_from_hf_folder(tmp_path):
    folder = write_tiny_checkpoint("tiny-llama", tmp_path / "hf")
    path = build(BuildConfig(source=str(folder), out=tmp_path / "a"))
    m = EngineArtifact.load(path).manifest
    assert m.spec.family == "llama" and str(folder) in m.source
