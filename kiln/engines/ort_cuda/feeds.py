"""PagedBatch -> the inputs of the ort-cuda graph (PagedAttention's own: int32 lengths, a block
table padded with -1, the slot of every new token). The op reads blocks unchecked on the GPU, so
short tables and out-of-range ids are refused here."""

from __future__ import annotations

import numpy as np

from kiln.contract.engine import PagedBatch


def cuda_feeds(batch: PagedBatch, block_size: int, num_blocks: int) -> dict[str, np.ndarray]:
    past = np.asarray(batch.past_lens, np.int32)
    context = past + np.asarray(batch.query_lens, np.int32)
    needed = -(-context // block_size)
    table = np.full((batch.num_seqs, max(1, int(needed.max(initial=0)))), -1, np.int32)
    for b, (blocks, n) in enumerate(zip(batch.block_tables, needed)):
        if len(blocks) < n:
            raise ValueError(f"sequence {b}: block table has {len(blocks)} blocks, {context[b]} tokens need {n}")
        table[b, :n] = blocks[:n]
    if ((table >= num_blocks) | (table < -1)).any():
        raise ValueError(f"a block id is out of range [0, {num_blocks})")
    slots = np.asarray(batch.slot_mapping, np.int64)
    if len(slots) and (slots.min() < 0 or slots.max() >= num_blocks * block_size):
        raise ValueError(f"a slot is out of range [0, {num_blocks * block_size})")
    return {
        "input_ids": np.ascontiguousarray(batch.input_ids, np.int64),
        "position_ids": np.ascontiguousarray(batch.positions, np.int64),
        "cumulative_sequence_length": batch.seq_starts.astype(np.int32),
        "past_seqlens": past,
        "block_table": table,
        "slot_mapping": slots.astype(np.int32),
        "logits_indices": np.ascontiguousarray(batch.logits_indices, np.int64),
    }
