"""Bucket grid, KV layout arithmetic and the pool's slot writes (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.config import RuntimeConfig
from kiln.contract.engine import Bucket, BucketGrid, KvLayout
from kiln.engines.ort.kv_pool import KvPool
from kiln.runtime.memory import plan_kv_blocks


def test_bucket_rounds_up_and_refuses_beyond_the_grid():
    grid = BucketGrid(batch_sizes=(1, 4, 8), seq_lens=(1, 16, 64))
    assert grid.bucket_for(3, 17) == Bucket(4, 64)
    assert grid.bucket_for(1, 1) == Bucket(1, 1)
    with pytest.raises(ValueError, match="batch 9 exceeds the largest bucket 8"):
        grid.bucket_for(9, 1)
    assert BucketGrid.from_dict(grid.to_dict()) == grid


def test_kv_layout_bytes_match_smollm2():
    layout = KvLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)
    assert layout.bytes_per_token == 46_080          # K+V, 30 layers, fp32: the map's 46 KB
    assert layout.bytes_per_block == 16 * 46_080


def test_plan_from_budget():
    layout = KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16)   # 8 KiB per block
    plan = plan_kv_blocks(layout, RuntimeConfig(kv_cache_memory=1 << 20), context_len=256)
    assert (plan.num_blocks, plan.num_tokens, plan.num_sequences) == (128, 2048, 8)
    assert "128 blocks = 2,048 tokens = 8 sequences at context 256" in plan.describe()
    with pytest.raises(ValueError, match="holds no block"):
        plan_kv_blocks(layout, RuntimeConfig(kv_cache_memory=100), context_len=256)


def test_pool_write_lands_each_token_in_its_slot():
    layout = KvLayout(num_layers=2, num_kv_heads=2, head_dim=3, block_size=4)
    pool = KvPool(layout, num_blocks=5)
    rng = np.random.default_rng(0)
    new_kv = rng.normal(size=(4, 2, 2, 3, 3)).astype(np.float32)     # [2L, kvh, B=2, S=3, hd]
    rows, cols = np.array([0, 0, 1]), np.array([0, 1, 0])
    slots = np.array([9, 10, 3])                                     # block 2 offsets 1,2; block 0 offset 3
    pool.write(new_kv, rows, cols, slots)
    for n, (b, s, slot) in enumerate(zip(rows, cols, slots)):
        block, offset = divmod(slot, 4)
        for layer in range(2):
            for kv, kind in enumerate(("key", "value")):
                got = pool.feeds[f"{kind}_cache.{layer}"][:, block, offset]
                np.testing.assert_array_equal(got, new_kv[2 * layer + kv, :, b, s])
    assert np.count_nonzero(pool.data) == 3 * 2 * 2 * 2 * 3          # nothing else written
    assert all(v.base is pool.data or v.base is pool.data.base for v in pool.feeds.values())


def test_a_cache_with_per_token_scales_plans_with_its_real_block_bytes():
    values = KvLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=32, dtype="uint8")
    with_scales = KvLayout(30, 3, 64, 32, "uint8", block_bytes=30 * 14_592)
    assert values.bytes_per_block == 30 * 12_288 and with_scales.bytes_per_block == 30 * 14_592
    budget = RuntimeConfig(kv_cache_memory=100 * 30 * 14_592)
    assert plan_kv_blocks(with_scales, budget, context_len=256).num_blocks == 100
