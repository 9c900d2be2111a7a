"""Artifacts whose engine keeps its weights in a file beside the graph (model.onnx.data): the build
records and checksums it, loading refuses a damaged one, and generation equals the artifact whose
weights are inside the graph."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from kiln import LLM, RuntimeConfig, SamplingParams
from kiln.contract.artifact import ArtifactError
from kiln.compiler.build import build
from kiln.config import BuildConfig
from kiln.compiler.export import external
from kiln.contract.quant import QuantMode

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
DATA = "engines/ort/model.onnx.data"


def _prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, k).tolist() for k in [3, 17, 40]]


def _tokens(artifact) -> list[list[int]]:
    llm = LLM(artifact, RuntimeConfig(kv_cache_memory=32 << 20, threads=2))
    return [o.token_ids for o in llm.generate(_prompts(), GREEDY)]


def _build(out, quant=QuantMode.NONE, backend="ort"):
    return build(BuildConfig(source="tiny-llama", out=out, quant=quant, backend=backend))


@pytest.fixture(scope="module", params=[QuantMode.NONE, QuantMode.INT4], ids=lambda q: q.value)
def pair(request, tmp_path_factory):
    """(weights inside the graph, weights in model.onnx.data) of one tiny-llama build."""
    root = tmp_path_factory.mktemp("external")
    built = []
    for name, min_bytes in (("inline", 1 << 40), ("external", 1024)):   # tiny-llama's weights: 1-66 KB
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(external, "EXTERNAL_MIN_BYTES", min_bytes)
            built.append(_build(root / name, request.param))
    return tuple(built)


def test_engine_weights_are_a_checksummed_file_of_the_artifact(pair):
    inline, outside = pair
    record = json.loads((outside / "manifest.json").read_text())["engines"][0]
    assert record["weights"]["file"] == DATA
    assert record["weights"]["bytes"] == (outside / DATA).stat().st_size > 2 * record["bytes"]
    assert "weights" not in json.loads((inline / "manifest.json").read_text())["engines"][0]
    assert not (inline / DATA).exists()
    assert sorted(p.name for p in outside.iterdir()) == ["engines", "manifest.json", "tokenizer"]  # no work folder


def test_generation_equals_the_in_graph_weights(pair):
    inline, outside = pair
    assert _tokens(outside) == _tokens(inline)      # exact: the same graph and weights, stored elsewhere, same batch


def test_damaged_weights_file_is_refused(pair, tmp_path):
    art = shutil.copytree(pair[1], tmp_path / "a")
    data = bytearray((art / DATA).read_bytes())
    data[5000] ^= 0xFF
    (art / DATA).write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="model.onnx.data is corrupt"):
        LLM(art)
    (art / DATA).write_bytes(bytes(data[:-100]))
    with pytest.raises(ArtifactError, match="model.onnx.data is truncated"):
        LLM(art)
    (art / DATA).unlink()
    with pytest.raises(ArtifactError, match="model.onnx.data is missing"):
        LLM(art)


def test_openvino_builds_from_external_weights(pair, tmp_path, monkeypatch):
    """The OpenVINO frontend reads the build's graph with its weights still in the work file."""
    pytest.importorskip("openvino")
    if json.loads((pair[0] / "manifest.json").read_text())["quant"]["mode"] != "none":
        pytest.skip("fp32 only: OpenVINO compresses its own weights")
    monkeypatch.setattr(external, "EXTERNAL_MIN_BYTES", 1024)
    art = _build(tmp_path / "ov", backend="openvino")
    assert _tokens(art) == _tokens(pair[0])
