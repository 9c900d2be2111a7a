"""A PagedBatch as ONNX Runtime feeds: padded [B, S] calls on the bucket grid.

The ORT graph (passes/kv_io.py) takes padded rows, so decodes and prefill chunks go in separate
calls (a decode is never padded to a chunk's length) and chunks are grouped by length. A graph
whose attention core is GroupQueryAttention (passes/attention_gqa.py) also takes a chunk that
continues a sequence (S > 1 with a past) only at batch 1, so each such chunk gets a call of its own;
first chunks (no past) still batch, with block tables of width 0 (the op reads a call without a
past buffer as first prompts), and so do decodes. Prefill is compute-bound: the extra calls cost
their dispatch, not their work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from kiln.contract.engine import BucketGrid, EngineResult, PagedBatch

MAX_PADDING = 0.25      # a prefill group may waste at most this share of its [B, S] slots
# The model metadata entry of a graph whose attention core is GroupQueryAttention (written by
# passes/attention_gqa.py; here so the runtime, which has no onnx, can read it).
GQA_METADATA = ("kiln.attention", "GroupQueryAttention")


def has_gqa_core(metadata: dict[str, str]) -> bool:
    key, value = GQA_METADATA
    return metadata.get(key) == value


def new_kv_layer_major(new_kv: np.ndarray, num_kv_heads: int, head_dim: int) -> np.ndarray:
    """new_kv as [2L, kvh, B, S, hd] (a view): the GQA layout returns it token-major,
    [B, S, 2L·kvh·hd] (one Concat of the flat k/v the attention reads, no per-layer transposes)."""
    if new_kv.ndim == 5:
        return new_kv
    batch, seq, _ = new_kv.shape
    return new_kv.reshape(batch, seq, -1, num_kv_heads, head_dim).transpose(2, 3, 0, 1, 4)


@dataclass
class OrtCall:
    feeds: dict[str, np.ndarray]       # the graph's inputs except the KV pool
    rows: np.ndarray                   # per new token: its batch row ...
    cols: np.ndarray                   # ... its position in the row ...
    slots: np.ndarray                  # ... and the pool slot its K/V goes to
    logit_rows: np.ndarray             # per output logits row [b, k] ...
    logit_order: np.ndarray            # ... its place in the batch's logits_indices order
    padded: int
    seqs: list[int]                    # the batch's sequences in this call, one per row

    def batches_chunks_with_past(self) -> bool:
        """Whether the call holds several chunks (S > 1) and a past buffer (block tables of width
        > 0, whatever the past lengths): what a GroupQueryAttention core refuses."""
        return len(self.seqs) > 1 and self.feeds["input_ids"].shape[1] > 1 and self.feeds["block_tables"].shape[1] > 0


def assemble_logits(batch: PagedBatch, calls: list[OrtCall], run: Callable[[int], np.ndarray]) -> EngineResult:
    """Run every call (run(i): call i's logits rows) and place the rows in the batch's logits order."""
    logits = None
    for i, call in enumerate(calls):
        rows = run(i)
        if logits is None:
            logits = np.empty((len(batch.logits_indices), rows.shape[-1]), np.float32)
        logits[call.logit_order] = rows
    return EngineResult(logits, sum(c.padded for c in calls), len(calls))


def group_by_length(lens: np.ndarray) -> list[list[int]]:
    """Split sequences into engine calls of similar length (indices into lens).

    One [B, S] call pads every chunk to the longest; a 500-token chunk next to thirty 20-token
    ones would compute 16k slots for 1.1k tokens. Prefill is compute-bound, so extra calls cost
    little, while padding costs its full share. Decodes (length 1) always form their own call.
    """
    groups: list[list[int]] = []
    for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
        group = groups[-1] if groups else None
        if group is not None and (lens[i] == 1) == (lens[group[0]] == 1):
            real = sum(lens[j] for j in group) + lens[i]
            if real >= (1 - MAX_PADDING) * lens[group[0]] * (len(group) + 1):
                group.append(i)
                continue
        groups.append([i])
    return groups


def call_groups(batch: PagedBatch, chunks_with_past_alone: bool = False) -> list[list[int]]:
    """The sequences of each call: grouped by length, and with chunks_with_past_alone, every chunk
    that continues a sequence in a group of its own."""
    if not chunks_with_past_alone:
        return group_by_length(batch.query_lens)
    continuing = (batch.query_lens > 1) & (batch.past_lens > 0)
    rest = np.flatnonzero(~continuing)
    return ([[int(i)] for i in np.flatnonzero(continuing)]
            + [[int(rest[j]) for j in group] for group in group_by_length(batch.query_lens[rest])])


def plan_calls(batch: PagedBatch, grid: BucketGrid, block_size: int,
               chunks_with_past_alone: bool = False) -> list[OrtCall]:
    starts, owner = _logit_owners(batch)
    calls = []
    for group in call_groups(batch, chunks_with_past_alone):
        for i in range(0, len(group), grid.max_batch):
            calls.append(_call(batch, group[i:i + grid.max_batch], grid, block_size, starts, owner,
                               min_table_width=0 if chunks_with_past_alone else 1))
    return calls


def one_call_per_sequence(batch: PagedBatch, call: OrtCall, grid: BucketGrid, block_size: int) -> list[OrtCall]:
    """The call's sequences, each in a call of its own (what a GroupQueryAttention engine takes of
    a call that batches chunks with a past buffer)."""
    starts, owner = _logit_owners(batch)
    return [_call(batch, [s], grid, block_size, starts, owner, min_table_width=1) for s in call.seqs]


def _logit_owners(batch: PagedBatch) -> tuple[np.ndarray, np.ndarray]:
    starts = batch.seq_starts
    return starts, np.searchsorted(starts, batch.logits_indices, side="right") - 1   # seq of each logit


def _call(batch, seqs, grid, bs, starts, owner, min_table_width: int) -> OrtCall:
    lens, past = batch.query_lens[seqs], batch.past_lens[seqs]
    bucket = grid.bucket_for(len(seqs), int(lens.max()))
    past_blocks = -(-past // bs)
    ids = np.zeros((bucket.batch, bucket.seq), np.int64)
    pos = np.zeros_like(ids)
    past_lens = np.zeros(bucket.batch, np.int64)
    tables = np.zeros((bucket.batch, max(min_table_width, int(past_blocks.max()))), np.int64)
    wanted = [np.flatnonzero(owner == s) for s in seqs]
    logits_index = np.zeros((bucket.batch, max(1, max(len(w) for w in wanted))), np.int64)
    rows, cols, slots, logit_rows, order = [], [], [], [], []
    for b, s in enumerate(seqs):
        lo, n = starts[s], lens[b]
        ids[b, :n] = batch.input_ids[lo:lo + n]
        pos[b, :n] = batch.positions[lo:lo + n]
        past_lens[b] = past[b]
        tables[b, :past_blocks[b]] = batch.block_tables[s][:past_blocks[b]]
        rows.append(np.full(n, b))
        cols.append(np.arange(n))
        slots.append(batch.slot_mapping[lo:lo + n])
        logits_index[b, :len(wanted[b])] = batch.logits_indices[wanted[b]] - lo
        logit_rows += [(b, k) for k in range(len(wanted[b]))]
        order.extend(wanted[b])
    feeds = {"input_ids": ids, "position_ids": pos, "past_lens": past_lens, "block_tables": tables,
             "logits_index": logits_index}
    return OrtCall(feeds, np.concatenate(rows), np.concatenate(cols), np.concatenate(slots),
                   np.asarray(logit_rows, np.int64).reshape(-1, 2), np.asarray(order, np.int64),
                   bucket.batch * bucket.seq - int(lens.sum()), [int(s) for s in seqs])
