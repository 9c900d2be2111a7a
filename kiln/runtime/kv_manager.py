"""Paged KV-cache manager: one block table per request, over a shared pool with prefix caching.

Block tables hold integer block ids only; the runner turns them into the engine's inputs.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kiln.runtime.block_pool import Block, BlockPool
from kiln.runtime.request import Request


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], extra_keys=None) -> int:
    """Chain hash of one full block. A keyed digest, not hash(): prompts come from users, and a
    collision would serve one request another's KV."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"\0" if parent_hash is None else b"\1" + parent_hash.to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra_keys is not None:
        h.update(b"\2" + repr(extra_keys).encode())
    return int.from_bytes(h.digest(), "little")


@dataclass
class KVCacheStats:
    num_blocks: int
    used: int
    free: int
    cached: int                 # free blocks still holding a hash
    evictions: int
    allocation_failures: int
    prefix_queries: int         # tokens looked up in the prefix cache
    prefix_hits: int            # tokens found there

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclass(frozen=True, eq=False)
class PrefixCacheView:
    """The prefix cache's block hashes at one moment, immutable: the engine client publishes it
    so other threads (admission control) ask what a prompt would hit without touching the pool.
    NOTE: eq=False, compared by identity: one view serves until the cache changes."""
    block_size: int = 1
    hashes: frozenset[int] = frozenset()

    def cached_prefix_tokens(self, token_ids: Sequence[int], salt: str | None = None) -> int:
        """What get_computed_blocks would have hit, when the view was taken, for a prompt of these tokens."""
        if not self.hashes:
            return 0
        hashes = _chain_hashes(token_ids, self.block_size, salt)
        return len(_leading_hits(hashes, len(token_ids), self.block_size, self.hashes)) * self.block_size


@dataclass
class _RequestBlocks:
    blocks: list[Block] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)   # chain hashes of the full blocks, grown as tokens come
    num_cached: int = 0                               # leading blocks already offered to the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._requests: dict[str, _RequestBlocks] = {}
        self.allocation_failures = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._view, self._view_version = PrefixCacheView(block_size), self.pool.cache_version

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """The longest run of cached full blocks that prefixes the request's tokens."""
        if not self.enable_caching:
            return [], 0
        hits = self._cached_run(self._hashes(request), request.num_tokens)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def cached_prefix_tokens(self, token_ids: Sequence[int], salt: str | None = None) -> int:
        """What get_computed_blocks would hit for a prompt of these tokens, read without changing
        any state. NOTE: the pool's thread only; other threads ask a prefix_view()."""
        if not self.enable_caching:
            return 0
        hashes = _chain_hashes(token_ids, self.block_size, salt)
        return len(self._cached_run(hashes, len(token_ids))) * self.block_size

    def computed_by_another(self, request: Request, prefilling: Iterable[Request]) -> bool:
        """Whether the first block of `request` past its cached run is one a request of
        `prefilling` (admitted, its prompt not computed yet) will compute and cache: a burst of
        prompts that share a prefix (a system prompt) would otherwise compute it once each.
        Reads the pool without changing it (no hit is counted)."""
        if not self.enable_caching:
            return False
        hashes = self._hashes(request)
        # NOTE: not capped at the request's last token (get_computed_blocks is): a cached block
        # the request must compute itself anyway is no reason to wait.
        first_miss = len(self._cached_run(hashes, (len(hashes) + 1) * self.block_size))
        if first_miss >= len(hashes):
            return False
        wanted = hashes[first_miss]
        for other in prefilling:
            entry = self._requests.get(other.request_id)
            if entry is not None and wanted in entry.hashes[entry.num_cached:]:
                return True
        return False

    def prefix_view(self) -> PrefixCacheView:
        """The prefix cache's hashes now, as an immutable view; rebuilt only after they changed.
        NOTE: a copy of every cached hash: O(cached blocks) whenever the cache changed."""
        if self._view_version != self.pool.cache_version:
            self._view = PrefixCacheView(self.block_size, frozenset(self.pool.cached))
            self._view_version = self.pool.cache_version
        return self._view

    def _cached_run(self, hashes: Iterable[int], num_tokens: int) -> list[Block]:
        """The cached blocks of the leading hashes, up to the first miss."""
        cached = self.pool.cached
        return [cached[h] for h in _leading_hits(hashes, num_tokens, self.block_size, cached)]

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[Block] = ()) -> bool:
        """Grow the block table to cover the computed, newly hit and new tokens.
        All or nothing: on False no block changed hands."""
        entry = self._requests.get(request.request_id) or _RequestBlocks()
        num_tokens = (request.num_computed_tokens + len(new_computed_blocks) * self.block_size
                      + num_new_tokens)
        num_needed = max(0, -(-num_tokens // self.block_size) - len(entry.blocks)
                         - len(new_computed_blocks))
        # Hits on free blocks leave the free list when touched, so they cannot also be new blocks.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_revived:
            self.allocation_failures += 1
            return False
        self.pool.touch(new_computed_blocks)
        if new_computed_blocks:
            # NOTE: hits come only at admission, onto an empty table: they are cached already.
            # (Raising num_cached on every call would skip blocks that decodes fill later.)
            entry.blocks += new_computed_blocks
            entry.num_cached = max(entry.num_cached, len(entry.blocks))
        entry.blocks += self.pool.get_new_blocks(num_needed)
        self._requests[request.request_id] = entry
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Offer the request's blocks that are full of computed tokens to the prefix cache.

        NOTE: called after a step has run, never at allocation: the engine writes a step's K/V
        after attention, so a block hashed at allocation could be hit, in the same step, by
        another request that would then read it unwritten."""
        entry = self._requests.get(request.request_id)
        if not self.enable_caching or entry is None:
            return
        hashes = self._hashes(request)
        # NOTE: bounded by the tokens too: a stop token among accepted proposals ends the
        # tokens before the computed count.
        num_full = min(request.num_computed_tokens // self.block_size, len(entry.blocks), len(hashes))
        for i in range(entry.num_cached, num_full):
            self.pool.cache_full_block(entry.blocks[i], hashes[i])
        entry.num_cached = max(entry.num_cached, num_full)

    def trim(self, request: Request) -> None:
        """Free the tail blocks past the request's computed tokens: speculative decoding's
        rollback, after rejected proposals. NOTE: such a block holds no computed token, so it
        was never offered to the prefix cache; the rejected K/V in kept blocks lies past
        num_computed_tokens and is overwritten before any hash covers it."""
        entry = self._requests.get(request.request_id)
        if entry is None:
            return
        keep = -(-request.num_computed_tokens // self.block_size)
        if len(entry.blocks) > keep:
            tail, entry.blocks = entry.blocks[keep:], entry.blocks[:keep]
            self.pool.free_blocks(reversed(tail))

    def free(self, request: Request) -> None:
        entry = self._requests.pop(request.request_id, None)
        if entry is not None:
            self.pool.free_blocks(reversed(entry.blocks))

    def block_table(self, request_id: str) -> list[int]:
        entry = self._requests.get(request_id)
        return [b.block_id for b in entry.blocks] if entry else []

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    def stats(self) -> KVCacheStats:
        free = self.pool.num_free_blocks
        return KVCacheStats(
            num_blocks=self.num_blocks, used=self.num_blocks - free, free=free,
            cached=self.pool.num_cached_free_blocks, evictions=self.pool.evictions,
            allocation_failures=self.allocation_failures,
            prefix_queries=self.prefix_queries, prefix_hits=self.prefix_hits)

    def _hashes(self, request: Request) -> list[int]:
        """Chain hashes of every full block of the request's tokens, extending the stored chain."""
        entry = self._requests.setdefault(request.request_id, _RequestBlocks())
        tokens, size = request.all_token_ids, self.block_size
        for i in range(len(entry.hashes), len(tokens) // size):
            parent = entry.hashes[-1] if entry.hashes else None
            entry.hashes.append(hash_block_tokens(parent, tokens[i * size:(i + 1) * size],
                                                  _salt_keys(request) if i == 0 else None))
        return entry.hashes


def _salt_keys(request: Request):
    # The salt keys the first block only: every later hash chains from it.
    salt = getattr(request.sampling_params, "cache_salt", None)
    return None if salt is None else ("cache_salt", salt)


def _chain_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> Iterator[int]:
    """Chain hashes of the full blocks of token_ids, computed as they are read."""
    parent = None
    for i in range(len(token_ids) // block_size):
        extra = ("cache_salt", salt) if i == 0 and salt is not None else None
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        yield parent


def _leading_hits(hashes: Iterable[int], num_tokens: int, block_size: int, cached: Container[int]) -> list[int]:
    """The leading hashes found in `cached`, up to the first miss. Capped one token short: the
    last token must be computed to produce logits."""
    hits = []
    for _, block_hash in zip(range((num_tokens - 1) // block_size), hashes):
        if block_hash not in cached:
            break
        hits.append(block_hash)
    return hits
