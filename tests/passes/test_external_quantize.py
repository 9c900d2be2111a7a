"""The quantize pass on a graph whose weights are external data (export.external): the same tables
and the same logits as on the self-contained graph, written one weight at a time to the weights
file, with the graph proto staying small."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.compiler.export import external
from kiln.compiler.export.decoder_graph import build_decoder
from kiln.compiler.export.external import WEIGHTS_FILE, is_external, weights_dir
from kiln.compiler.passes.cleanup import CleanupPass
from kiln.compiler.passes.fusion import fusion_passes
from kiln.contract.quant import QuantMode
from kiln.compiler.passes.quantize import QuantizePass
from kiln.compiler.passes.quant_settings import QuantSettings
from kiln.compiler.passes.verify import logits, seeded_feeds

MIN_BYTES = 1024   # the tiny models' weights are 1-66 KB: externalize all but the smallest


@pytest.fixture(autouse=True)
def small_threshold(monkeypatch):
    monkeypatch.setattr(external, "EXTERNAL_MIN_BYTES", MIN_BYTES)


def _quantized(src, mode: QuantMode, folder=None):
    model = build_decoder(src.spec, src.weights, folder)
    for p in [CleanupPass(), *fusion_passes(src.spec), QuantizePass(QuantSettings(mode))]:
        model = p.run(model)
    return model


@pytest.mark.parametrize("mode", [QuantMode.INT8, QuantMode.INT4])
def test_external_quantized_graph_equals_the_in_memory_one(tiny_sources, mode, tmp_path):
    for name, src in tiny_sources.items():     # tiny-qwen2: tied embeddings share the head's table
        inline = _quantized(src, mode)
        model = _quantized(src, mode, tmp_path / name)
        feeds = seeded_feeds(inline)
        assert np.array_equal(logits(model, feeds), logits(inline, feeds)), name
        assert [n.op_type for n in model.graph.node] == [n.op_type for n in inline.graph.node], name
        assert weights_dir(model) == (tmp_path / name).resolve()


def test_quantized_tables_go_to_the_weights_file(tiny_sources, tmp_path):
    src = tiny_sources["tiny-llama"]
    model = _quantized(src, QuantMode.INT4, tmp_path)
    tables = [t for t in model.graph.initializer if t.name.endswith(("_Q4", "_Q8"))]
    assert tables and all(is_external(t) for t in tables if external.stored_bytes(t) >= MIN_BYTES)
    assert not any(t.name == "lm_head.weight" for t in model.graph.initializer)   # replaced, not kept
    assert sum(len(t.raw_data) for t in model.graph.initializer) < 50_000
    assert (tmp_path / WEIGHTS_FILE).stat().st_size > sum(external.stored_bytes(t) for t in tables)


def test_quantize_report_counts_external_bytes(tiny_sources, tmp_path):
    """weight_bytes_before/after read the stored length of external tensors, not the inline bytes."""
    src = tiny_sources["tiny-llama"]
    inline_pass, external_pass = (QuantizePass(QuantSettings(QuantMode.INT8)) for _ in range(2))
    inline_pass.run(build_decoder(src.spec, src.weights))
    external_pass.run(build_decoder(src.spec, src.weights, tmp_path))
    keys = ("weight_bytes_before", "weight_bytes_after")
    assert [inline_pass.details()[k] for k in keys] == [external_pass.details()[k] for k in keys]
