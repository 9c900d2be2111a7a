"""A fake engine for runner tests: deterministic logits computed from the context it reads back
through the block tables, so a wrong table, slot or position changes the generated tokens."""

from __future__ import annotations

import numpy as np

from kiln.contract.engine import BucketGrid, EngineResult, KvLayout, PagedBatch

VOCAB = 50


def next_token(context: list[int]) -> int:
    """The model the fake engine implements; the reference a test decodes with directly."""
    return (sum(t * (i + 1) for i, t in enumerate(context)) * 31 + 7) % VOCAB


class FakeEngine:
    def __init__(self, block_size: int = 4, max_batch: int = 64, max_seq: int = 512):
        self.buckets = BucketGrid((max_batch,), (max_seq,))
        self.kv_layout = KvLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=block_size)
        self.batches: list[PagedBatch] = []
        self.slots: np.ndarray | None = None      # the "KV cache": the token id stored in each slot
        self.fail_on_call: int | None = None

    def io_spec(self) -> dict[str, list]:
        return {"input_ids": ["tokens"], "logits": ["rows", VOCAB]}

    def allocate_kv(self, num_blocks: int) -> None:
        self.slots = np.full(num_blocks * self.kv_layout.block_size, -1, np.int64)

    def execute(self, batch: PagedBatch) -> EngineResult:
        self.batches.append(batch)
        if self.fail_on_call is not None and len(self.batches) >= self.fail_on_call:
            raise RuntimeError("fake engine failure")
        contexts = [self._context(batch, b) for b in range(batch.num_seqs)]
        self.slots[batch.slot_mapping] = batch.input_ids
        logits = np.zeros((len(batch.logits_indices), VOCAB), np.float32)
        starts = batch.seq_starts
        for row, index in enumerate(batch.logits_indices):
            b = int(np.searchsorted(starts, index, side="right") - 1)
            new = batch.input_ids[starts[b]:index + 1].tolist()
            logits[row, next_token(contexts[b] + new)] = 10.0
        return EngineResult(logits)

    def _context(self, batch: PagedBatch, b: int) -> list[int]:
        """The past tokens of sequence b, read through its block table as a kernel would."""
        bs, past = self.kv_layout.block_size, int(batch.past_lens[b])
        pos = np.arange(past)
        tokens = self.slots[batch.block_tables[b][pos // bs] * bs + pos % bs]
        assert (tokens >= 0).all(), f"sequence {b} reads a slot that was never written"
        return tokens.tolist()
