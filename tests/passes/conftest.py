"""Fixtures for the pass tests: tiny decoder graphs, a graph with nothing to fuse, and checks."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from kiln.compiler.export.decoder_graph import (FINAL_HIDDEN, KEY_POSITIONS, QUERY_POSITIONS, build_decoder,
                                       new_kv_name, past_transpose_name)
from kiln.compiler.export.graph_builder import FLOAT, GraphBuilder
from kiln.compiler.export.sources import load_source
from kiln.compiler.passes.verify import seeded_feeds

TINY = ["tiny-llama", "tiny-qwen2"]


@pytest.fixture(scope="session")
def tiny_sources():
    return {name: load_source(name) for name in TINY}


@pytest.fixture(params=TINY)
def tiny(request, tiny_sources):
    """(spec, model) of one tiny preset; passes copy their input, so the model may be shared."""
    src = tiny_sources[request.param]
    return src.spec, build_decoder(src.spec, src.weights)


@pytest.fixture
def plain_graph() -> onnx.ModelProto:
    """A graph none of the fusions match: x ─ Pow(3) ─ MatMul(w) ─ Add(b) ─ y."""
    g = GraphBuilder("plain")
    x = g.input("x", FLOAT, ["batch", 8])
    cube = g.op("Pow", [x, g.const(3.0, np.float32)], "Pow")
    y = g.op("MatMul", [cube, g.weight("w", np.ones((8, 4), np.float32))], "MatMul")
    y = g.op("Add", [y, g.weight("b", np.zeros(4, np.float32))], "residual")
    g.output(y, "y", FLOAT, ["batch", 4])
    return g.model()


class Checks:
    """The helpers below, handed to tests as the `checks` fixture (test modules are not a package)."""

    @staticmethod
    def op_counts(model: onnx.ModelProto) -> Counter:
        return op_counts(model)

    @staticmethod
    def node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
        return node(model, name)

    @staticmethod
    def must_keep(model: onnx.ModelProto, spec) -> None:
        assert_must_keep(model, spec)

    @staticmethod
    def same_outputs(before: onnx.ModelProto, after: onnx.ModelProto, atol: float = 1e-4) -> None:
        assert_same_outputs(before, after, atol)


@pytest.fixture
def checks() -> type[Checks]:
    return Checks


def op_counts(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.name == name)


def assert_must_keep(model: onnx.ModelProto, spec) -> None:
    """What the kv_io pass finds by name, and the graph interface, are all still there."""
    names = {n.name for n in model.graph.node}
    for name in (KEY_POSITIONS, QUERY_POSITIONS, FINAL_HIDDEN):
        assert name in names, name
    for i in range(spec.num_layers):
        for kind in ("key", "value"):
            assert past_transpose_name(i, kind) in names
            new = node(model, new_kv_name(i, kind))
            assert new.op_type == "Transpose" and list(new.attribute[0].ints) == [2, 0, 1, 3]
    assert [i.name for i in model.graph.input][:3] == ["input_ids", "position_ids", "attention_mask"]
    assert "logits" in [o.name for o in model.graph.output]


def all_outputs(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def assert_same_outputs(before: onnx.ModelProto, after: onnx.ModelProto, atol: float = 1e-4) -> None:
    """Logits and every present K/V match: the new K/V still leave in the same layout and values."""
    feeds = seeded_feeds(before)
    a, b = all_outputs(before, feeds), all_outputs(after, feeds)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], atol=atol, rtol=1e-4, err_msg=name)
