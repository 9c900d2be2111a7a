"""The KV block pool's memory: one numpy array the engine reads through per-layer views.

Layout [layers, 2 (k/v), kv_heads, num_blocks, block_size, head_dim]: each layer's K and V pool is
a contiguous slice, so it binds to the engine without a copy; the new tokens' K/V of all layers
land in their slots with one vectorised write.
"""

from __future__ import annotations

import numpy as np

from kiln.engines.base import KvLayout


class KvPool:
    def __init__(self, layout: KvLayout, num_blocks: int):
        self.layout, self.num_blocks = layout, num_blocks
        self.data = np.zeros(layout.pool_shape(num_blocks), dtype=layout.dtype)
        L, _, kvh, nb, bs, hd = self.data.shape
        # [2L, kvh, slots, hd] view: slot = block_id * block_size + offset
        self._slots = self.data.reshape(2 * L, kvh, nb * bs, hd)
        self.feeds = {f"{kind}_cache.{i}": self.data[i, k]
                      for i in range(L) for k, kind in enumerate(("key", "value"))}

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def write(self, new_kv: np.ndarray, rows: np.ndarray, cols: np.ndarray, slots: np.ndarray) -> None:
        """new_kv [2L, kvh, B, S, hd]; token n of the step is new_kv[:, :, rows[n], cols[n]] -> slot slots[n]."""
        self._slots[:, :, slots, :] = new_kv[:, :, rows, cols, :]
