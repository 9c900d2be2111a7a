"""`kiln build --kv-dtype fp16` (ort backend): an fp16 KV pool, half the bytes, the same tokens."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from kiln import LLM, RuntimeConfig, SamplingParams
from kiln.artifact import ArtifactError, EngineArtifact
from kiln.build import build
from kiln.config import BuildConfig
from kiln.engines.factory import load_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [np.random.default_rng(s).integers(0, 256, n).tolist() for s, n in enumerate([3, 17, 40, 100])]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-dtype")
    return {(dtype, attention): build(BuildConfig(source="tiny-llama", out=root / f"{dtype}-{attention}",
                                                  kv_dtype=dtype, attention=attention))
            for dtype in ("float32", "float16") for attention in ("standard", "gqa")}


def _llm(path):
    return LLM(path, RuntimeConfig(kv_cache_memory=16 << 20, threads=2))


@pytest.mark.parametrize("attention", ["standard", "gqa"])
def test_fp16_pool_halves_the_bytes_and_keeps_the_tokens(artifacts, attention):
    full, half = artifacts["float32", attention], artifacts["float16", attention]
    layouts = {a: EngineArtifact.load(a).manifest.kv_layout for a in (full, half)}
    assert layouts[half].dtype == "float16"
    assert 2 * layouts[half].bytes_per_token == layouts[full].bytes_per_token
    llm = _llm(half)
    assert llm.core.runner.engine.pool.data.dtype == np.float16
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    want = [o.token_ids for o in _llm(full).generate(PROMPTS, GREEDY)]
    assert got == want


def test_the_pool_is_what_moves_the_logits(artifacts):
    """Same prompt, same engine calls: fp16 logits differ from fp32's (the pool really is fp16),
    by about the rounding of K/V to 11 significant bits, far below a wrong block's O(1) error."""
    def logprobs(path):
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
        return _llm(path).generate(PROMPTS[3:], params)[0]

    full, half = logprobs(artifacts["float32", "standard"]), logprobs(artifacts["float16", "standard"])
    assert full.token_ids == half.token_ids
    diffs = [abs(a.token_logprob - b.token_logprob) for a, b in zip(full.logprobs, half.logprobs)]
    assert 0 < max(diffs) < 0.05


def test_a_manifest_that_misstates_the_pool_dtype_is_refused(artifacts, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(artifacts["float16", "standard"], copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["kv_layout"]["dtype"] = "float32"
    (copy / "manifest.json").write_text(json.dumps(m))
    artifact = EngineArtifact.load(copy)
    with pytest.raises(ArtifactError, match="tensor\\(float16\\) KV pool.*rebuild"):
        load_engine(artifact, threads=1)


def test_other_backends_refuse_the_option(tmp_path):
    with pytest.raises(ValueError, match="--kv-dtype is an option of the ort backend"):
        build(BuildConfig(source="tiny-llama", out=tmp_path / "ov", backend="openvino", kv_dtype="float16"))
