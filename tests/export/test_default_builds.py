"""`kiln build MODEL` with no flags never fails on a model kiln supports: on a tiny GGUF of every family
kiln exports, written as llama.cpp writes them (gguf_writing.py), and on a large-vocabulary model with a
tied head, the default build succeeds on the first rung of its ladder that passes the check, and the
manifest records that rung with its figures (the rungs before it too, each with why it was left).

The tiny files stand for real ones of their family, which are large enough for --quant auto to pick
int8; these tests lower the size threshold (defaults.SMALL_MODEL_PARAMS) so that their default
builds quantize as a real model's would."""

from __future__ import annotations

import json

import pytest

import kiln.compiler.defaults
from gguf_writing import write_gguf
from kiln.compiler.build import build
from kiln.compiler.passes.verify_quant import QUANT_GATES
from kiln.config import BuildConfig
from kiln.contract.artifact import EngineArtifact
from kiln.contract.quant import QuantMode

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3"]
# Gemma 3's published vocabulary, its head tied to the embedding; the embedding's scale puts the
# logits' spread where a real model's is (several units), not at a random model's near-uniform one.
LARGE_VOCAB = 262_144
LARGE_VOCAB_MODEL = dict(vocab_size=LARGE_VOCAB, embed_std=0.3, config=dict(hidden_size=96, max_position_embeddings=128))


def manifest_of(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def assert_the_chosen_rung_passed_its_gate(manifest: dict) -> dict:
    """The last rung tried is the one built, it passed its mode's gate on both texts, every rung before
    it failed and says why; returns the chosen rung's record."""
    ladder = manifest["plan"]["ladder"]
    *left, chosen = ladder
    assert chosen["passed"] and chosen["rung"] == manifest["plan"]["rung"] and not chosen["failure"]
    assert all(not r["passed"] and "failed its numeric check" in r["failure"] for r in left)
    gate = QUANT_GATES[QuantMode(chosen["quant"])]
    for figures in (chosen["figures"], chosen["figures"]["chat"]):
        assert figures["top1_agreement"] >= gate.min_top1
        assert figures["perplexity_increase"] <= gate.max_perplexity_increase
    assert manifest["quant"]["mode"] == chosen["quant"]
    return chosen


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = write_gguf(name, tmp_path_factory.mktemp(name))
        return made[name]
    return get


@pytest.fixture(scope="module")
def large_vocab_gguf(tmp_path_factory):
    return write_gguf("gemma3", tmp_path_factory.mktemp("large-vocab"), **LARGE_VOCAB_MODEL).path


@pytest.mark.parametrize("name", FAMILIES)
def test_the_default_build_of_every_family_succeeds_and_records_its_rung(name, written, tmp_path, monkeypatch):
    monkeypatch.setattr(kiln.compiler.defaults, "SMALL_MODEL_PARAMS", 0)
    path = build(BuildConfig(source=str(written(name).path), out=tmp_path / "art"))
    manifest = manifest_of(path)
    assert manifest["choices"]["quant"]["chosen_by"] == "auto" and manifest["choices"]["backend"]["chosen_by"] == "auto"
    chosen = assert_the_chosen_rung_passed_its_gate(manifest)
    assert chosen["figures"]["chat"]["tokens"] > 0                 # each family's file carries a chat template


def test_a_large_vocabulary_tied_head_model_builds_by_default(large_vocab_gguf, tmp_path):
    """No threshold lowered: the 262,144-row table alone makes it a model --quant auto quantizes."""
    from click.testing import CliRunner

    from kiln.cli import main

    res = CliRunner().invoke(main, ["build", str(large_vocab_gguf), "--out", str(tmp_path / "art")])
    assert res.exit_code == 0, res.output
    manifest = manifest_of(tmp_path / "art")
    spec = EngineArtifact.load(tmp_path / "art").manifest.spec
    assert spec.vocab_size == LARGE_VOCAB and spec.tie_word_embeddings
    assert manifest["plan"]["ladder"][0]["quant"] == "int8"
    chosen = assert_the_chosen_rung_passed_its_gate(manifest)
    assert f"rung {chosen['rung']}: passed the check" in res.output
    res = CliRunner().invoke(main, ["inspect", str(tmp_path / "art")], terminal_width=400)
    assert "rungs tried" in res.output and chosen["rung"] in res.output
