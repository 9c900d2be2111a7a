"""The model runner: scheduler output -> engine feeds padded to buckets -> engine -> sampler.

Requests decoding one token and requests running a prefill chunk go to the engine as two calls,
so decodes are never padded to a prefill chunk's length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from kiln.engines.base import Engine
from kiln.runtime.kv_manager import KVCacheManager
from kiln.runtime.kv_pool import KvPool
from kiln.runtime.request import Request
from kiln.runtime.sampler import Sampler, SamplingState
from kiln.runtime.scheduler import RunnerOutput, ScheduledRequest, SchedulerOutput


@dataclass
class RunnerStats:
    engine_calls: int = 0
    engine_seconds: float = 0.0
    real_tokens: int = 0
    padded_tokens: int = 0       # bucket padding: computed and thrown away

    @property
    def padding_fraction(self) -> float:
        total = self.real_tokens + self.padded_tokens
        return self.padded_tokens / total if total else 0.0


@dataclass
class _Batch:
    feeds: dict[str, np.ndarray]
    rows: np.ndarray       # per new token: its batch row ...
    cols: np.ndarray       # ... its position in the row ...
    slots: np.ndarray      # ... and the pool slot its K/V goes to
    padded: int


MAX_PADDING = 0.25      # a prefill group may waste at most this share of its [B, S] slots


def group_by_length(chunks: list[ScheduledRequest]) -> list[list[ScheduledRequest]]:
    """Split prefill chunks into engine calls of similar length.

    One [B, S] call pads every chunk to the longest; a 500-token chunk next to thirty 20-token
    ones would compute 16k slots for 1.1k tokens. Prefill is compute-bound, so extra calls cost
    little, while padding costs its full share.
    """
    groups: list[list[ScheduledRequest]] = []
    for s in sorted(chunks, key=lambda s: -s.num_new_tokens):
        group = groups[-1] if groups else None
        if group is not None:
            real = sum(x.num_new_tokens for x in group) + s.num_new_tokens
            if real >= (1 - MAX_PADDING) * group[0].num_new_tokens * (len(group) + 1):
                group.append(s)
                continue
        groups.append([s])
    return groups


class ModelRunner:
    def __init__(self, engine: Engine, pool: KvPool, kv: KVCacheManager, default_seed: int | None = None):
        self.engine, self.pool, self.kv = engine, pool, kv
        self.block_size = engine.kv_layout.block_size
        self.sampler = Sampler()
        self.states: dict[str, SamplingState] = {}
        self.default_seed = default_seed
        self.stats = RunnerStats()

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
        chunks = [s for s in out.scheduled if s.num_new_tokens > 1]
        to_sample, logits = [], []
        for group in [decodes, *group_by_length(chunks)]:
            if group:
                rows = self._run(group)
                for s, row in zip(group, rows):
                    if s.samples_token:
                        to_sample.append(s.request)
                        logits.append(row)
        return self._sample(to_sample, logits)

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def _run(self, group: list[ScheduledRequest]) -> np.ndarray:
        batch = self._batch(group)
        t0 = time.perf_counter()
        outs = self.engine.run(batch.feeds)
        self.stats.engine_seconds += time.perf_counter() - t0
        self.stats.engine_calls += 1
        self.stats.padded_tokens += batch.padded
        self.stats.real_tokens += len(batch.slots)
        self.pool.write(outs["new_kv"], batch.rows, batch.cols, batch.slots)
        return outs["logits"][:, 0, :]

    def _batch(self, group: list[ScheduledRequest]) -> _Batch:
        bucket = self.engine.buckets.bucket_for(len(group), max(s.num_new_tokens for s in group))
        bs = self.block_size
        max_past_blocks = max(1, max(-(-s.request.num_computed_tokens // bs) for s in group))
        ids = np.zeros((bucket.batch, bucket.seq), np.int64)
        pos = np.zeros_like(ids)
        past = np.zeros(bucket.batch, np.int64)
        tables = np.zeros((bucket.batch, max_past_blocks), np.int64)
        last = np.zeros((bucket.batch, 1), np.int64)
        rows, cols, slots = [], [], []
        for b, s in enumerate(group):
            start, n = s.request.num_computed_tokens, s.num_new_tokens
            table = np.asarray(self.kv.block_table(s.request.request_id), np.int64)
            ids[b, :n] = s.request.all_token_ids[start:start + n]
            positions = np.arange(start, start + n)
            pos[b, :n] = positions
            past[b] = start
            tables[b, : -(-start // bs)] = table[: -(-start // bs)]
            last[b, 0] = n - 1
            rows.append(np.full(n, b))
            cols.append(np.arange(n))
            slots.append(table[positions // bs] * bs + positions % bs)
        feeds = {"input_ids": ids, "position_ids": pos, "past_lens": past, "block_tables": tables,
                 "logits_index": last, **self.pool.feeds}
        real = sum(s.num_new_tokens for s in group)
        return _Batch(feeds, np.concatenate(rows), np.concatenate(cols), np.concatenate(slots),
                      bucket.batch * bucket.seq - real)

    def _sample(self, requests: list[Request], logits: list[np.ndarray]) -> RunnerOutput:
        if not requests:
            return RunnerOutput()
        states = [self._state(r) for r in requests]
        result = self.sampler.sample(np.stack(logits), states)
        out = RunnerOutput()
        for r, state, tok, lp in zip(requests, states, result.token_ids, result.logprobs):
            state.append(tok)
            out.sampled_token_ids[r.request_id] = tok
            if lp is not None:
                out.logprobs[r.request_id] = lp
        return out

    def _state(self, request: Request) -> SamplingState:
        state = self.states.get(request.request_id)
        if state is None:
            params = request.sampling_params
            if params.seed is None and self.default_seed is not None:
                params = replace(params, seed=self.default_seed)
            state = self.states[request.request_id] = SamplingState.from_params(params, request.prompt_token_ids)
        return state
