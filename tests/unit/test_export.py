"""Model sources and the family registry."""

from __future__ import annotations

import json

import pytest

from kiln.export.families import spec_from_hf_config
from kiln.export.sources import load_source
from kiln.export.spec import UnsupportedModelError


def test_unknown_architecture_refused_with_supported_list():
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*llama.*qwen2"):
        spec_from_hf_config({"model_type": "gpt2"})


def test_unknown_architecture_in_hf_folder_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'falcon'"):
        load_source(str(tmp_path))


def test_rope_scaling_refused():
    cfg = {"model_type": "llama", "rope_scaling": {"rope_type": "yarn"}}
    with pytest.raises(UnsupportedModelError, match="yarn"):
        spec_from_hf_config(cfg)


def test_missing_source_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="neither a preset"):
        load_source("no-such-model")


@pytest.mark.parametrize("name,family,bias,tied", [("tiny-llama", "llama", False, False),
                                                   ("tiny-qwen2", "qwen2", True, True)])
def test_tiny_presets_are_seeded_and_deterministic(name, family, bias, tied):
    a, b = load_source(name), load_source(name)
    assert a.spec.family == family and a.spec.attention_bias is bias and a.spec.tie_word_embeddings is tied
    assert a.weights.keys() == b.weights.keys()
    assert all((a.weights[k] == b.weights[k]).all() for k in a.weights)
