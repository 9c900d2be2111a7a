"""Drive an artifact's engine directly for one sequence: logits for every position.

For golden parity tests and artifact perplexity; serving goes through the scheduler instead.
"""

from __future__ import annotations

import numpy as np

from kiln.artifact import EngineArtifact
from kiln.engines.ort_engine import OrtEngine
from kiln.runtime.kv_pool import KvPool


class SequenceRunner:
    def __init__(self, artifact: EngineArtifact, max_tokens: int, threads: int | None = None):
        m = artifact.manifest
        self.engine = OrtEngine(artifact.engine_file("ort"), m.buckets, m.kv_layout, threads)
        self.bs = m.kv_layout.block_size
        num_blocks = -(-max_tokens // self.bs)
        self.pool = KvPool(m.kv_layout, num_blocks)
        # A shuffled block table, so the test exercises real paging, not a contiguous slab.
        self.table = np.random.default_rng(0).permutation(num_blocks).astype(np.int64)
        self.length = 0

    def feed(self, token_ids: list[int]) -> np.ndarray:
        """Append tokens; returns their logits [n, vocab]."""
        n, start = len(token_ids), self.length
        positions = np.arange(start, start + n)
        past_blocks = max(1, -(-start // self.bs))
        feeds = {"input_ids": np.asarray([token_ids], np.int64), "position_ids": positions[None],
                 "past_lens": np.asarray([start], np.int64), "block_tables": self.table[None, :past_blocks],
                 "logits_index": np.arange(n, dtype=np.int64)[None], **self.pool.feeds}
        out = self.engine.run(feeds)
        slots = self.table[positions // self.bs] * self.bs + positions % self.bs
        self.pool.write(out["new_kv"], np.zeros(n, np.int64), np.arange(n), slots)
        self.length += n
        return out["logits"][0]

    def feed_chunked(self, token_ids: list[int], chunk: int) -> np.ndarray:
        return np.concatenate([self.feed(token_ids[i:i + chunk]) for i in range(0, len(token_ids), chunk)])


def artifact_perplexity(artifact: EngineArtifact, token_ids: list[int], chunk: int = 256) -> float:
    runner = SequenceRunner(artifact, len(token_ids))
    logits = runner.feed_chunked(token_ids, chunk)[:-1].astype(np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = logz - logits[np.arange(len(token_ids) - 1), token_ids[1:]]
    return float(np.exp(nll.mean()))
