"""ONNX Runtime engine (CPU, the embedded default): compile offline, load without optimizing.

The graph gathers each sequence's past K/V from the paged pool (passes/kv_io.py) and returns the
new tokens' K/V, which this engine scatters into their pool slots in one vectorised write. The
graph's metadata names its attention core; a GroupQueryAttention core takes a chunk with a past
only at batch 1, and the call planner keeps to that (engines/ort_batching.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from kiln.engines.base import BucketGrid, EngineResult, KvLayout, PagedBatch, default_threads
from kiln.engines.kv_pool import KvPool
from kiln.engines.ort_batching import OrtCall, has_gqa_core, new_kv_layer_major, plan_calls
from kiln.engines.ort_session import cpu_session, session_options


class OrtEngine:
    """prefill: (min tokens, model path) of a second engine for calls of that many tokens or more
    (engines per bucket range: build.PREFILL_MIN_TOKENS); it shares the one KV pool."""

    def __init__(self, model_path: Path, buckets: BucketGrid, kv_layout: KvLayout, threads: int | None = None,
                 prefill: tuple[int, Path] | None = None):
        self.buckets, self.kv_layout = buckets, kv_layout
        self.threads = threads or default_threads()
        opts = session_options(self.threads, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
        self.session = cpu_session(str(model_path), opts)
        # (min tokens, session), ascending: a call runs on the last whose minimum it reaches
        self.sessions = [(0, self.session)]
        if prefill is not None:
            self.sessions.append((prefill[0], cpu_session(str(prefill[1]), opts)))
        self.calls_by_engine = [0] * len(self.sessions)
        self.chunks_with_past_alone = _gqa_core(self.sessions)
        self.pool: KvPool | None = None

    def io_spec(self) -> dict[str, list]:
        return {i.name: list(i.shape) for i in [*self.session.get_inputs(), *self.session.get_outputs()]}

    def allocate_kv(self, num_blocks: int) -> None:
        self.pool = KvPool(self.kv_layout, num_blocks)

    def execute(self, batch: PagedBatch) -> EngineResult:
        if self.pool is None:
            raise RuntimeError("allocate_kv(num_blocks) must be called before execute()")
        calls = plan_calls(batch, self.buckets, self.kv_layout.block_size, self.chunks_with_past_alone)
        proposals = batch.proposal_slots()
        logits = None
        for call in calls:
            rows = self._run(call, int(np.isin(call.slots, proposals).sum()) if proposals.size else 0)
            if logits is None:
                logits = np.empty((len(batch.logits_indices), rows.shape[-1]), np.float32)
            logits[call.logit_order] = rows
        return EngineResult(logits, sum(c.padded for c in calls), len(calls))

    def _run(self, call: OrtCall, num_proposed: int = 0) -> np.ndarray:
        # NOTE: proposals (speculative decoding) do not count: a verification runs on the engine
        # that serves its decode, whose rounding non-speculative greedy output has.
        tokens = len(call.rows) - num_proposed
        index = max(i for i, (min_tokens, _) in enumerate(self.sessions) if tokens >= min_tokens)
        self.calls_by_engine[index] += 1
        logits, new_kv = self.sessions[index][1].run(["logits", "new_kv"], call.feeds | self.pool.feeds)
        layer_major = new_kv_layer_major(new_kv, self.kv_layout.num_kv_heads, self.kv_layout.head_dim)
        self.pool.write(layer_major, call.rows, call.cols, call.slots)
        return logits[call.logit_rows[:, 0], call.logit_rows[:, 1]]


def _gqa_core(sessions: list[tuple[int, ort.InferenceSession]]) -> bool:
    """Whether the engines' attention core is GroupQueryAttention (all of them, or none: one plan
    serves every session)."""
    cores = {has_gqa_core(s.get_modelmeta().custom_metadata_map) for _, s in sessions}
    if len(cores) > 1:
        raise ValueError("the decode and prefill engines have different attention cores; rebuild the artifact")
    return cores.pop()
