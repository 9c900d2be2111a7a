"""TrtEngine's host side on a fake device: calls, profile switches, row splits, staging, the pool
bound once and written by device copies. ONNX Runtime CPU runs the same graph where TensorRT would
(device_doubles.OrtExecution), so its logits and pool must equal the ORT engine's, step by step."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import pytest
from device_doubles import FakeDevice, OrtExecution

from kiln.contract.artifact import EngineArtifact
from kiln.contract.engine import KvLayout
from kiln.compiler.backends.gpu.compare import probe_steps
from kiln.engines.gpu.kv_copy import DevicePool, copy_new_kv, token_runs
from kiln.engines.gpu.profiles import plan_profiles
from kiln.engines.ort.kv_pool import KvPool
from kiln.compiler.backends.gpu.onnx_files import save_onnx, with_weights_inline
from kiln.engines.ort.engine import OrtEngine
from kiln.compiler.backends.tensorrt.graph import in_precision, kv_dtype
from kiln.engines.tensorrt.calls import plan_trt_calls
from kiln.engines.tensorrt.engine import TrtEngine

NUM_BLOCKS = 16


def test_token_runs_join_adjacent_tokens_only():
    rows = np.array([0, 0, 0, 0, 1, 1, 2])
    cols = np.array([0, 1, 2, 3, 0, 1, 0])
    slots = np.array([30, 31, 32, 8, 40, 41, 41])
    assert token_runs(rows, cols, slots) == [(0, 0, 30, 3), (0, 3, 8, 1), (1, 0, 40, 2), (2, 0, 41, 1)]
    assert token_runs(np.array([]), np.array([]), np.array([])) == []


def test_device_copies_write_the_slots_kv_pool_writes():
    layout = KvLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)
    rng = np.random.default_rng(0)
    batch, seq = 3, 5
    new_kv = rng.standard_normal((6, 2, batch, seq, 8)).astype(np.float32)
    rows = np.array([0, 0, 0, 0, 0, 1, 2, 2])
    cols = np.array([0, 1, 2, 3, 4, 0, 0, 1])
    slots = np.array([13, 14, 15, 20, 21, 3, 30, 31])
    host = KvPool(layout, 10)
    host.write(new_kv, rows, cols, slots)
    device = FakeDevice()
    pool = DevicePool(layout, 10, device.alloc(host.nbytes))
    src = device.alloc(new_kv.nbytes)
    device.upload(src, new_kv)
    assert copy_new_kv(device, pool, src, batch, seq, rows, cols, slots) == 4   # 13-15, 20-21, 3, 30-31
    np.testing.assert_array_equal(device.view(pool.address, host.data.shape, np.float32), host.data)
    assert pool.cache_address(1, 1) == pool.address + host.data[:1].nbytes + host.data[1, :1].nbytes


def _long_prefill(vocab: int, block_size: int) -> list:
    """Eight sequences of 20 new tokens: one [8, 24] call that a 64-token cap splits into rows."""
    from kiln.contract.engine import PagedBatch

    rng = np.random.default_rng(3)
    n, lens = 8, 20
    tables = [np.array([100 + 2 * b, 101 + 2 * b]) - 100 + 0 for b in range(n)]
    pos = np.tile(np.arange(lens), n)
    slots = np.concatenate([t[np.arange(lens) // block_size] * block_size + np.arange(lens) % block_size
                            for t in tables])
    return [PagedBatch(rng.integers(0, vocab, n * lens), pos, np.full(n, lens), np.zeros(n, np.int64),
                       tables, slots, np.arange(lens - 1, n * lens, lens))]


@pytest.fixture(params=["fp32", "fp16"])
def engines(request, tiny_llama_standard_artifact, tmp_path):
    """A TrtEngine and an OrtEngine over the same graph file: the artifact's, or its fp16 version
    (the graph a --precision fp16 build gives TensorRT, with an fp16 pool)."""
    artifact = EngineArtifact.load(tiny_llama_standard_artifact)
    m = artifact.manifest
    record = m.engines[0]
    graph, layout = artifact.path / record["file"], m.kv_layout
    if request.param == "fp16":
        model = with_weights_inline(onnx.load(graph))
        graph, _ = save_onnx(in_precision(model, "fp16"), tmp_path)
        layout = replace(layout, dtype=kv_dtype("fp16"))
    profiles = plan_profiles(m.buckets, m.kv_layout.block_size, m.generation["max_model_len"], NUM_BLOCKS,
                             max_tokens=64)
    trt_record = {"io": record["io"], "profiles": [p.to_dict() for p in profiles]}
    device = FakeDevice()
    context = OrtExecution(graph, device, {"logits": np.float32, "new_kv": np.dtype(layout.dtype)})
    trt = TrtEngine(context, trt_record, m.buckets, layout, device, m.spec.vocab_size)
    ort = OrtEngine(graph, m.buckets, layout)
    for e in (trt, ort):
        e.allocate_kv(NUM_BLOCKS)
    return trt, ort, device, m


def test_trt_engine_matches_the_ort_engine_step_by_step(engines):
    trt, ort, device, m = engines
    steps = probe_steps(m.spec.vocab_size, m.kv_layout.block_size) + _long_prefill(m.spec.vocab_size, 16)
    for step in steps:
        got, want = trt.execute(step), ort.execute(step)
        np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        pool = device.view(trt.pool.address, ort.pool.data.shape, ort.pool.data.dtype)
        np.testing.assert_allclose(pool, ort.pool.data, rtol=1e-5, atol=1e-6)
    # the 8-row prefill, split by rows: a 64-token cap leaves prefill-s9-128 one row of up to 128
    assert got.calls == 8
    assert trt.context.profiles[0] == 3   # the first step, a 19-token prefill, took a prefill profile


def test_profile_switches_only_when_the_call_needs_another(engines):
    trt, _, _, m = engines
    steps = probe_steps(m.spec.vocab_size, m.kv_layout.block_size)
    for step in steps:
        trt.execute(step)
    names = [trt.profiles[i].name for i in trt.context.profiles]
    # prefill (19 + 5 tokens, grouped by length), then both decode steps in one decode profile
    assert names[-1] == "decode-b1-4" and names.count("decode-b1-4") == 1


@pytest.mark.parametrize("max_tokens, calls, rows", [(64, 8, 1), (256, 4, 2), (8192, 1, 8)])
def test_row_split_calls_cover_every_token_and_logit_once(tiny_llama_standard_artifact, max_tokens, calls, rows):
    m = EngineArtifact.load(tiny_llama_standard_artifact).manifest
    profiles = plan_profiles(m.buckets, 16, m.generation["max_model_len"], NUM_BLOCKS, max_tokens=max_tokens)
    [step] = _long_prefill(m.spec.vocab_size, 16)
    planned = plan_trt_calls(step, m.buckets, 16, profiles)
    assert len(planned) == calls and all(c.shape == (rows, 24) for c in planned)
    assert {profiles[c.profile].name for c in planned} == {"prefill-s9-128"}
    slots = np.sort(np.concatenate([c.call.slots for c in planned]))
    np.testing.assert_array_equal(slots, np.sort(step.slot_mapping))
    order = np.sort(np.concatenate([c.call.logit_order for c in planned]))
    np.testing.assert_array_equal(order, np.arange(len(step.logits_indices)))


def test_allocate_kv_twice_or_too_large_is_refused(engines):
    trt, _, device, m = engines
    with pytest.raises(RuntimeError, match="called once"):
        trt.allocate_kv(4)
    fresh = TrtEngine(trt.context, {"io": trt.io, "profiles": [p.to_dict() for p in trt.profiles]}, m.buckets,
                      trt.kv_layout, device, m.spec.vocab_size)
    with pytest.raises(ValueError, match=f"built for a pool of at most {NUM_BLOCKS} blocks.*--kv-cache-memory"):
        fresh.allocate_kv(NUM_BLOCKS + 1)


def _every_position(vocab: int, block_size: int) -> list:
    """A perplexity-style prefill: logits at all 19 positions, more than a call's logits are planned for."""
    from kiln.contract.engine import PagedBatch

    n = 19
    table = np.array([3, 5])
    slots = table[np.arange(n) // block_size] * block_size + np.arange(n) % block_size
    ids = np.random.default_rng(5).integers(0, vocab, n)
    return [PagedBatch(ids, np.arange(n), np.array([n]), np.array([0]), [table], slots, np.arange(n))]


def test_a_call_reading_more_logits_than_planned_runs_once_per_slice(engines):
    """The same tokens again for each further slice of positions: same logits, same pool."""
    from kiln.engines.gpu.profiles import MAX_LOGITS_POSITIONS

    trt, ort, device, m = engines
    [step] = _every_position(m.spec.vocab_size, m.kv_layout.block_size)
    planned = plan_trt_calls(step, m.buckets, 16, trt.profiles)
    assert len(planned) == -(-19 // MAX_LOGITS_POSITIONS)
    assert all(c.call.feeds["logits_index"].shape[1] <= MAX_LOGITS_POSITIONS for c in planned)
    got, want = trt.execute(step), ort.execute(step)
    np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    pool = device.view(trt.pool.address, ort.pool.data.shape, ort.pool.data.dtype)
    np.testing.assert_allclose(pool, ort.pool.data, rtol=1e-5, atol=1e-6)
