"""The model runner: scheduler output -> one PagedBatch -> engine -> sampler.

The runner speaks only the Engine protocol: it packs every scheduled request's new tokens, their
positions, block tables and slots into one backend-neutral batch; how the backend runs it (padded
bucket calls on ONNX Runtime, packed tokens on a native paged-attention kernel) is the engine's
business.

A decode carrying proposals (speculative decoding) packs its last token and the proposals, and
wants logits at each of them: one row per proposal plus the token after (speculative/verify.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from kiln.contract.engine import Engine, PagedBatch
from kiln.runtime.kv_manager import KVCacheManager
from kiln.runtime.request import Request
from kiln.runtime.sampler import Sampler, SamplingState, rows_logprobs
from kiln.runtime.speculative.verify import verify
from kiln.runtime.step_io import RunnerOutput, ScheduledRequest, SchedulerOutput


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


def paged_batch(scheduled: list[ScheduledRequest], kv: KVCacheManager, block_size: int) -> PagedBatch:
    """Pack the step's new tokens; logits are wanted at the last new token of each sampling
    request, and at each token it proposes."""
    ids, positions, slots, tables, wanted = [], [], [], [], []
    query_lens = np.empty(len(scheduled), np.int64)
    past_lens = np.empty(len(scheduled), np.int64)
    offset = 0
    for b, s in enumerate(scheduled):
        start, n = s.request.num_computed_tokens, s.num_new_tokens
        table = np.asarray(kv.block_table(s.request.request_id), np.int64)
        pos = np.arange(start, start + n, dtype=np.int64)
        own = n - len(s.proposed)
        ids.append(s.request.all_token_ids[start:start + own] + list(s.proposed))
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        tables.append(table)
        query_lens[b], past_lens[b] = n, start
        offset += n
        if s.samples_token:
            wanted.extend(range(offset - 1 - len(s.proposed), offset))
    num_proposed = np.fromiter((len(s.proposed) for s in scheduled), np.int64, len(scheduled))
    return PagedBatch(np.fromiter((t for chunk in ids for t in chunk), np.int64, offset),
                      np.concatenate(positions), query_lens, past_lens, tables,
                      np.concatenate(slots), np.asarray(wanted, np.int64),
                      num_proposed if num_proposed.any() else None)


def prompt_logprob_rows(scheduled: list[ScheduledRequest]) -> list[tuple[ScheduledRequest, np.ndarray]]:
    """For each request that wants prompt logprobs, the packed rows of its chunk whose logits
    score a prompt token (row of position p scores token p + 1; the prompt's last position
    scores the first output token, the sampling row)."""
    out, offset = [], 0
    for s in scheduled:
        start, n = s.request.num_computed_tokens, s.num_new_tokens
        if s.request.sampling_params.prompt_logprobs is not None:
            last = min(start + n, s.request.num_prompt_tokens - 1)      # positions start .. last - 1
            if last > start:
                out.append((s, np.arange(offset, offset + last - start, dtype=np.int64)))
        offset += n
    return out


class ModelRunner:
    def __init__(self, engine: Engine, kv: KVCacheManager, default_seed: int | None = None):
        self.engine, self.kv = engine, kv
        self.block_size = engine.kv_layout.block_size
        self.sampler = Sampler()
        self.states: dict[str, SamplingState] = {}
        self.default_seed = default_seed
        self.stats = RunnerStats()

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if not out.scheduled:
            return RunnerOutput()
        batch = paged_batch(out.scheduled, self.kv, self.block_size)
        num_sampling_rows = len(batch.logits_indices)
        scored = prompt_logprob_rows(out.scheduled)
        if scored:      # NOTE: after the sampling rows, which keep their places
            batch.logits_indices = np.concatenate([batch.logits_indices, *(rows for _, rows in scored)])
        t0 = time.perf_counter()
        result = self.engine.execute(batch)
        if scored:
            record_prompt_logprobs(scored, result.logits[num_sampling_rows:])
            result.logits = result.logits[:num_sampling_rows]
        self.stats.engine_seconds += time.perf_counter() - t0
        self.stats.engine_calls += result.calls
        self.stats.padded_tokens += result.padded_tokens
        self.stats.real_tokens += batch.num_tokens
        sampling = [s for s in out.scheduled if s.samples_token]
        if not any(s.proposed for s in sampling):
            return self._sample([s.request for s in sampling], result.logits)
        return self._verify(sampling, result.logits)

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def _verify(self, sampling: list[ScheduledRequest], logits: np.ndarray) -> RunnerOutput:
        """A step with proposals: their rows go through verification, the other requests'
        through the sampler as one batch."""
        plain, plain_rows, verified = [], [], {}
        row = 0
        for s in sampling:
            rows = 1 + len(s.proposed)
            if s.proposed:
                verified[s.request.request_id] = verify(logits[row:row + rows], s.proposed, self._state(s.request))
            else:
                plain.append(s.request)
                plain_rows.append(row)
            row += rows
        out = self._sample(plain, logits[plain_rows])
        for request_id, tokens in verified.items():
            out.num_accepted[request_id] = len(tokens) - 1
            out.sampled_token_ids[request_id] = tokens[-1]
        return out

    def _sample(self, requests: list[Request], logits: np.ndarray) -> RunnerOutput:
        if not requests:
            return RunnerOutput()
        states = [self._state(r) for r in requests]
        result = self.sampler.sample(logits, states)
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
            eos = () if request.eos_token_id is None else (request.eos_token_id, *request.extra_eos_token_ids)
            state = self.states[request.request_id] = SamplingState.from_params(params, request.prompt_token_ids,
                                                                                eos)
        return state


def record_prompt_logprobs(scored: list[tuple[ScheduledRequest, np.ndarray]], logits: np.ndarray) -> None:
    """Append each chunk's prompt-token logprobs to its request. NOTE: the runner writes them
    (not update()) because only it sees these rows; a chunk computed again after a preemption
    adds nothing (the request has those positions already)."""
    row = 0
    for s, rows in scored:
        r, start = s.request, s.request.num_computed_tokens
        # the rows scoring prompt tokens the request has no logprobs for yet (token start + i + 1)
        first = len(r.prompt_logprobs) - start
        new = range(first, len(rows)) if first >= 0 else range(0)
        if len(new):
            targets = r.prompt_token_ids[start + new.start + 1:start + new.stop + 1]
            r.prompt_logprobs += rows_logprobs(logits[row + new.start:row + new.stop], targets,
                                               r.sampling_params.prompt_logprobs)
        row += len(rows)
