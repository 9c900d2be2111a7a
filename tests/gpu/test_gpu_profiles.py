"""TensorRT optimization profiles planned from the bucket grid: every grid shape lands in a profile,
decode and prefill get their own ranges, and prefill activations stay under the token cap."""

from __future__ import annotations

import pytest

from kiln.contract.engine import BucketGrid
from kiln.engines.gpu.profiles import MAX_KV_BLOCKS, Profile, plan_profiles, select_profile, split_ranges

GRID = BucketGrid()
IO = {"input_ids": ["batch", "seq"], "past_lens": ["batch"], "block_tables": ["batch", "max_blocks"],
      "logits_index": ["batch", "logits_positions"], "key_cache.0": [3, "num_blocks", 16, 64]}


def test_split_ranges_keeps_each_range_within_the_ratio():
    assert split_ranges([1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64], 4) == [
        [1, 2, 3, 4], [6, 8, 10, 12, 16, 20, 24], [28, 32, 40, 48, 56, 64]]
    assert split_ranges([16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512], 8) == [
        [16, 24, 32, 48, 64, 96, 128], [160, 192, 256, 320, 384, 448, 512]]


def test_default_grid_plan():
    profiles = plan_profiles(GRID, block_size=16, max_model_len=2048, max_tokens=8192)
    assert [p.name for p in profiles] == ["decode-b1-4", "decode-b6-24", "decode-b28-64",
                                          "prefill-s9-128", "prefill-s129-512"]
    assert profiles[0].dims["batch"] == (1, 3, 4) and profiles[0].dims["seq"] == (1, 1, 8)
    assert profiles[3].dims["seq"] == (9, 48, 128) and profiles[3].dims["batch"] == (1, 1, 64)
    assert profiles[4].dims["batch"] == (1, 1, 16)          # 16 x 512 = 8192 tokens
    assert profiles[4].dims["max_blocks"] == (1, 64, 128)
    assert profiles[4].dims["num_blocks"] == (1, MAX_KV_BLOCKS, MAX_KV_BLOCKS)


@pytest.mark.parametrize("max_tokens", [512, 8192])
def test_every_grid_shape_gets_a_profile_within_the_token_cap(max_tokens):
    profiles = plan_profiles(GRID, 16, 2048, max_tokens)
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
    profiles = plan_profiles(GRID, 16, 2048, max_tokens=8192)
    dims = {"max_blocks": 2, "logits_positions": 1}
    assert select_profile(profiles, {"batch": 2, "seq": 1, **dims}) == (0, 2)
    assert select_profile(profiles, {"batch": 64, "seq": 1, **dims}) == (2, 64)
    assert select_profile(profiles, {"batch": 40, "seq": 256, **dims}) == (4, 16)   # 40 rows -> 16 + 16 + 8


def test_the_pool_block_count_keeps_a_layer_cache_under_int32_volume():
    smollm2 = 3 * 16 * 64                                   # kv heads x block x head dim
    [p, *_] = plan_profiles(GRID, 16, 8192, block_elements=smollm2)
    assert p.dims["num_blocks"][2] == (2**31 - 1) // smollm2 == 699050
    assert plan_profiles(GRID, 16, 8192, block_elements=1)[0].dims["num_blocks"][2] == MAX_KV_BLOCKS


def test_a_shape_no_profile_covers_is_refused():
    profiles = plan_profiles(GRID, 16, 256)
    with pytest.raises(ValueError, match="no optimization profile covers"):
        select_profile(profiles, {"batch": 1, "seq": 1, "max_blocks": 17, "logits_positions": 1})


def test_input_shapes_fill_min_opt_max_per_input_and_round_trip():
    p = plan_profiles(GRID, 16, 2048)[0]
    shapes = p.input_shapes(IO)
    assert shapes["input_ids"] == ([1, 1], [3, 1], [4, 8])
    assert shapes["key_cache.0"] == ([3, 1, 16, 64], [3, MAX_KV_BLOCKS, 16, 64], [3, MAX_KV_BLOCKS, 16, 64])
    assert Profile.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="no range for dimension 'vocab'"):
        p.input_shapes({"x": ["vocab"]})
