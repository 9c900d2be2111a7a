"""The KV block pool's memory: one numpy array the engine reads through per-layer views.

Layout [layers, 2 (k/v), kv_heads, num_blocks, block_size, head_dim]: each layer's K and V pool is
a contiguous slice, so it binds to the engine without a copy; the new tokens' K/V of all layers
land in their slots with one vectorised write.

An int8 pool (`kiln build --kv-dtype int8`) keeps, beside the values, one fp32 scale per token and
head ([..., block_size, 1]): symmetric, scale = max|x| / 127 over the head's head_dim values, so a
token's K or V is rounded to within half a step of its own largest value; the graph widens the
values and multiplies the scales back after gathering (passes/kv_io.py).
"""

from __future__ import annotations

import numpy as np

from kiln.contract.engine import KvLayout

INT8_MAX = 127.0


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., head_dim] float -> (int8 values, fp32 scales [..., 1]); an all-zero row gets scale 1."""
    scale = np.abs(x).max(-1, keepdims=True) / INT8_MAX
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    return np.rint(x / scale).astype(np.int8), scale


class KvPool:
    def __init__(self, layout: KvLayout, num_blocks: int):
        self.layout, self.num_blocks = layout, num_blocks
        self.data = np.zeros(layout.pool_shape(num_blocks), dtype=layout.dtype)
        L, _, kvh, nb, bs, hd = self.data.shape
        # [2L, kvh, slots, hd] view: slot = block_id * block_size + offset
        self._slots = self.data.reshape(2 * L, kvh, nb * bs, hd)
        self.feeds = {f"{kind}_cache.{i}": self.data[i, k]
                      for i in range(L) for k, kind in enumerate(("key", "value"))}
        self.scales = None
        if layout.dtype == "int8":
            self.scales = np.ones((*self.data.shape[:-1], 1), np.float32)
            self._scale_slots = self.scales.reshape(2 * L, kvh, nb * bs, 1)
            self.feeds |= {f"{kind}_scale.{i}": self.scales[i, k]
                           for i in range(L) for k, kind in enumerate(("key", "value"))}

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.scales.nbytes if self.scales is not None else 0)

    def write(self, new_kv: np.ndarray, rows: np.ndarray, cols: np.ndarray, slots: np.ndarray) -> None:
        """new_kv [2L, kvh, B, S, hd]; token n of the step is new_kv[:, :, rows[n], cols[n]] -> slot slots[n]."""
        tokens = new_kv[:, :, rows, cols, :]
        if self.scales is None:
            self._slots[:, :, slots, :] = tokens
            return
        values, scales = quantize_rows(tokens)
        self._slots[:, :, slots, :] = values
        self._scale_slots[:, :, slots, :] = scales
