import numpy as np
import onnx
from onnx import helper, numpy_helper

from kiln.compiler.passes.base import run_pass
from kiln.compiler.passes.cleanup import CleanupPass
from kiln.compiler.passes.verify import compare_logits


def test_cleanup_keeps_a_fresh_decoder_graph_working(tiny, checks):
    spec, model = tiny
    out, report = run_pass(CleanupPass(), model, compare_logits)
    assert report.max_rel_error <= 1e-5
    checks.must_keep(out, spec)
    checks.same_outputs(model, out, atol=1e-6)
    assert {(o.domain, o.version) for o in out.opset_import} == {("", 21), ("com.microsoft", 1)}
    # The weights' data survive the round trip through graphsurgeon.
    before = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    after = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    assert before.keys() == after.keys()
    assert all(np.array_equal(before[k], after[k]) for k in before)


def _with_dead_and_foldable(model: onnx.ModelProto) -> onnx.ModelProto:
    """Add a dead branch and a constant-only chain feeding the logits through a no-op Add."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    g.initializer.extend([numpy_helper.from_array(np.array([1.0], np.float32), "/test/one"),
                          numpy_helper.from_array(np.array([-1.0], np.float32), "/test/minus_one")])
    logits_id = next(n for n in g.node if n.name == "/outputs/logits")
    g.node.extend([
        helper.make_node("Neg", ["/model/embed_tokens_output_0"], ["/test/dead"], name="/test/Dead"),
        helper.make_node("Add", ["/test/one", "/test/minus_one"], ["/test/zero"], name="/test/Zero"),
        helper.make_node("Add", [logits_id.input[0], "/test/zero"], ["/test/logits"], name="/test/AddZero"),
    ])
    logits_id.input[0] = "/test/logits"
    g.node.remove(logits_id)
    g.node.append(logits_id)
    return m


def test_cleanup_removes_dead_nodes_and_folds_constants(tiny, checks):
    spec, model = tiny
    dirty = _with_dead_and_foldable(model)
    cleanup = CleanupPass()
    out, report = run_pass(cleanup, dirty, compare_logits)
    names = {n.name for n in out.graph.node}
    assert "/test/Dead" not in names and "/test/Zero" not in names   # dead, and folded into a constant
    assert cleanup.details()["nodes_removed"] == 2
    checks.must_keep(out, spec)


def test_cleanup_leaves_a_plain_graph_unchanged(plain_graph):
    cleanup = CleanupPass()
    out = cleanup.run(plain_graph)
    assert [n.name for n in out.graph.node] == [n.name for n in plain_graph.graph.node]
    assert cleanup.details()["nodes_removed"] == 0
