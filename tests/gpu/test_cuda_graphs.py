"""CUDA graphs per decode bucket, on the CPU doubles: the bookkeeping (warm-up, one capture per
key, replays, the eager fallback with its log line) and the TensorRT engine around it (padded
block-table widths, fixed addresses, page-locked staging), with logits and pool still equal to the
ort engine step by step. Whether a real capture succeeds is for the GPU (test_on_gpu.py)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from device_doubles import FakeDevice, OrtExecution

from kiln.contract.artifact import EngineArtifact
from kiln.contract.engine import PagedBatch
from kiln.engines.gpu.graphs import CaptureFailed, DecodeGraphs, pad_columns, padded_width
from kiln.engines.gpu.profiles import plan_profiles
from kiln.engines.ort.engine import OrtEngine
from kiln.engines.tensorrt.engine import TrtEngine

NUM_BLOCKS = 24


class Recorder:
    """A GraphDevice that records what it was asked to do."""

    def __init__(self, refuse=()):
        self.refuse, self.log = set(refuse), []

    def capture(self, step):
        step()
        self.log.append("capture")
        if self.log.count("capture") in self.refuse:
            raise CaptureFailed("stream capture invalidated")
        return len(self.log)

    def launch(self, graph):
        self.log.append(("launch", graph))


def test_a_key_warms_up_then_is_captured_once_then_replays():
    device, work = Recorder(), []
    graphs = DecodeGraphs(device, warmup=1)
    ran = [graphs.run("b4", lambda: work.append("eager")) for _ in range(4)]
    assert ran == ["eager", "captured", "replayed", "replayed"]
    assert work == ["eager", "eager"]                       # the warm-up, and the capturing call's own work
    assert device.log == ["capture", ("launch", 1), ("launch", 1)]


def test_calls_without_a_key_or_with_graphs_off_run_eagerly():
    device = Recorder()
    assert {DecodeGraphs(device).run(None, lambda: None) for _ in range(3)} == {"eager"}
    off = DecodeGraphs(device, enabled=False)
    assert {off.run("b4", lambda: None) for _ in range(3)} == {"eager"}
    assert device.log == []


def test_a_failed_capture_logs_once_and_leaves_only_its_key_eager(caplog):
    device = Recorder(refuse={1})
    graphs = DecodeGraphs(device, warmup=0, what="test engine")
    work = []
    with caplog.at_level(logging.WARNING, logger="kiln.engines.gpu"):
        ran = [graphs.run(key, lambda: work.append(1)) for key in ("a", "a", "a", "b", "b")]
    assert ran == ["eager", "eager", "eager", "captured", "replayed"]
    assert len(work) == 4 and graphs.stats.failed == ["a"]
    [line] = [r.getMessage() for r in caplog.records]
    assert "test engine: CUDA graph capture failed for decode bucket a" in line and "runs eagerly" in line


def test_padded_widths_give_few_shapes():
    assert [padded_width(w, 128) for w in (1, 2, 3, 5, 9, 17, 40, 65)] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert padded_width(100, 120) == 120 and padded_width(130, 128) == 130
    table = np.array([[3, 4, 5]])
    np.testing.assert_array_equal(pad_columns(table, 4, -1), [[3, 4, 5, -1]])
    assert pad_columns(table, 2, 0) is table


def _decodes(vocab: int, block_size: int, steps: int) -> list[PagedBatch]:
    """A 2-sequence prefill (19 and 5 tokens), then `steps` decode steps of both sequences."""
    rng = np.random.default_rng(1)
    tables = [np.array([7, 2, 9, 13], np.int64), np.array([4, 11, 1], np.int64)]
    past, out = [0, 0], []
    for new in [[19, 5]] + [[1, 1]] * steps:
        ids, pos, slots = [], [], []
        for b, n in enumerate(new):
            p = np.arange(past[b], past[b] + n)
            ids.append(rng.integers(0, vocab, n))
            pos.append(p)
            slots.append(tables[b][p // block_size] * block_size + p % block_size)
        out.append(PagedBatch(np.concatenate(ids), np.concatenate(pos), np.array(new), np.array(past), tables,
                              np.concatenate(slots), (np.cumsum(new) - 1).astype(np.int64)))
        past = [a + n for a, n in zip(past, new)]
    return out


@pytest.fixture
def engines(tiny_llama_standard_artifact):
    artifact = EngineArtifact.load(tiny_llama_standard_artifact)
    m = artifact.manifest
    record, graph = m.engines[0], artifact.path / m.engines[0]["file"]
    profiles = plan_profiles(m.buckets, m.kv_layout.block_size, m.generation["max_model_len"], NUM_BLOCKS)
    device = FakeDevice()
    context = OrtExecution(graph, device, {"logits": np.float32, "new_kv": np.dtype(m.kv_layout.dtype)})
    trt = TrtEngine(context, {"io": record["io"], "profiles": [p.to_dict() for p in profiles]}, m.buckets,
                    m.kv_layout, device, m.spec.vocab_size)
    ort = OrtEngine(graph, m.buckets, m.kv_layout)
    for e in (trt, ort):
        e.allocate_kv(NUM_BLOCKS)
    return trt, ort, device, m


def _run_both(trt, ort, device, steps):
    for step in steps:
        np.testing.assert_allclose(trt.execute(step).logits, ort.execute(step).logits, rtol=1e-5, atol=1e-5)
        pool = device.view(trt.pool.address, ort.pool.data.shape, ort.pool.data.dtype)
        np.testing.assert_allclose(pool, ort.pool.data, rtol=1e-5, atol=1e-6)


def test_decode_steps_replay_their_bucket_graph_with_fixed_shapes_and_addresses(engines):
    trt, ort, device, m = engines
    # 19 past tokens: 2 blocks, then 3 from the 14th decode on (width padded 2 -> 2, 3 -> 4)
    _run_both(trt, ort, device, _decodes(m.spec.vocab_size, m.kv_layout.block_size, 20))
    stats = trt.graphs.stats
    assert stats.captured == 2 and not stats.failed           # one graph per padded width
    assert stats.replayed == 20 - 2 * 2                       # each width: a warm-up and a capture first
    runs = trt.context.runs
    assert runs[0][0] is None                                 # the prefill ran eagerly
    by_graph = {}
    for graph, shapes, addresses in (r for r in runs if r[0] is not None):
        by_graph.setdefault(id(graph), []).append((shapes, addresses))
    assert len(by_graph) == 2
    for replays in by_graph.values():
        assert all(r == replays[0] for r in replays)           # the same shapes and addresses every time
    widths = sorted({replays[0][0]["block_tables"][1] for replays in by_graph.values()})
    assert widths == [2, 4]


def test_uploads_go_through_page_locked_buffers(engines):
    trt, ort, device, m = engines
    _run_both(trt, ort, device, _decodes(m.spec.vocab_size, m.kv_layout.block_size, 2))
    inputs = {trt.buffers.address[n] for n in ("input_ids", "position_ids", "past_lens", "block_tables",
                                               "logits_index")}
    staged = [array for address, array in device.uploads_from if address in inputs]
    assert staged and len(staged) % 5 == 0                    # five inputs a call
    assert all(any(np.shares_memory(a, p) for p in device.pinned) for a in staged)


def test_a_failed_capture_falls_back_to_eager_with_the_same_results(engines, caplog):
    trt, ort, device, m = engines
    device.refuse_capture = True
    with caplog.at_level(logging.WARNING, logger="kiln.engines.gpu"):
        _run_both(trt, ort, device, _decodes(m.spec.vocab_size, m.kv_layout.block_size, 6))
    assert trt.graphs.stats.replayed == 0 and trt.graphs.stats.failed and not device.launches
    assert any("CUDA graph capture failed" in r.getMessage() for r in caplog.records)


def test_graphs_off_runs_every_call_eagerly(engines):
    trt, ort, device, m = engines
    trt.graphs.enabled = False
    _run_both(trt, ort, device, _decodes(m.spec.vocab_size, m.kv_layout.block_size, 4))
    assert trt.graphs.stats.captured == 0 and all(r[0] is None for r in trt.context.runs)


# The ort-cuda engine's graphs, on ONNX Runtime CPU with the reference PagedAttention op
# (paged_attention_ref.py): ONNX Runtime's graph capture itself needs the GPU; its bookkeeping
# (keys, one binding of fixed device values per key, the graph ids, the fallback) runs here.

class Sessions:
    """The session, recording for every run whether it used a graph's binding (and which)."""

    def __init__(self, session, fail_graphs: bool = False):
        self.session, self.fail_graphs, self.runs = session, fail_graphs, []
        self.engine = None

    def __getattr__(self, name):
        return getattr(self.session, name)

    def run_with_iobinding(self, binding, options):
        graph = next((k for k, g in self.engine._graph_bindings.items() if g.binding is binding), None)
        self.runs.append(graph)
        if graph is not None and self.fail_graphs:
            raise RuntimeError("This session cannot use the graph capture feature as requested")
        return self.session.run_with_iobinding(binding, options)


@pytest.fixture
def ort_cuda_doubles(tiny_llama_standard_artifact):
    pytest.importorskip("onnxruntime_extensions")
    from dataclasses import replace

    import onnxruntime as ort
    from onnxruntime_extensions import get_library_path
    from paged_attention_ref import with_reference_op

    from kiln.compiler.backends.ort_cuda.paged_graph import paged_attention_graph
    from kiln.compiler.export.decoder_graph import build_decoder
    from kiln.compiler.export.sources import load_source
    from kiln.engines.ort_cuda.engine import OrtCudaEngine

    m = EngineArtifact.load(tiny_llama_standard_artifact).manifest
    src = load_source("tiny-llama")
    paged = with_reference_op(paged_attention_graph(build_decoder(src.spec, src.weights), src.spec))
    layout = replace(m.kv_layout, dtype="float32")          # the reference op keeps fp16 values in fp32

    def engine(fail_graphs=False):
        opts = ort.SessionOptions()
        opts.register_custom_ops_library(get_library_path())
        session = Sessions(ort.InferenceSession(paged.SerializeToString(), opts, providers=["CPUExecutionProvider"]),
                           fail_graphs)
        e = OrtCudaEngine(session, m.buckets, layout, device="cpu")
        session.engine = e
        e.allocate_kv(NUM_BLOCKS)
        return e

    return engine, m


def _ort_cuda_steps(m, steps):
    return _decodes(m.spec.vocab_size, m.kv_layout.block_size, steps)


def test_ort_cuda_decode_steps_run_on_one_fixed_binding_per_key(ort_cuda_doubles):
    make, m = ort_cuda_doubles
    graphed, eager = make(), make()
    eager.graphs.enabled = False
    for step in _ort_cuda_steps(m, 16):
        np.testing.assert_allclose(graphed.execute(step).logits, eager.execute(step).logits, rtol=1e-5, atol=1e-5)
    # context 19 + 1 .. 19 + 16 tokens: 2 blocks, then 3 (padded to 4) from position 32
    assert set(graphed._graph_bindings) == {(2, 2), (2, 4)}
    assert graphed.graphs.stats.captured == 2 and graphed.graphs.stats.replayed == 14
    assert graphed.session.runs[0] is None and all(r is not None for r in graphed.session.runs[1:])
    assert set(eager.session.runs) == {None}
    ids = {g.run_options.get_run_config_entry("gpu_graph_id") for g in graphed._graph_bindings.values()}
    assert ids == {"1", "2"}


def test_ort_cuda_values_keep_their_addresses_across_steps(ort_cuda_doubles):
    make, m = ort_cuda_doubles
    e = make()
    seen = {}
    for step in _ort_cuda_steps(m, 6):
        e.execute(step)
        for key, g in e._graph_bindings.items():
            ptrs = {n: v.data_ptr() for n, v in g.inputs.items()} | {"logits": g.logits.data_ptr()}
            assert seen.setdefault(key, ptrs) == ptrs


def test_ort_cuda_falls_back_to_eager_when_its_graph_run_fails(ort_cuda_doubles, caplog):
    make, m = ort_cuda_doubles
    failing, eager = make(fail_graphs=True), make()
    eager.graphs.enabled = False
    with caplog.at_level(logging.WARNING, logger="kiln.engines.gpu"):
        for step in _ort_cuda_steps(m, 4):
            np.testing.assert_allclose(failing.execute(step).logits, eager.execute(step).logits, rtol=1e-5, atol=1e-5)
    assert failing.graphs.stats.failed == [(2, 2)] and failing.graphs.stats.replayed == 0
    assert failing.session.runs.count((2, 2)) == 1            # tried once, then eager for good
    assert any("ort-cuda engine: CUDA graph capture failed" in r.getMessage() for r in caplog.records)


def test_a_graph_onnx_runtime_will_not_capture_gets_a_session_without_graphs(monkeypatch, tmp_path, caplog):
    """ONNX Runtime refuses CUDA graphs for a graph with nodes left on the CPU: the session is made
    without them, with a log line, and the engine then runs every step eagerly."""
    from kiln.engines.ort_cuda import engine

    made = []

    class Session:
        def __init__(self, path, opts, providers):
            options = providers[0][1]
            if options.get("enable_cuda_graph") == "1":
                raise RuntimeError("This session cannot use the CUDA Graph feature as requested by the user as "
                                   "all compute graph nodes have not been partitioned to the CUDA EP.")
            made.append(options)

        def get_providers(self):
            return [engine.CUDA]

        def get_provider_options(self):
            return {engine.CUDA: {k: str(v) for k, v in made[-1].items()}}

    monkeypatch.setattr(engine.ort, "get_available_providers", lambda: [engine.CUDA, "CPUExecutionProvider"])
    monkeypatch.setattr(engine.ort, "preload_dlls", lambda **kw: None, raising=False)
    monkeypatch.setattr(engine.ort, "InferenceSession", Session)
    with caplog.at_level(logging.WARNING, logger="kiln.engines.gpu"):
        session = engine.cuda_session(tmp_path / "model.onnx")
    assert made == [{"device_id": 0}] and not engine.has_cuda_graphs(session)
    assert any("no CUDA graphs for this graph" in r.getMessage() for r in caplog.records)
