"""Drive an artifact's engine directly for one sequence: logits for every position.

For golden parity tests and artifact perplexity; serving goes through the scheduler instead.
"""

from __future__ import annotations

import numpy as np

from kiln.contract.artifact import EngineArtifact
from kiln.contract.engine import PagedBatch
from kiln.engines.load import load_engine


class SequenceRunner:
    def __init__(self, artifact: EngineArtifact, max_tokens: int, threads: int | None = None):
        self.engine = load_engine(artifact, threads)
        self.bs = self.engine.kv_layout.block_size
        num_blocks = -(-max_tokens // self.bs)
        self.engine.allocate_kv(num_blocks)
        # A shuffled block table, so the test exercises real paging, not a contiguous slab.
        self.table = np.random.default_rng(0).permutation(num_blocks).astype(np.int64)
        self.length = 0

    def feed(self, token_ids: list[int]) -> np.ndarray:
        """Append tokens; returns their logits [n, vocab]."""
        n, start = len(token_ids), self.length
        positions = np.arange(start, start + n, dtype=np.int64)
        batch = PagedBatch(
            input_ids=np.asarray(token_ids, np.int64), positions=positions,
            query_lens=np.asarray([n], np.int64), past_lens=np.asarray([start], np.int64),
            block_tables=[self.table[: -(-(start + n) // self.bs)]],
            slot_mapping=self.table[positions // self.bs] * self.bs + positions % self.bs,
            logits_indices=np.arange(n, dtype=np.int64))
        logits = self.engine.execute(batch).logits
        self.length += n
        return logits

    def feed_chunked(self, token_ids: list[int], chunk: int) -> np.ndarray:
        return np.concatenate([self.feed(token_ids[i:i + chunk]) for i in range(0, len(token_ids), chunk)])


def artifact_perplexity(artifact: EngineArtifact, token_ids: list[int], chunk: int = 256) -> float:
    runner = SequenceRunner(artifact, len(token_ids))
    logits = runner.feed_chunked(token_ids, chunk)[:-1].astype(np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = logz - logits[np.arange(len(token_ids) - 1), token_ids[1:]]
    return float(np.exp(nll.mean()))
