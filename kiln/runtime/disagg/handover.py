"""A prompt's KV blocks in a shared-memory segment, from the prefill worker's pool to the decode
worker's. The segment holds the blocks of every layer, K and V, in the pool's own layout
([layers, 2, kv_heads, blocks, block_size, head_dim]); the decode side copies them into the blocks
its KV manager allocated and unlinks the segment.

NOTE: Python 3.11's resource tracker would unlink a segment when the process that made (or
opened) it exits, and warn; the segment's life is ours to manage (the decode side, or the
coordinator when a request fails), so the maker unregisters it from its tracker; a process that
opens one to unlink it registers and unregisters it in the same breath (unlink does).

Every segment of one DisaggregatedLLM is named `kiln-kv-<session>-…` (session_prefix): the
coordinator unlinks every segment of its session when a worker fails, at shutdown and when it is
collected or the interpreter exits, so segments whose handover was never read (still in a pipe,
or written by a worker that died before sending it) are not left in /dev/shm either.

A handover comes from another process: the decode side checks it (check_handover) before it maps
anything. A segment outside its session's prefix is never opened or unlinked; a shape or dtype
that is not its own pool's layout for that prompt, a segment smaller than the shape, or a first
token outside the vocabulary ends that request with an error, never the worker.
"""

from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import numpy as np

SEGMENT_PREFIX = "kiln-kv-"
SHM_DIR = "/dev/shm"              # where Linux lists POSIX shared memory (the sweep reads it)
_SEGMENT_NAME = re.compile(r"[A-Za-z0-9_-]{1,200}")


def session_prefix(session: str) -> str:
    """The segment-name prefix of one coordinator's handovers."""
    if not _SEGMENT_NAME.fullmatch(session):
        raise ValueError(f"a session tag is letters, digits, '-' and '_', got {session!r}")
    return f"{SEGMENT_PREFIX}{session}-"


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


def export_blocks(engine, block_ids: list[int], request_id: str, prompt_ids, first_token: int,
                  prefix: str = SEGMENT_PREFIX) -> Handover:
    blocks = pool_of(engine)[:, :, :, block_ids]          # a copy: the pool's blocks are freed next
    segment = shared_memory.SharedMemory(create=True, size=max(blocks.nbytes, 1),
                                         name=f"{prefix}{uuid.uuid4().hex[:20]}")
    _untrack(segment)
    try:
        np.ndarray(blocks.shape, blocks.dtype, buffer=segment.buf)[...] = blocks
    except BaseException:
        segment.close()
        segment.unlink()
        raise
    segment.close()
    return Handover(request_id, tuple(prompt_ids), first_token, segment.name, blocks.shape, blocks.dtype.str)


def check_handover(handover, pool: np.ndarray, block_size: int, vocab_size: int, prefix: str) -> str | None:
    """What is wrong with a peer's handover for this pool, or None. Nothing is mapped or unlinked."""
    if not isinstance(handover, Handover):
        return "not a handover"
    if not owned_segment(handover.segment, prefix):
        return f"segment {handover.segment!r} is not one of this session's ({prefix}*)"
    n = len(handover.prompt_ids)
    expected = (*pool.shape[:3], -(-n // block_size), *pool.shape[4:])
    shape = tuple(handover.shape) if isinstance(handover.shape, (tuple, list)) else None
    if n == 0 or shape is None or shape != expected:
        return f"shape {handover.shape!r} is not this pool's layout for {n} prompt tokens {expected}"
    if handover.dtype != pool.dtype.str:
        return f"dtype {handover.dtype!r} is not the pool's {pool.dtype.str!r}"
    if not isinstance(handover.first_token, int) or not 0 <= handover.first_token < vocab_size:
        return f"first token {handover.first_token!r} is outside the vocabulary ({vocab_size})"
    return None


def owned_segment(name, prefix: str) -> bool:
    """Whether `name` is a segment of the session `prefix` names (and nothing else: no path)."""
    return isinstance(name, str) and name.startswith(prefix) and _SEGMENT_NAME.fullmatch(name) is not None


def import_blocks(engine, block_ids: list[int], handover: Handover) -> None:
    """Copy the segment into `block_ids` of the engine's pool, then unlink it (even on failure).
    The handover's shape was checked (check_handover); a segment smaller than it raises ValueError."""
    segment = shared_memory.SharedMemory(name=handover.segment)
    try:
        need = int(np.prod(handover.shape)) * np.dtype(handover.dtype).itemsize
        if segment.size < need:
            raise ValueError(f"segment {handover.segment} holds {segment.size} bytes, the shape needs {need}")
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


def sweep(prefix: str) -> list[str]:
    """Unlink every segment whose name starts with `prefix` (one session's), read or not; the
    names unlinked. Where the system does not list its segments, nothing."""
    if not prefix.startswith(SEGMENT_PREFIX) or len(prefix) <= len(SEGMENT_PREFIX):
        raise ValueError(f"a sweep needs a session's prefix, got {prefix!r}")
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:
        return []
    unlinked = []
    for name in names:
        try:
            segment = shared_memory.SharedMemory(name=name)
        except (FileNotFoundError, ValueError):
            continue
        segment.close()
        try:
            segment.unlink()
            unlinked.append(name)
        except FileNotFoundError:
            pass
    return unlinked


def _untrack(segment: shared_memory.SharedMemory) -> None:
    resource_tracker.unregister(segment._name, "shared_memory")   # noqa: SLF001 (see the module's NOTE)
