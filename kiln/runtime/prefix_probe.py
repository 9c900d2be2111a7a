"""How much of a prompt the prefix cache holds, asked before the request reaches the engine
(admission control, on the HTTP event loop), without changing the KV manager's state.

A prompt the engine has seen (a shared system prompt, a conversation's earlier turns, a retried
request) prefills only its uncached tail; a TTFT prediction that counts every prompt token is
pessimistic by the cached share, and refuses requests that would have been quick.

NOTE: an estimate read across threads. The block pool's hash map may change under it (a dict
lookup is atomic, the answer may be a step old): a block evicted between this probe and the
prefill makes the prediction optimistic by one block, which admission's calibration learns.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.runtime.kv_manager import KVCacheManager, hash_block_tokens


def cached_prefix_tokens(kv: KVCacheManager, token_ids: Sequence[int]) -> int:
    """Leading prompt tokens in full cached blocks, capped one token short as the scheduler caps
    a hit (KVCacheManager.get_computed_blocks: the last token is computed for its logits)."""
    if not kv.enable_caching:
        return 0
    size, parent, hits = kv.block_size, None, 0
    for i in range((len(token_ids) - 1) // size):
        parent = hash_block_tokens(parent, token_ids[i * size:(i + 1) * size])
        if kv.pool.get_cached_block(parent) is None:
            break
        hits += 1
    return hits * size
