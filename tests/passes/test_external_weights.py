"""Weights as external data (kiln.compiler.export.external): the graph proto stays small through export and
the passes, and ONNX Runtime computes the same logits as from the self-contained graph."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from kiln.compiler.export import external
from kiln.compiler.export.decoder_graph import build_decoder
from kiln.compiler.export.external import WEIGHTS_FILE, is_external, session_config, weights_dir
from kiln.compiler.export.sources import load_source
from kiln.compiler.passes.cleanup import CleanupPass
from kiln.compiler.passes.fusion import fusion_passes
from kiln.compiler.passes.verify import seeded_feeds


def _logits(model, feeds) -> np.ndarray:
    opts = ort.SessionOptions()
    for key, value in session_config(model).items():
        opts.add_session_config_entry(key, value)
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(["logits"], {k: v for k, v in feeds.items() if k in names})[0]


def _inline_bytes(model) -> int:
    return sum(len(t.raw_data) for t in model.graph.initializer)


MIN_BYTES = 1024   # the tiny model's weights are 1-66 KB: externalize all but the smallest


@pytest.fixture(scope="module")
def tiny():
    return load_source("tiny-qwen2")     # biases and tied embeddings: the most initializer kinds


@pytest.fixture(autouse=True)
def small_threshold(monkeypatch):
    monkeypatch.setattr(external, "EXTERNAL_MIN_BYTES", MIN_BYTES)


def test_export_puts_large_weights_in_the_file(tiny, tmp_path):
    model = build_decoder(tiny.spec, tiny.weights, tmp_path)
    external = [t for t in model.graph.initializer if is_external(t)]
    assert weights_dir(model) == tmp_path.resolve()
    assert {t.name for t in external} >= {"model.embed_tokens.weight", "lm_head.weight",
                                          "model.layers.1.mlp.down_proj.weight"}
    assert all(len(t.raw_data) < MIN_BYTES for t in model.graph.initializer)
    offsets = [int(next(e.value for e in t.external_data if e.key == "offset")) for t in external]
    assert all(o % 4096 == 0 for o in offsets) and (tmp_path / WEIGHTS_FILE).stat().st_size >= sum(
        int(np.prod(t.dims)) * 4 for t in external)


def test_external_graph_and_passes_match_the_self_contained_graph(tiny, tmp_path):
    inline = build_decoder(tiny.spec, tiny.weights)
    feeds = seeded_feeds(inline)
    expected = _logits(inline, feeds)
    model = build_decoder(tiny.spec, tiny.weights, tmp_path)
    assert np.array_equal(_logits(model, feeds), expected)
    for p in [CleanupPass(), *fusion_passes(tiny.spec)]:
        model = p.run(model)
        assert weights_dir(model) == tmp_path.resolve(), p.name
        assert _inline_bytes(model) < _inline_bytes(inline) / 20, f"{p.name} pulled weights back inline"
        np.testing.assert_allclose(_logits(model, feeds), expected, atol=1e-4, err_msg=p.name)
    merged = [t for t in model.graph.initializer if "qkv_proj" in t.name and t.dims[0] == tiny.spec.hidden_size]
    assert merged and all(is_external(t) for t in merged)


def test_kv_io_keeps_weights_external_and_loadable(tiny, tmp_path):
    from kiln.compiler.passes.kv_io import KvIoPass

    model = KvIoPass(tiny.spec).run(build_decoder(tiny.spec, tiny.weights, tmp_path))
    assert weights_dir(model) == tmp_path.resolve() and _inline_bytes(model) < 20_000
    opts = ort.SessionOptions()
    for key, value in session_config(model).items():
        opts.add_session_config_entry(key, value)
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    assert {"block_tables", "key_cache.0"} <= {i.name for i in sess.get_inputs()}


def test_compiled_engine_keeps_weights_beside_it_and_loads_by_path(tiny, tmp_path):
    """An offline-optimized model saved with its weights in model.onnx.data loads like any file."""
    inline = build_decoder(tiny.spec, tiny.weights)
    feeds = seeded_feeds(inline)
    model = build_decoder(tiny.spec, tiny.weights, tmp_path / "work")
    engine = tmp_path / "engine" / "model.onnx"
    engine.parent.mkdir()
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(engine)
    for key, value in session_config(model, "model.onnx.data").items():
        opts.add_session_config_entry(key, value)
    ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    assert (engine.parent / "model.onnx.data").stat().st_size > 10 * engine.stat().st_size
    sess = ort.InferenceSession(str(engine), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    got = sess.run(["logits"], {k: v for k, v in feeds.items() if k in names})[0]
    np.testing.assert_allclose(got, _logits(inline, feeds), atol=1e-5)
