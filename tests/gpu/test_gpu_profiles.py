"""TensorRT optimization profiles planned from the bucket grid: every grid shape lands in a profile,
decode and prefill get their own ranges, and prefill activations stay under the token cap."""

from __future__ import annotations

import pytest

from kiln.contract.engine import BucketGrid
from kiln.engines.gpu.profiles import (MAX_LOGITS_POSITIONS, Profile, plan_profiles, select_profile,
                                      split_ranges)

GRID = BucketGrid()
IO = {"input_ids": ["batch", "seq"], "past_lens": ["batch"], "block_tables": ["batch", "max_blocks"],
      "logits_index": ["batch", "logits_positions"], "key_cache.0": [3, "num_blocks", 16, 64]}
POOL = 5000                 # blocks the build's --kv-cache-memory holds


def test_split_ranges_keeps_each_range_within_the_ratio():
    assert split_ranges([1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64], 4) == [
        [1, 2, 3, 4], [6, 8, 10, 12, 16, 20, 24], [28, 32, 40, 48, 56, 64]]
    assert split_ranges([16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512], 8) == [
        [16, 24, 32, 48, 64, 96, 128], [160, 192, 256, 320, 384, 448, 512]]


def test_default_grid_plan():
    profiles = plan_profiles(GRID, block_size=16, max_model_len=2048, pool_blocks=POOL, max_tokens=8192)
    assert [p.name for p in profiles] == ["decode-b1-4", "decode-b6-24", "decode-b28-64",
                                          "prefill-s9-128", "prefill-s129-512"]
    assert profiles[0].dims["batch"] == (1, 3, 4) and profiles[0].dims["seq"] == (1, 1, 8)
    assert profiles[3].dims["seq"] == (9, 48, 128) and profiles[3].dims["batch"] == (1, 1, 64)
    assert profiles[4].dims["batch"] == (1, 1, 16)          # 16 x 512 = 8192 tokens
    assert profiles[4].dims["max_blocks"] == (1, 64, 128)


def test_the_pool_dimension_is_the_pool_the_build_was_given():
    """The engine binds the whole pool every call: its block count is tuned (opt) and bounded (max)
    at the pool --kv-cache-memory gives, not at a bound far above it."""
    for p in plan_profiles(GRID, 16, 2048, pool_blocks=POOL):
        assert p.dims["num_blocks"] == (1, POOL, POOL)


def test_logits_are_planned_for_the_positions_a_call_reads():
    """One position per sequence when serving, a few with drafts: no profile sizes its logits for a
    whole prefill chunk."""
    profiles = plan_profiles(GRID, 16, 2048, pool_blocks=POOL)
    assert {p.dims["logits_positions"] for p in profiles} == {(1, 1, MAX_LOGITS_POSITIONS)}
    vocab = 49152
    logits = max(p.dims["batch"][2] * p.dims["logits_positions"][2] * vocab for p in profiles)
    assert logits == 64 * MAX_LOGITS_POSITIONS * vocab       # the largest decode batch, every draft read


@pytest.mark.parametrize("max_tokens", [512, 8192])
def test_every_grid_shape_gets_a_profile_within_the_token_cap(max_tokens):
    profiles = plan_profiles(GRID, 16, 2048, POOL, max_tokens)
    for b in GRID.batch_sizes:
        for s in GRID.seq_lens:
            sizes = {"batch": b, "seq": s, "max_blocks": 40, "logits_positions": 1}
            index, rows = select_profile(profiles, sizes)
            p = profiles[index]
            assert p.covers({**sizes, "batch": rows}) and 1 <= rows <= b
            assert p.name.startswith("decode" if s <= 8 else "prefill")
            if p.name.startswith("prefill"):
                assert p.dims["batch"][2] * p.dims["seq"][2] <= max(max_tokens, p.dims["seq"][2])


def test_select_prefers_the_tightest_covering_profile_and_splits_only_when_needed():
    profiles = plan_profiles(GRID, 16, 2048, POOL, max_tokens=8192)
    dims = {"max_blocks": 2, "logits_positions": 1}
    assert select_profile(profiles, {"batch": 2, "seq": 1, **dims}) == (0, 2)
    assert select_profile(profiles, {"batch": 64, "seq": 1, **dims}) == (2, 64)
    assert select_profile(profiles, {"batch": 40, "seq": 256, **dims}) == (4, 16)   # 40 rows -> 16 + 16 + 8


def test_a_shape_no_profile_covers_is_refused():
    profiles = plan_profiles(GRID, 16, 256, POOL)
    with pytest.raises(ValueError, match="no optimization profile covers"):
        select_profile(profiles, {"batch": 1, "seq": 1, "max_blocks": 17, "logits_positions": 1})


def test_input_shapes_fill_min_opt_max_per_input_and_round_trip():
    p = plan_profiles(GRID, 16, 2048, POOL)[0]
    shapes = p.input_shapes(IO)
    assert shapes["input_ids"] == ([1, 1], [3, 1], [4, 8])
    assert shapes["key_cache.0"] == ([3, 1, 16, 64], [3, POOL, 16, 64], [3, POOL, 16, 64])
    assert Profile.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="no range for dimension 'vocab'"):
        p.input_shapes({"x": ["vocab"]})
