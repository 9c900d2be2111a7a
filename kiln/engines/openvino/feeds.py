"""PagedBatch -> the paged-attention inputs of the OpenVINO model (cheap numpy, int32 where the op wants it).

Per step the runtime hands B sequences' new tokens packed into T rows. OpenVINO's operation takes
vLLM's flat form: where each sequence's tokens start (`subsequence_begins`), all block tables
concatenated (`block_indices`) with their starts (`block_indices_begins`), and each sequence's
cached length (`past_lens`); it derives every new token's slot from those itself, so the runtime's
`slot_mapping` is implied, not sent.
"""

from __future__ import annotations

import numpy as np

from kiln.contract.engine import PagedBatch


def paged_feeds(batch: PagedBatch, block_size: int, num_blocks: int) -> dict[str, np.ndarray]:
    """The op reads blocks unchecked: a short table or a block id outside the cache raises here."""
    past = np.asarray(batch.past_lens, np.int32)
    context = past + np.asarray(batch.query_lens, np.int32)
    # NOTE: a table may hold blocks reserved beyond this step's tokens; the op must see exactly
    # ceil(context / block_size) blocks per sequence.
    needed = -(-context // block_size)
    have = np.fromiter((len(t) for t in batch.block_tables), np.int64, len(batch.block_tables))
    if (have < needed).any():
        b = int(np.argmax(have < needed))
        raise ValueError(f"sequence {b}: block table has {have[b]} blocks, {past[b]}+{context[b] - past[b]} "
                         f"tokens need {needed[b]}")
    blocks = np.concatenate([t[:n] for t, n in zip(batch.block_tables, needed)]).astype(np.int32) \
        if len(needed) else np.zeros(0, np.int32)
    if len(blocks) and (blocks.min() < 0 or blocks.max() >= num_blocks):
        raise ValueError(f"a block id is out of range [0, {num_blocks})")
    block_begins = np.zeros(len(needed) + 1, np.int32)
    np.cumsum(needed, out=block_begins[1:])
    return {
        "input_ids": np.ascontiguousarray(batch.input_ids, np.int64),
        "position_ids": np.ascontiguousarray(batch.positions, np.int64),
        "past_lens": past,
        "subsequence_begins": batch.seq_starts.astype(np.int32),
        "block_indices": blocks,
        "block_indices_begins": block_begins,
        "max_context_len": np.array(context.max() if len(context) else 0, np.int32),
        "logits_indices": np.ascontiguousarray(batch.logits_indices, np.int64),
    }
