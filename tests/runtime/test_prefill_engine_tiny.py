"""Engines per bucket range on the ORT backend (tiny model): `--prefill-engine w8a8` adds a second
engine for calls of 4+ tokens; both read and write one KV pool, and the manifest says which serves what."""

from __future__ import annotations

import numpy as np
import pytest

from kiln import LLM, RuntimeConfig, SamplingParams
from kiln.compiler.build import PREFILL_MIN_TOKENS, build
from kiln.config import BuildConfig
from kiln.contract.quant import QuantMode
from token_agreement import QUANT_GAP, TOP_K, assert_outputs_close

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("prefill-engine") / "int4+w8a8"
    return build(BuildConfig(source="tiny-llama", out=out, quant=QuantMode.INT4, prefill_engine="w8a8"))


def test_manifest_records_which_engine_serves_which_range(artifact):
    llm = LLM(artifact, RuntimeConfig(kv_cache_memory=16 << 20))
    main, prefill = llm.artifact.manifest.engines
    assert main["serves"] == {"max_tokens": PREFILL_MIN_TOKENS - 1}
    assert prefill["serves"] == {"min_tokens": PREFILL_MIN_TOKENS}
    assert prefill["file"].startswith("engines/ort-prefill/") and prefill["quant"]["mode"] == "w8a8"
    assert llm.artifact.manifest.quant["mode"] == "int4"          # the artifact's own mode: the decode engine's
    names = [r["name"] for r in llm.artifact.manifest.passes]
    assert "quantize (prefill engine, w8a8)" in names and "kv_io (prefill engine)" in names
    llm.shutdown()


def test_prefill_runs_on_the_prefill_engine_and_single_decodes_on_the_main_one(artifact):
    llm = LLM(artifact, RuntimeConfig(kv_cache_memory=16 << 20))
    engine = llm.core.engine
    llm.generate([list(range(20, 60))], GREEDY)             # one 40-token prefill, then 9 single decodes
    assert engine.calls_by_engine == [9, 1]
    llm.generate([[7, 8, 9, 10, 11]] * 5, GREEDY)           # a 5-way batch: every call reaches 4+ tokens
    assert engine.calls_by_engine[0] == 9
    llm.shutdown()


def test_decodes_read_the_kv_the_prefill_engine_wrote(artifact, tmp_path):
    """The first token comes from the prefill engine's graph (a w8a8-only artifact gives the same),
    and the decode engine continues on the pool that prefill filled, freeing every block after."""
    both = LLM(artifact, RuntimeConfig(kv_cache_memory=16 << 20))
    w8a8 = LLM(build(BuildConfig(source="tiny-llama", out=tmp_path / "w8a8", quant=QuantMode.W8A8)),
               RuntimeConfig(kv_cache_memory=16 << 20))
    prompt = list(range(100, 140))
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=TOP_K)
    a, b = both.generate([prompt], first)[0], w8a8.generate([prompt], first)[0]
    assert a.token_ids == b.token_ids           # exact: the same w8a8 graph on the same lone 40-token call
    out = both.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=TOP_K))[0]
    # The second run hits the prefix cache (32 of 40 tokens): an 8-token call quantizes its activations
    # on its own, so the first token agrees up to a near-tie.
    assert len(out.token_ids) == 10 and out.num_cached_tokens == 32
    assert_outputs_close((out.token_ids[:1], out.logprobs[:1]), a, max_gap=QUANT_GAP, names=("cached", "fresh"))
    kv = both.core.kv
    assert kv.num_free_blocks == kv.num_blocks
    both.shutdown()
    w8a8.shutdown()


def test_prefill_engine_is_an_ort_option(tmp_path):
    with pytest.raises(ValueError, match="prefill-engine is an option of the ort backend"):
        build(BuildConfig(source="tiny-llama", out=tmp_path / "ov", quant=QuantMode.INT8, backend="openvino",
                          prefill_engine="w8a8"))
