"""Prompt block hashes the router compares with what replicas hold.

The ingress hashes a prompt's full blocks exactly as the KV manager does (the same chain hash,
the same salt on the first block), so a hash the router sees names the very block a replica's
prefix cache holds. A replica reports a bounded summary: the leading hashes of the prompts it
served most recently, kept only while its prefix cache still holds them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence

from kiln.runtime.kv_manager import hash_block_tokens

MAX_ROUTING_BLOCKS = 64          # leading blocks of a prompt the router looks at
SUMMARY_BLOCKS = 4096            # hashes one replica reports (16 bytes each)


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None,
                        max_blocks: int = MAX_ROUTING_BLOCKS) -> tuple[int, ...]:
    """Chain hashes of the prompt's leading full blocks (the KV manager's own chain). NOTE: like
    the prefix cache, the block holding the prompt's last token is never a hit, so it is left out."""
    hashes, parent = [], None
    num_blocks = min((len(token_ids) - 1) // block_size, max_blocks) if token_ids else 0
    for i in range(num_blocks):
        extra = ("cache_salt", salt) if i == 0 and salt is not None else None
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        hashes.append(parent)
    return tuple(hashes)


def matched_blocks(hashes: Sequence[int], held: Container[int]) -> int:
    """How many of the leading hashes `held` has, up to the first miss."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


class RecentPrefixes:
    """The block hashes of recently served prompts, most recent last, at most `capacity` hashes."""

    def __init__(self, capacity: int = SUMMARY_BLOCKS):
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def add(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def summary(self, cached: Container[int]) -> list[int]:
        """Those the prefix cache still holds (evicted blocks drop out), most recent last."""
        kept = [h for h in self._hashes if h in cached]
        if len(kept) < len(self._hashes):
            self._hashes = OrderedDict.fromkeys(kept)
        return kept

    def count_with(self, others: frozenset[int]) -> int:
        """How many distinct hashes these and `others` (a set) hold together."""
        return len(others) + sum(1 for h in self._hashes if h not in others)

    def has(self, h: int) -> bool:
        return h in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)
