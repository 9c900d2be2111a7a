"""The Engine protocol every backend implements, and the shapes it is compiled for."""

from __future__ import annotations

import bisect
import os
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np


def default_threads() -> int:
    """Engine threads when the user sets none: the CPUs this process may use."""
    # NOTE: physical cores would be better; os.sched_getaffinity respects container limits.
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


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
    # Bytes a block really takes in the backend's cache, all layers, when that is more than the
    # values (a u8 cache keeps each token's scale and zero point beside them); 0: just the values.
    block_bytes: int = 0

    @property
    def bytes_per_token(self) -> int:
        if self.block_bytes:
            return -(-self.block_bytes // self.block_size)
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * np.dtype(self.dtype).itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.block_bytes or self.bytes_per_token * self.block_size

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_kv_heads, num_blocks, self.block_size, self.head_dim)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class PagedBatch:
    """One engine call over a paged KV cache: the new tokens of B sequences, packed (no padding).

    Backend-neutral: it names what a paged-attention kernel reads (vLLM's and OpenVINO's inputs),
    so an engine that pads to buckets (ONNX Runtime) and one that packs (a native kernel) take
    the same batch. NOTE: block_tables[b] covers past and new tokens of sequence b.
    """
    input_ids: np.ndarray              # int64 [T]  new tokens of all sequences, concatenated
    positions: np.ndarray              # int64 [T]  absolute position of each new token
    query_lens: np.ndarray             # int64 [B]  new tokens per sequence (sum = T)
    past_lens: np.ndarray              # int64 [B]  tokens already in the KV cache per sequence
    block_tables: list[np.ndarray]     # B arrays of int64 block ids
    slot_mapping: np.ndarray           # int64 [T]  block_id * block_size + offset of each new token
    logits_indices: np.ndarray         # int64 [N]  packed token indices whose logits are wanted
    # int64 [B]  of each sequence's new tokens, how many at the end are proposals (speculative
    # decoding); None: none are. An engine with engines per bucket range serves a verification
    # on the engine that would serve the decode alone, so greedy output keeps its rounding.
    num_proposed: np.ndarray | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def proposal_slots(self) -> np.ndarray:
        """The KV slots of the proposed tokens (empty when there are none)."""
        if self.num_proposed is None or not self.num_proposed.any():
            return np.empty(0, np.int64)
        ends = self.seq_starts[1:]
        mask = np.zeros(self.num_tokens, bool)
        for end, n in zip(ends, self.num_proposed):
            mask[end - n:end] = True
        return self.slot_mapping[mask]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def seq_starts(self) -> np.ndarray:
        """[B+1] offsets of each sequence's first new token in the packed arrays."""
        return np.concatenate([[0], np.cumsum(self.query_lens)])


@dataclass
class EngineResult:
    logits: np.ndarray                 # float32 [N, vocab], in logits_indices order
    padded_tokens: int = 0             # computed and thrown away (bucket padding)
    calls: int = 1                     # backend calls this batch took


class Engine(Protocol):
    """What the runtime needs from a backend. The engine owns its KV storage: the runtime's KV
    manager hands out integer block ids, and execute() writes each new token's K/V into its slot."""
    buckets: BucketGrid
    kv_layout: KvLayout

    def io_spec(self) -> dict[str, list]: ...

    def allocate_kv(self, num_blocks: int) -> None: ...

    def execute(self, batch: PagedBatch) -> EngineResult: ...
