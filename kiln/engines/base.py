"""The Engine protocol every backend implements, and the shapes it is compiled for."""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Bucket:
    batch: int
    seq: int


@dataclass(frozen=True)
class BucketGrid:
    """Batch sizes x new-token counts an engine is built for; the runner pads up to the next one."""
    # Fine steps: ORT runs any shape, so padding is pure waste there; TensorRT would compile one
    # optimization profile per range instead.
    batch_sizes: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64)
    seq_lens: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)

    def bucket_for(self, batch: int, seq: int) -> Bucket:
        return Bucket(_round_up(self.batch_sizes, batch, "batch"), _round_up(self.seq_lens, seq, "seq"))

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    @property
    def max_seq(self) -> int:
        return self.seq_lens[-1]

    def to_dict(self) -> dict:
        return {"batch_sizes": list(self.batch_sizes), "seq_lens": list(self.seq_lens)}

    @classmethod
    def from_dict(cls, d: dict) -> "BucketGrid":
        return cls(tuple(d["batch_sizes"]), tuple(d["seq_lens"]))


def _round_up(sizes: tuple[int, ...], n: int, what: str) -> int:
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        raise ValueError(f"{what} {n} exceeds the largest bucket {sizes[-1]}")
    return sizes[i]


@dataclass(frozen=True)
class KvLayout:
    """The paged KV pool an engine reads: [layers, 2, kv_heads, num_blocks, block_size, head_dim]."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float32"

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * np.dtype(self.dtype).itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_kv_heads, num_blocks, self.block_size, self.head_dim)

    def to_dict(self) -> dict:
        return asdict(self)


class Engine(Protocol):
    buckets: BucketGrid
    kv_layout: KvLayout

    def io_spec(self) -> dict[str, list]: ...

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """feeds: input_ids, position_ids, past_lens, block_tables, logits_index and the per-layer
        {key,value}_cache.{i} pool views. Returns logits [B,K,V] and new_kv [2L,kvh,B,S,hd]."""
        ...
