"""`kiln build --kv-dtype fp16|int8` (ort backend): a reduced-precision KV pool, fewer bytes, (nearly)
the same tokens."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from kiln import LLM, RuntimeConfig, SamplingParams
from kiln.contract.artifact import ArtifactError, EngineArtifact
from kiln.compiler.build import build
from kiln.config import BuildConfig
from kiln.engines.load import load_engine
from kiln.engines.ort.kv_pool import quantize_rows
from token_agreement import QUANT_GAP, TOP_K, assert_all_close, assert_outputs_close, top_of

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=TOP_K)
# An f16 pool moves the logprobs by < 0.05 (test_the_pool_is_what_moves_the_logits), so a flip it
# causes has a gap below 0.1: tighter than QUANT_GAP, which an int8 pool needs.
FP16_KV_GAP = 0.1
PROMPTS = [np.random.default_rng(s).integers(0, 256, n).tolist() for s, n in enumerate([3, 17, 40, 100])]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-dtype")
    return {(dtype, attention): build(BuildConfig(source="tiny-llama", out=root / f"{dtype}-{attention}",
                                                  kv_dtype=dtype, attention=attention))
            for dtype in ("float32", "float16", "int8") for attention in ("standard", "gqa")}


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
    got = llm.generate(PROMPTS, GREEDY)
    want = _llm(full).generate(PROMPTS, GREEDY)
    assert_all_close(got, want, max_gap=FP16_KV_GAP, names=("fp16 pool", "fp32 pool"))


@pytest.mark.parametrize("attention", ["standard", "gqa"])
def test_int8_pool_takes_a_quarter_and_stays_close(artifacts, attention):
    """int8 values + one fp32 scale per token and head: (head_dim + 4) / (4 head_dim) of fp32's bytes.
    The random-weight model's logits are near-uniform, so a rounded K/V may flip a near-tie: the
    tokens agree up to the first near-tie, and the log-probabilities stay close."""
    full, small = artifacts["float32", attention], artifacts["int8", attention]
    m = EngineArtifact.load(small).manifest
    hd = m.spec.head_dim
    assert m.kv_layout.dtype == "int8"
    assert m.kv_layout.bytes_per_token * 4 * hd == EngineArtifact.load(full).manifest.kv_layout.bytes_per_token * (hd + 4)
    llm = _llm(small)
    pool = llm.core.runner.engine.pool
    assert pool.data.dtype == np.int8 and pool.scales.dtype == np.float32
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=TOP_K)
    got, want = llm.generate(PROMPTS, params), _llm(full).generate(PROMPTS, params)
    assert_all_close(got, want, max_gap=QUANT_GAP, names=("int8 pool", "fp32 pool"))
    # the second token: the first one decoded over the prompt's K/V read back from the pool
    diffs = [abs(g.logprobs[1].token_logprob - w.logprobs[1].token_logprob)
             for g, w in zip(got, want) if g.token_ids[:2] == w.token_ids[:2]]
    assert diffs and 0 < max(diffs) < 0.25


def test_int8_rows_round_to_half_a_step_of_their_own_largest_value():
    x = np.random.default_rng(0).normal(size=(3, 5, 16)).astype(np.float32) * np.array([1e-3, 1, 100])[:, None, None]
    x[0, 0] = 0
    values, scales = quantize_rows(x)
    assert values.dtype == np.int8 and scales.shape == (3, 5, 1) and scales[0, 0, 0] == 1.0
    assert np.all(np.abs(values.astype(np.float32) * scales - x) <= scales / 2 + 1e-7)
    assert np.abs(values).max() == 127


def test_the_pool_is_what_moves_the_logits(artifacts):
    """Same prompt, same engine calls: fp16 logits differ from fp32's (the pool really is fp16),
    by about the rounding of K/V to 11 significant bits, far below a wrong block's O(1) error."""
    def logprobs(path):
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
        return _llm(path).generate(PROMPTS[3:], params)[0]

    full, half = logprobs(artifacts["float32", "standard"]), logprobs(artifacts["float16", "standard"])
    tie = assert_outputs_close(full, half, max_gap=FP16_KV_GAP, names=("fp32 pool", "fp16 pool"))
    # every candidate both top-5s hold, while the contexts are equal (to the near-tie, if any)
    upto = len(full.token_ids) if tie is None else tie + 1
    diffs = [abs(top_of(a)[t] - top_of(b)[t]) for a, b in list(zip(full.logprobs, half.logprobs))[:upto]
             for t in top_of(a).keys() & top_of(b).keys()]
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
