"""ONNX Runtime engine (CPU, the embedded default): compile offline, load without optimizing.

The graph gathers each sequence's past K/V from the paged pool (passes/kv_io.py) and returns the
new tokens' K/V, which this engine scatters into their pool slots in one vectorised write. The
graph's metadata names its attention core; a GroupQueryAttention core takes a chunk with a past
only at batch 1, and the call planner keeps to that (engines/ort/batching.py). An artifact whose
decode engine has that core and whose prefill engine the standard one (the ORT default with
--prefill-engine) is planned for the standard core, and the few calls that reach the decode engine
with several chunks (speculative verifications of 2-3 sequences) run one sequence each.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from kiln.contract.engine import BucketGrid, EngineResult, KvLayout, PagedBatch, default_threads
from kiln.engines.ort.kv_pool import KvPool
from kiln.engines.ort.batching import (OrtCall, assemble_logits, has_gqa_core, new_kv_layer_major,
                                      one_call_per_sequence, plan_calls)
from kiln.engines.ort.session import cpu_session, session_options


OUTPUTS = ("logits", "new_kv")


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
        _check_pool_dtype(self.sessions, kv_layout)
        self.gqa = [has_gqa_core(s.get_modelmeta().custom_metadata_map) for _, s in self.sessions]
        # the planner keeps GroupQueryAttention's rule for every call only when every engine has the core
        self.chunks_with_past_alone = all(self.gqa)
        self.pool: KvPool | None = None
        self._bindings: list[ort.IOBinding] = []      # per session, made with the pool

    def io_spec(self) -> dict[str, list]:
        return {i.name: list(i.shape) for i in [*self.session.get_inputs(), *self.session.get_outputs()]}

    def allocate_kv(self, num_blocks: int) -> None:
        self.pool = KvPool(self.kv_layout, num_blocks)
        self._bindings = [bind_pool(session, self.pool) for _, session in self.sessions]

    def execute(self, batch: PagedBatch) -> EngineResult:
        if self.pool is None:
            raise RuntimeError("allocate_kv(num_blocks) must be called before execute()")
        calls = plan_calls(batch, self.buckets, self.kv_layout.block_size, self.chunks_with_past_alone)
        proposals = batch.proposal_slots()
        runs = []
        for call in calls:
            index = self._engine_for(call, proposals)
            if self.gqa[index] and call.batches_chunks_with_past():
                runs += [(part, index) for part in one_call_per_sequence(batch, call, self.buckets,
                                                                        self.kv_layout.block_size)]
            else:
                runs.append((call, index))
        return assemble_logits(batch, [call for call, _ in runs], lambda i: self._run(*runs[i]))

    def _engine_for(self, call: OrtCall, proposals: np.ndarray) -> int:
        """The last engine whose minimum the call's tokens reach. NOTE: proposals (speculative
        decoding) do not count: a verification runs on the engine that serves its decode, whose
        rounding non-speculative greedy output has."""
        tokens = len(call.rows) - (int(np.isin(call.slots, proposals).sum()) if proposals.size else 0)
        return max(i for i, (min_tokens, _) in enumerate(self.sessions) if tokens >= min_tokens)

    def _run(self, call: OrtCall, index: int) -> np.ndarray:
        self.calls_by_engine[index] += 1
        binding = self._bindings[index]
        for name, value in call.feeds.items():
            binding.bind_cpu_input(name, value)
        for name in OUTPUTS:            # unallocated again: last call's outputs would bind their shapes
            binding.bind_output(name, "cpu")
        self.sessions[index][1].run_with_iobinding(binding)
        logits, new_kv = (value.numpy() for value in binding.get_outputs())
        layer_major = new_kv_layer_major(new_kv, self.kv_layout.num_kv_heads, self.kv_layout.head_dim)
        self.pool.write(layer_major, call.rows, call.cols, call.slots)
        return logits[call.logit_rows[:, 0], call.logit_rows[:, 1]]


def bind_pool(session: ort.InferenceSession, pool: KvPool) -> ort.IOBinding:
    """The session's IOBinding with the pool's arrays bound once (OrtValues over their memory, which
    the runtime's writes update in place). NOTE: run() with the pool in its feeds wrapped and
    checked all of them (60 for SmolLM2) at every call."""
    binding = session.io_binding()
    for name, array in pool.feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
    return binding


class KvDtypeMismatch(ValueError):
    """The graph reads a KV pool of another element type than the manifest's layout says."""


ORT_TENSOR_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "int8": "tensor(int8)"}


def _check_pool_dtype(sessions: list, kv_layout: KvLayout) -> None:
    want = ORT_TENSOR_TYPES.get(kv_layout.dtype, kv_layout.dtype)
    for _, session in sessions:
        cache = next((i for i in session.get_inputs() if i.name == "key_cache.0"), None)
        if cache is not None and cache.type != want:
            raise KvDtypeMismatch(f"the engine graph reads a {cache.type} KV pool, but the manifest's KV layout "
                                  f"is {kv_layout.dtype}")
