"""bench/gguf_models.py's Gemma 3 file, read back by kiln's own GGUF reader: the benchmark's kiln
side builds it, so its keys, tensor names and padded vocabulary must be what kiln and llama.cpp
take a Gemma 3 to be (a small shape here; the benchmark writes 270M's)."""

import pytest

gguf_models = pytest.importorskip("bench.gguf_models")

from kiln.compiler.export.families import spec_from_hf_config  # noqa: E402
from kiln.compiler.export.gguf_config import hf_config  # noqa: E402
from kiln.compiler.export.gguf_reader import GGUFFile  # noqa: E402
from kiln.compiler.export.gguf_weights import lazy_weights  # noqa: E402
from kiln.compiler.export.presets import smollm2_gguf_path  # noqa: E402

SMALL = dict(gguf_models.GEMMA3_270M, layers=7, hidden=64, heads=4, kv_heads=1, head_dim=32, ffn=128,
             vocab=49_152 + 40, window=16)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "gemma3-small.gguf"
    return GGUFFile(gguf_models.write_gemma3_270m_shape(out, smollm2_gguf_path(), shape=SMALL))


def test_kiln_reads_it_as_a_gemma3_with_interleaved_windows(written):
    arch, cfg = hf_config(written)
    spec = spec_from_hf_config(cfg)
    assert spec.family == "gemma3" and cfg["vocab_size"] == SMALL["vocab"]
    # llama.cpp's pattern for gemma3: every sixth layer attends fully
    assert cfg["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"]
    assert cfg["sliding_window"] == SMALL["window"] and cfg["head_dim"] == SMALL["head_dim"]


def test_every_tensor_has_its_place_and_norms_are_stored_plus_one(written):
    arch, cfg = hf_config(written)
    weights = lazy_weights(written, arch, spec_from_hf_config(cfg))
    norm = weights["model.layers.0.input_layernorm.weight"]
    # stored as 1 + w with w ~ 0.1 N(0, 1): kiln takes the one back off
    assert abs(float(norm.mean())) < 0.1 and float(abs(norm).max()) < 1.0


def test_the_vocabulary_is_smollm2s_padded_to_the_shape(written):
    source = GGUFFile(smollm2_gguf_path())
    tokens = written.get("tokenizer.ggml.tokens")
    assert len(tokens) == SMALL["vocab"]
    assert list(tokens[:len(source.get("tokenizer.ggml.tokens"))]) == list(source.get("tokenizer.ggml.tokens"))
    for key in ("tokenizer.ggml.merges", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"):
        assert written.get(key) == source.get(key), key
