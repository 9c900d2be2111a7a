"""The w8a8 mode end to end on a tiny model: build (every pass checked, the paged layout at fp32
activations), load, generate; and the OpenVINO backend's refusal (it quantizes activations itself)."""

from __future__ import annotations

import pytest

from kiln import LLM, RuntimeConfig, SamplingParams
from kiln.compiler.build import build
from kiln.config import BuildConfig
from kiln.contract.artifact import EngineArtifact
from kiln.contract.quant import QuantMode
from kiln.compiler.passes.quantize import MIN_TOP1
from token_agreement import QUANT_GAP, TOP_K, assert_all_close


def test_w8a8_builds_records_its_check_and_generates(tmp_path):
    out = build(BuildConfig(source="tiny-llama", out=tmp_path / "w8a8", quant=QuantMode.W8A8))
    llm = LLM(out, RuntimeConfig(kv_cache_memory=16 << 20))
    quant = llm.artifact.manifest.quant
    assert quant["mode"] == "w8a8" and quant["int8_kernel"] == "dynamic"
    assert quant["top1_agreement"] >= MIN_TOP1[QuantMode.W8A8] and quant["perplexity"] > 0
    prompts = [[5, 9, 13, 200], list(range(40, 90))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=TOP_K)
    together = llm.generate(prompts, params)
    alone = [llm.generate([p], params)[0] for p in prompts]
    assert [len(t.token_ids) for t in together] == [12, 12]
    # activations are quantized per call, so a batch (or a prefix-cache hit: the second prompt's
    # 48 cached tokens leave a 2-token call) rounds differently from a lone prompt: up to a near-tie
    assert_all_close(together, alone, max_gap=QUANT_GAP, names=("together", "alone"))
    llm.shutdown()


def test_openvino_refuses_w8a8_with_what_to_use(tmp_path):
    with pytest.raises(ValueError, match="no w8a8 mode; it builds --quant none | int8 | int4"):
        build(BuildConfig(source="tiny-llama", out=tmp_path / "ov", quant=QuantMode.W8A8, backend="openvino"))


def test_full_range_w8a8_is_refused_where_the_cpu_would_saturate_it(tmp_path, monkeypatch):
    """A w8a8 artifact built on a CPU with VNNI (full-range weights) is refused at load on one
    without it; built without VNNI (7-bit weights) it loads anywhere. NOTE: the build host and the
    load-time probe are given: which CPU this test runs on decides nothing."""
    import dataclasses

    from kiln.compiler.plan import BuildHost
    from kiln.contract.artifact import ArtifactError
    from kiln.contract.cpu import describe
    from kiln.engines.ort import int8_dot

    for saturates in (False, True):     # the build CPU: with VNNI, then without
        flags = {"avx2", "fma", "f16c"} | (set() if saturates else {"avx_vnni"})
        host = dataclasses.replace(BuildHost.probe(), cpu=describe(flags))
        out = build(BuildConfig(source="tiny-llama", out=tmp_path / f"vnni-{not saturates}", quant=QuantMode.W8A8),
                    host=host)
        needs = [e.get("requires_cpu", []) for e in EngineArtifact.load(out).manifest.engines]
        assert needs == ([[]] if saturates else [["vnni"]])
    monkeypatch.setattr(int8_dot, "u8s8_saturates", lambda flags=None: True)       # loaded on a CPU without VNNI
    with pytest.raises(ArtifactError, match="no VNNI.*rebuild the artifact with `kiln build` on this machine"):
        LLM(tmp_path / "vnni-True", RuntimeConfig(kv_cache_memory=16 << 20))
    llm = LLM(tmp_path / "vnni-False", RuntimeConfig(kv_cache_memory=16 << 20))
    assert len(llm.generate([[5, 9, 13]], SamplingParams(max_tokens=3, temperature=0))[0].token_ids) == 3
    llm.shutdown()
