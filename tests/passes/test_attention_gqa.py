"""The paged graph's GroupQueryAttention core (passes/attention_gqa.py) against a plain numpy
attention: a random pool read through shuffled block tables, ragged pasts (0, one short of a block,
on a block boundary, one past it), GQA ratios 4:1, 3:1 and 1:1, sliding windows, softcap and a
custom scale; every call planned by the ORT planner from one PagedBatch that mixes decodes, first
chunks and chunks that continue a sequence, as the engine runs it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import pytest

from kiln.contract.engine import BucketGrid, PagedBatch
from kiln.engines.ort.batching import call_groups, plan_calls
from kiln.engines.ort.session import cpu_session
from kiln.compiler.export.graph_builder import FLOAT, INT64, GraphBuilder
from kiln.contract.model_spec import ModelSpec
from kiln.compiler.passes.attention_gqa import attention_node, gather_past, shared_inputs

BLOCK = 4
# (past_len, new tokens) per sequence: decodes at block edges and with no past, first chunks of
# different lengths (batched together, padded), chunks continuing across block boundaries.
SEQUENCES = [(0, 7), (0, 3), (3, 1), (4, 1), (5, 1), (0, 1), (13, 5), (8, 8), (2, 11), (21, 1), (0, 6)]


def small_spec(heads: int, kv_heads: int, head_dim: int = 8, **kw) -> ModelSpec:
    return ModelSpec(family="llama", vocab_size=16, hidden_size=heads * head_dim, num_layers=1, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=8, rms_norm_eps=1e-6,
                     rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=False,
                     attention_bias=False, **kw)


def attention_graph(spec: ModelSpec, scale: float | None) -> onnx.ModelProto:
    """q/k/v [B,S,·] + past_lens, block_tables and one layer's pool -> the core's output, built by the
    same functions the kv_io pass uses."""
    b = GraphBuilder("gqa-core")
    q = b.input("q", FLOAT, ["batch", "seq", spec.num_heads * spec.head_dim])
    k = b.input("k", FLOAT, ["batch", "seq", spec.num_kv_heads * spec.head_dim])
    v = b.input("v", FLOAT, ["batch", "seq", spec.num_kv_heads * spec.head_dim])
    b.input("past_lens", INT64, ["batch"])
    b.input("block_tables", INT64, ["batch", "max_blocks"])
    for kind in ("key", "value"):
        b.input(f"{kind}_cache.0", FLOAT, [spec.num_kv_heads, "num_blocks", BLOCK, spec.head_dim])
    shared = shared_inputs(b, spec, BLOCK, new_tokens="q")
    past = (gather_past(b, spec, 0, "key", shared), gather_past(b, spec, 0, "value", shared))
    out = attention_node(b, spec, 0, q, k, v, past, shared, scale)
    b.output(out, "out", FLOAT, ["batch", "seq", spec.num_heads * spec.head_dim])
    return b.model()


class Scene:
    """A paged batch over a random pool, with each sequence's full K/V history kept aside."""

    def __init__(self, spec: ModelSpec, sequences: list[tuple[int, int]], seed: int = 0):
        rng = np.random.default_rng(seed)
        kvh, hd = spec.num_kv_heads, spec.head_dim
        counts = [-(-(p + n) // BLOCK) for p, n in sequences]
        num_blocks = sum(counts) + 2
        ids = rng.permutation(num_blocks)[: sum(counts)]
        self.tables = np.split(ids.astype(np.int64), np.cumsum(counts)[:-1])
        self.pool = {kind: rng.standard_normal((kvh, num_blocks, BLOCK, hd), dtype=np.float32)
                     for kind in ("key", "value")}
        total = sum(n for _, n in sequences)
        self.q = rng.standard_normal((total, spec.num_heads, hd), dtype=np.float32)
        self.new = {kind: rng.standard_normal((total, kvh, hd), dtype=np.float32) for kind in ("key", "value")}
        spans = [np.arange(p, p + n) for p, n in sequences]
        slots = np.concatenate([t[s // BLOCK] * BLOCK + s % BLOCK for t, s in zip(self.tables, spans)])
        self.batch = PagedBatch(
            input_ids=np.zeros(total, np.int64), positions=np.concatenate(spans).astype(np.int64),
            query_lens=np.array([n for _, n in sequences], np.int64),
            past_lens=np.array([p for p, _ in sequences], np.int64), block_tables=self.tables,
            slot_mapping=slots.astype(np.int64), logits_indices=np.arange(total, dtype=np.int64))

    def history(self, seq: int, kind: str) -> np.ndarray:
        """[kvh, past + new, hd]: the past read from the pool through the table, then the new tokens."""
        past = int(self.batch.past_lens[seq])
        pos = np.arange(past)
        old = self.pool[kind][:, self.tables[seq][pos // BLOCK], pos % BLOCK]
        lo = self.batch.seq_starts[seq]
        new = self.new[kind][lo:lo + self.batch.query_lens[seq]].transpose(1, 0, 2)
        return np.concatenate([old, new], axis=1)


def reference(spec: ModelSpec, scene: Scene, scale: float) -> np.ndarray:
    """[T, heads, hd]: plain attention of every new token over its sequence's history."""
    out = np.zeros_like(scene.q, dtype=np.float64)
    group = spec.num_heads // spec.num_kv_heads
    for seq, (lo, past) in enumerate(zip(scene.batch.seq_starts, scene.batch.past_lens)):
        keys, values = scene.history(seq, "key"), scene.history(seq, "value")
        key_pos = np.arange(keys.shape[1])
        for t in range(int(scene.batch.query_lens[seq])):
            query_pos = past + t
            visible = key_pos <= query_pos
            if spec.sliding_window:
                visible &= query_pos - key_pos < spec.sliding_window
            for h in range(spec.num_heads):
                scores = keys[h // group].astype(np.float64) @ scene.q[lo + t, h] * scale
                if spec.attn_softcap:
                    scores = spec.attn_softcap * np.tanh(scores / spec.attn_softcap)
                p = np.exp(np.where(visible, scores, -np.inf) - scores[visible].max())
                out[lo + t, h] = (p / p.sum()) @ values[h // group]
    return out


def run_planned(spec: ModelSpec, scene: Scene, scale: float | None) -> tuple[np.ndarray, int]:
    """[T, heads, hd] from the graph, one ORT call per planned call; and the number of calls."""
    session = cpu_session(attention_graph(spec, scale).SerializeToString())
    packed_index = {int(s): n for n, s in enumerate(scene.batch.slot_mapping)}
    out = np.zeros_like(scene.q)
    calls = plan_calls(scene.batch, BucketGrid(), BLOCK, chunks_with_past_alone=True)
    for call in calls:
        tokens = np.array([packed_index[int(s)] for s in call.slots])
        b, s = call.feeds["input_ids"].shape
        feeds = {"past_lens": call.feeds["past_lens"], "block_tables": call.feeds["block_tables"],
                 "key_cache.0": scene.pool["key"], "value_cache.0": scene.pool["value"]}
        for name, data in (("q", scene.q), ("k", scene.new["key"]), ("v", scene.new["value"])):
            padded = np.zeros((b, s, data.shape[1] * data.shape[2]), np.float32)
            padded[call.rows, call.cols] = data[tokens].reshape(len(tokens), -1)
            feeds[name] = padded
        result = session.run(["out"], feeds)[0]
        out[tokens] = result[call.rows, call.cols].reshape(len(tokens), spec.num_heads, spec.head_dim)
    return out, len(calls)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 2), (4, 4)])
def test_core_matches_numpy_on_a_mixed_batch(heads, kv_heads):
    spec = small_spec(heads, kv_heads)
    scene = Scene(spec, SEQUENCES)
    mine, num_calls = run_planned(spec, scene, None)
    np.testing.assert_allclose(mine, reference(spec, scene, spec.head_dim ** -0.5), atol=2e-6, rtol=1e-5)
    # the five decodes in one call, the three first chunks (7, 6, 3 tokens) in one, three continuing chunks alone
    assert num_calls == 5


@pytest.mark.parametrize("variant", [dict(sliding_window=5), dict(attn_softcap=2.0),
                                     dict(query_pre_attn_scalar=2.0), dict(head_dim=64)])
def test_core_matches_numpy_with_family_options(variant):
    head_dim = variant.pop("head_dim", 8)
    spec = small_spec(6, 2, head_dim, **variant)
    scene = Scene(spec, SEQUENCES, seed=1)
    scale = spec.query_scale if spec.query_pre_attn_scalar else None
    mine, _ = run_planned(spec, scene, scale)
    np.testing.assert_allclose(mine, reference(spec, scene, spec.query_scale), atol=2e-6, rtol=1e-5)


def test_window_matters_here():
    """The window above hides keys the full attention sees (so that parametrization tests it)."""
    spec = small_spec(6, 2)
    scene = Scene(spec, SEQUENCES, seed=1)
    full = reference(spec, scene, spec.query_scale)
    windowed = reference(replace(spec, sliding_window=5), scene, spec.query_scale)
    assert np.abs(full - windowed).max() > 0.1


def test_planner_keeps_to_what_the_op_takes():
    """Each call is all decodes, all first chunks (tables of width 0) or one continuing chunk."""
    scene = Scene(small_spec(4, 2), SEQUENCES)
    groups = call_groups(scene.batch, chunks_with_past_alone=True)
    lens, past = scene.batch.query_lens, scene.batch.past_lens
    continuing = {i for i in range(len(lens)) if lens[i] > 1 and past[i] > 0}
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    assert {g[0] for g in groups if set(g) & continuing} == continuing
    assert all(len(g) == 1 for g in groups if set(g) & continuing)
    for call in plan_calls(scene.batch, BucketGrid(), BLOCK, chunks_with_past_alone=True):
        width, seq = call.feeds["block_tables"].shape[1], call.feeds["input_ids"].shape[1]
        batch = call.feeds["input_ids"].shape[0]
        assert seq == 1 or width == 0 or batch == 1
    # the standard core's plan is unchanged: length groups only, tables at least one block wide
    assert call_groups(scene.batch) == call_groups(scene.batch, chunks_with_past_alone=False)
    assert all(c.feeds["block_tables"].shape[1] >= 1 for c in plan_calls(scene.batch, BucketGrid(), BLOCK))
