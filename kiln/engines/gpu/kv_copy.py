"""The new tokens' K/V into their pool slots, on the device, as strided 2-D copies.

The gather graph (passes/kv_io.py) returns new_kv [2L, kvh, B, S, hd]; the pool is
[L, 2, kvh, num_blocks, block_size, hd], i.e. 2L*kvh planes of num_blocks*block_size slots. A token
run (consecutive columns of one row going to consecutive slots: a prefill chunk inside its blocks)
is one rectangle, `width` = run x hd values, `height` = 2L*kvh planes, with each side's plane
pitch, so one cudaMemcpy2DAsync moves it for every layer, key and value at once:

    new_kv plane p:  [ b0: s0 s1 ... | b1: s0 ... ]      pitch B*S*hd
                              ╲ run (row b0, cols 0..n) ╲
    pool   plane p:  [ slot 0 ... | slot k ... k+n ... ] pitch num_blocks*block_size*hd

A decode step of B sequences is B copies; a 512-token chunk in 16-token blocks is at most 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.contract.engine import KvLayout
from kiln.engines.gpu.device import DeviceMemory


@dataclass(frozen=True)
class DevicePool:
    """The KV pool in device memory: one allocation, in KvPool's layout (engines/ort/kv_pool.py)."""
    layout: KvLayout
    num_blocks: int
    address: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.layout.pool_shape(self.num_blocks))) * self.itemsize

    @property
    def itemsize(self) -> int:
        return np.dtype(self.layout.dtype).itemsize

    @property
    def plane_bytes(self) -> int:
        return self.num_blocks * self.layout.block_size * self.layout.head_dim * self.itemsize

    def cache_address(self, layer: int, kind: int) -> int:
        """Start of key_cache.{layer} (kind 0) or value_cache.{layer} (kind 1): [kvh, nb, bs, hd]."""
        return self.address + (2 * layer + kind) * self.layout.num_kv_heads * self.plane_bytes


def token_runs(rows: np.ndarray, cols: np.ndarray, slots: np.ndarray) -> list[tuple[int, int, int, int]]:
    """(row, col, slot, length) of each maximal run of tokens that are adjacent on both sides."""
    if len(rows) == 0:
        return []
    rows, cols, slots = (np.asarray(a, np.int64) for a in (rows, cols, slots))
    joined = (rows[1:] == rows[:-1]) & (cols[1:] == cols[:-1] + 1) & (slots[1:] == slots[:-1] + 1)
    starts = np.flatnonzero(np.concatenate([[True], ~joined]))
    lengths = np.diff(np.concatenate([starts, [len(rows)]]))
    return [(int(rows[s]), int(cols[s]), int(slots[s]), int(n)) for s, n in zip(starts, lengths)]


def copy_new_kv(device: DeviceMemory, pool: DevicePool, new_kv: int, batch: int, seq: int,
                rows: np.ndarray, cols: np.ndarray, slots: np.ndarray) -> int:
    """Copy new_kv (device address, [2L, kvh, batch, seq, hd]) into the pool; returns the copy count."""
    kv = pool.layout
    token_bytes = kv.head_dim * pool.itemsize
    planes = 2 * kv.num_layers * kv.num_kv_heads
    runs = token_runs(rows, cols, slots)
    for row, col, slot, n in runs:
        device.copy_2d(dst=pool.address + slot * token_bytes, dst_pitch=pool.plane_bytes,
                       src=new_kv + (row * seq + col) * token_bytes, src_pitch=batch * seq * token_bytes,
                       width=n * token_bytes, height=planes)
    return len(runs)
