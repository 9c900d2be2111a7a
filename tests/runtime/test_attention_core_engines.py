"""The ORT engine with either attention core of the paged graph (passes/kv_io.py): the
GroupQueryAttention core (the default) and the standard unfused one (what every artifact built
before it has) give the same logits and write the same pool on one batch that mixes decodes, first
chunks and chunks continuing a sequence; each records its layout and plans its calls by its core."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.artifact import EngineArtifact
from kiln.build import build
from kiln.config import BuildConfig
from kiln.engines.base import PagedBatch
from kiln.engines.factory import load_engine

# (past_len, new tokens): decodes at and off block edges, first chunks, continuing chunks
SEQUENCES = [(0, 9), (0, 4), (15, 1), (16, 1), (40, 1), (0, 1), (16, 7), (21, 30), (3, 2)]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("attention-cores")
    return {core: build(BuildConfig(source="tiny-llama", out=root / core, attention=core))
            for core in ("gqa", "standard")}


def _mixed_batch(block_size: int, num_blocks: int, seed: int = 0) -> PagedBatch:
    rng = np.random.default_rng(seed)
    counts = [-(-(p + n) // block_size) for p, n in SEQUENCES]
    tables = np.split(rng.permutation(num_blocks)[: sum(counts)].astype(np.int64), np.cumsum(counts)[:-1])
    spans = [np.arange(p, p + n, dtype=np.int64) for p, n in SEQUENCES]
    total = sum(n for _, n in SEQUENCES)
    return PagedBatch(input_ids=rng.integers(0, 256, total).astype(np.int64), positions=np.concatenate(spans),
                      query_lens=np.array([n for _, n in SEQUENCES], np.int64),
                      past_lens=np.array([p for p, _ in SEQUENCES], np.int64), block_tables=tables,
                      slot_mapping=np.concatenate([t[s // block_size] * block_size + s % block_size
                                                   for t, s in zip(tables, spans)]),
                      logits_indices=np.arange(total, dtype=np.int64))


def _run(artifact, pool: np.ndarray, batch: PagedBatch):
    engine = load_engine(EngineArtifact.load(artifact))
    engine.allocate_kv(pool.shape[3])
    engine.pool.data[...] = pool
    result = engine.execute(batch)
    return engine, result, engine.pool.data.copy()


def test_both_cores_agree_on_a_mixed_batch(artifacts):
    layout = EngineArtifact.load(artifacts["gqa"]).manifest.kv_layout
    num_blocks = 64
    # a pool of plausible K/V: a first pass of the same batch's tokens would do too; random is harsher
    pool = np.random.default_rng(1).standard_normal((layout.num_layers, 2, layout.num_kv_heads, num_blocks,
                                                      layout.block_size, layout.head_dim)).astype(np.float32)
    batch = _mixed_batch(layout.block_size, num_blocks)
    gqa, fused, fused_pool = _run(artifacts["gqa"], pool, batch)
    standard, unfused, unfused_pool = _run(artifacts["standard"], pool, batch)
    assert gqa.chunks_with_past_alone and not standard.chunks_with_past_alone
    np.testing.assert_allclose(fused.logits, unfused.logits, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(fused_pool, unfused_pool, atol=1e-5)
    assert not np.array_equal(fused_pool, pool)                     # the new tokens' K/V were written
    # GQA: the decodes, the two first chunks (9 and 4 tokens: two length groups), the three continuing
    # chunks alone; standard: the decodes and the chunks in length groups [30], [9, 7], [4, 2]
    assert (fused.calls, unfused.calls) == (6, 4)


def test_manifest_records_the_layout(artifacts):
    passes = {core: EngineArtifact.load(a).manifest.passes for core, a in artifacts.items()}
    layouts = {core: next(p for p in ps if p["name"] == "kv_io")["details"]["layout"] for core, ps in passes.items()}
    assert layouts == {"gqa": "paged-gqa", "standard": "paged-gather"}


def test_unknown_core_is_refused():
    from kiln.passes.kv_io import KvIoPass
    from kiln.export.sources import load_source

    with pytest.raises(ValueError, match="attention core"):
        KvIoPass(load_source("tiny-llama").spec, attention="flash")
