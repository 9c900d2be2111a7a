"""A prompt's KV blocks in a shared-memory segment, from the prefill worker's pool to the decode
worker's. The segment holds the blocks of every layer, K and V, in the pool's own layout
([layers, 2, kv_heads, blocks, block_size, head_dim]); the decode side copies them into the blocks
its KV manager allocated and unlinks the segment.

NOTE: Python 3.11's resource tracker would unlink a segment when the process that made (or
opened) it exits, and warn; the segment's life is ours to manage (the decode side, or the
coordinator when a request fails), so the maker unregisters it from its tracker; a process that
opens one to unlink it registers and unregisters it in the same breath (unlink does).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import numpy as np

SEGMENT_PREFIX = "kiln-kv-"


@dataclass(frozen=True)
class Handover:
    request_id: str
    prompt_ids: tuple[int, ...]
    first_token: int
    segment: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def num_blocks(self) -> int:
        return self.shape[3]


def pool_of(engine) -> np.ndarray:
    """The engine's KV pool as one array; the ort backend's unquantized pool only, for now."""
    pool = getattr(engine, "pool", None)
    if pool is None or getattr(pool, "scales", None) is not None or getattr(pool, "data", None) is None:
        raise ValueError("disaggregated prefill/decode hands over the ort backend's fp32/fp16 KV pool only")
    return pool.data


def export_blocks(engine, block_ids: list[int], request_id: str, prompt_ids, first_token: int) -> Handover:
    blocks = pool_of(engine)[:, :, :, block_ids]          # a copy: the pool's blocks are freed next
    segment = shared_memory.SharedMemory(create=True, size=max(blocks.nbytes, 1),
                                         name=f"{SEGMENT_PREFIX}{uuid.uuid4().hex[:20]}")
    _untrack(segment)
    try:
        np.ndarray(blocks.shape, blocks.dtype, buffer=segment.buf)[...] = blocks
    except BaseException:
        segment.close()
        segment.unlink()
        raise
    segment.close()
    return Handover(request_id, tuple(prompt_ids), first_token, segment.name, blocks.shape, blocks.dtype.str)


def import_blocks(engine, block_ids: list[int], handover: Handover) -> None:
    """Copy the segment into `block_ids` of the engine's pool, then unlink it (even on failure)."""
    segment = shared_memory.SharedMemory(name=handover.segment)
    try:
        src = np.ndarray(handover.shape, np.dtype(handover.dtype), buffer=segment.buf)
        pool_of(engine)[:, :, :, block_ids] = src
        del src                                            # no view may outlive the mapping
    finally:
        segment.close()
        segment.unlink()


def discard(handover: Handover) -> None:
    """Unlink a segment nobody will import (its request was cancelled or a worker failed)."""
    try:
        segment = shared_memory.SharedMemory(name=handover.segment)
    except FileNotFoundError:
        return
    segment.close()
    segment.unlink()


def _untrack(segment: shared_memory.SharedMemory) -> None:
    resource_tracker.unregister(segment._name, "shared_memory")   # noqa: SLF001 (see the module's NOTE)
