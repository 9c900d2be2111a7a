"""Quantization quality on SmolLM2: artifact perplexity on the fixed text (tests/data/perplexity.txt)."""

from __future__ import annotations

import pytest

from kiln.contract.artifact import EngineArtifact
from kiln.compiler.eval import PERPLEXITY_TEXT, text_token_ids
from kiln.compiler.eval.sequence import artifact_perplexity

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fp32_perplexity(smollm2_fp32_artifact):
    art = EngineArtifact.load(smollm2_fp32_artifact)
    ids = text_token_ids(art.tokenizer_dir, PERPLEXITY_TEXT)
    assert len(ids) >= 2000
    return artifact_perplexity(art, ids)


def test_fp32_perplexity_is_sane(fp32_perplexity):
    # SmolLM2-135M on plain English prose; a broken graph gives hundreds or thousands.
    assert 5 < fp32_perplexity < 40


def test_int4_within_three_percent(smollm2_int4_artifact, fp32_perplexity):
    """The engine-speed issue's quality bar for int4, through the built artifact's paged engine."""
    art = EngineArtifact.load(smollm2_int4_artifact)
    assert art.manifest.quant["mode"] == "int4"
    ppl = artifact_perplexity(art, text_token_ids(art.tokenizer_dir, PERPLEXITY_TEXT))
    print(f"\nperplexity fp32 {fp32_perplexity:.3f}, int4 {ppl:.3f} ({ppl / fp32_perplexity - 1:+.2%})")
    assert ppl / fp32_perplexity - 1 <= 0.03


def test_int4_runs_on_kilns_kernel_and_answers_paris(smollm2_int4_artifact):
    """Where kiln's op library is built (scripts/setup.sh), the ort int4 build puts its 4-bit linears
    on kiln.MatMulQ4Min, its LM head on kiln.MatMulQ8 and its attention on kiln.PagedAttention (the
    manifest says so), and the answer stays intact."""
    from kiln import LLM, RuntimeConfig, SamplingParams
    from kiln.engines.ort import native

    llm = LLM(smollm2_int4_artifact, RuntimeConfig(kv_cache_memory=256 << 20, threads=2))
    record = llm.artifact.manifest.engines[0]
    assert record["backend"] == "ort"
    assert record.get("native_ops", []) == (["kiln.MatMulQ4Min", "kiln.MatMulQ8", "kiln.PagedAttention"]
                                            if native.available() else [])
    assert llm.artifact.manifest.choices["attention"]["value"] == ("native" if native.available() else "standard")
    out = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]],
                   SamplingParams(max_tokens=24, temperature=0))[0]
    assert "Paris" in out.text, out.text
