"""The ORT engine with either attention core of the paged graph (passes/kv_io.py): the
GroupQueryAttention core (--attention gqa) and the standard unfused one (the default, and what
every artifact built before it has) give the same logits and write the same pool on one batch that
mixes decodes, first chunks and chunks continuing a sequence, for tiny-llama and for the family
variants whose attention differs (windows, softcap, Gemma's scale, q/k norms, partial rotary); each
records its layout and plans its calls by its core."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from kiln.contract.artifact import EngineArtifact
from kiln.compiler.build import build
from kiln.config import BuildConfig
from kiln.contract.engine import PagedBatch
from kiln.engines.load import load_engine

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from model_checkpoints import write_checkpoint  # noqa: E402  (tests/models' HF checkpoint writer)

# (past_len, new tokens): decodes at and off block edges, first chunks, continuing chunks
SEQUENCES = [(0, 9), (0, 4), (15, 1), (16, 1), (40, 1), (0, 1), (16, 7), (21, 30), (3, 2)]
# the variants whose attention core differs from llama's (tests/models/model_checkpoints.py)
FAMILY_VARIANTS = ["mistral-window", "qwen2-window-some-layers", "qwen3", "gemma2", "gemma3",
                   "phi3-longrope-partial"]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return _build_both("tiny-llama", tmp_path_factory.mktemp("attention-cores"))


def _build_both(source: str, root: Path) -> dict[str, Path]:
    return {core: build(BuildConfig(source=source, out=root / core, attention=core)) for core in ("gqa", "standard")}


def _mixed_batch(block_size: int, num_blocks: int, vocab: int, seed: int = 0) -> PagedBatch:
    return _batch(SEQUENCES, block_size, num_blocks, vocab, seed)


def _batch(sequences, block_size: int, num_blocks: int, vocab: int, seed: int = 0) -> PagedBatch:
    """(past_len, new tokens) per sequence, over blocks in shuffled order; logits at every token."""
    rng = np.random.default_rng(seed)
    counts = [-(-(p + n) // block_size) for p, n in sequences]
    tables = np.split(rng.permutation(num_blocks)[: sum(counts)].astype(np.int64), np.cumsum(counts)[:-1])
    spans = [np.arange(p, p + n, dtype=np.int64) for p, n in sequences]
    total = sum(n for _, n in sequences)
    return PagedBatch(input_ids=rng.integers(3, vocab, total).astype(np.int64), positions=np.concatenate(spans),
                      query_lens=np.array([n for _, n in sequences], np.int64),
                      past_lens=np.array([p for p, _ in sequences], np.int64), block_tables=tables,
                      slot_mapping=np.concatenate([t[s // block_size] * block_size + s % block_size
                                                   for t, s in zip(tables, spans)]),
                      logits_indices=np.arange(total, dtype=np.int64))


def _run(artifact, pool: np.ndarray, batch: PagedBatch):
    engine = load_engine(EngineArtifact.load(artifact))
    engine.allocate_kv(pool.shape[3])
    engine.pool.data[...] = pool
    result = engine.execute(batch)
    return engine, result, engine.pool.data.copy()


def _run_both(artifacts: dict[str, Path], vocab: int):
    """(engine, result, pool after) per core on the same mixed batch over the same random pool."""
    layout = EngineArtifact.load(artifacts["gqa"]).manifest.kv_layout
    num_blocks = 64
    # random K/V in the pool: harsher than what the model would write, and any core difference shows
    pool = np.random.default_rng(1).standard_normal((layout.num_layers, 2, layout.num_kv_heads, num_blocks,
                                                      layout.block_size, layout.head_dim)).astype(np.float32)
    batch = _mixed_batch(layout.block_size, num_blocks, vocab)
    runs = {core: _run(artifacts[core], pool, batch) for core in ("gqa", "standard")}
    fused_pool = runs["gqa"][2]
    np.testing.assert_allclose(runs["gqa"][1].logits, runs["standard"][1].logits, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(fused_pool, runs["standard"][2], atol=1e-5)
    assert not np.array_equal(fused_pool, pool)                     # the new tokens' K/V were written
    return runs


@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_both_cores_agree_for_each_family(variant, tmp_path):
    checkpoint = write_checkpoint(variant, tmp_path / "checkpoint")
    _run_both(_build_both(str(checkpoint), tmp_path), vocab=256)


def test_both_cores_agree_on_a_mixed_batch(artifacts):
    runs = _run_both(artifacts, vocab=256)
    (gqa, fused, _), (standard, unfused, _) = runs["gqa"], runs["standard"]
    assert gqa.chunks_with_past_alone and not standard.chunks_with_past_alone
    # GQA: the decodes, the two first chunks (9 and 4 tokens: two length groups), the three continuing
    # chunks alone; standard: the decodes and the chunks in length groups [30], [9, 7], [4, 2]
    assert (fused.calls, unfused.calls) == (6, 4)


def test_manifest_records_the_layout(artifacts):
    passes = {core: EngineArtifact.load(a).manifest.passes for core, a in artifacts.items()}
    layouts = {core: next(p for p in ps if p["name"] == "kv_io")["details"]["layout"] for core, ps in passes.items()}
    assert layouts == {"gqa": "paged-gqa", "standard": "paged-gather"}


def test_unknown_core_is_refused():
    from kiln.compiler.passes.kv_io import KvIoPass
    from kiln.compiler.export.sources import load_source

    with pytest.raises(ValueError, match="attention core"):
        KvIoPass(load_source("tiny-llama").spec, attention="flash")


# Two decodes and two speculative verifications (a token and one proposal each): every call has
# fewer than 4 tokens that are not proposals, so all of them reach a hybrid artifact's decode engine.
SMALL_CALLS = [(15, 1), (16, 1), (20, 2), (33, 2)]
PROPOSED = [0, 0, 1, 1]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """--attention gqa with a prefill engine: GroupQueryAttention for the decode engine only."""
    out = tmp_path_factory.mktemp("attention-hybrid") / "gqa+fp32-prefill"
    return build(BuildConfig(source="tiny-llama", out=out, attention="gqa", prefill_engine="none"))


def test_a_prefill_engine_keeps_the_standard_core(hybrid):
    passes = EngineArtifact.load(hybrid).manifest.passes
    layouts = {p["name"]: p["details"]["layout"] for p in passes if p["name"].startswith("kv_io")}
    assert layouts == {"kv_io": "paged-gqa", "kv_io (prefill engine)": "paged-gather"}


def test_hybrid_engine_runs_batched_chunks_on_its_gqa_engine_one_per_call(hybrid, artifacts):
    """The hybrid's calls are planned for the standard core; a call that batches chunks with a past
    and reaches the GroupQueryAttention engine (which refuses it whole) runs one sequence per call."""
    layout = EngineArtifact.load(hybrid).manifest.kv_layout
    num_blocks = 32
    pool = np.random.default_rng(2).standard_normal((layout.num_layers, 2, layout.num_kv_heads, num_blocks,
                                                      layout.block_size, layout.head_dim)).astype(np.float32)
    batch = _batch(SMALL_CALLS, layout.block_size, num_blocks, vocab=256)
    batch.num_proposed = np.array(PROPOSED, np.int64)
    engine, mixed, mixed_pool = _run(hybrid, pool, batch)
    _, alone, alone_pool = _run(artifacts["standard"], pool, batch)
    assert not engine.chunks_with_past_alone and engine.gqa == [True, False]
    assert engine.calls_by_engine == [3, 0] and mixed.calls == 3     # the decodes, then each verification
    np.testing.assert_allclose(mixed.logits, alone.logits, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(mixed_pool, alone_pool, atol=1e-5)
