"""The runner against a fake engine: batch packing, paging through block tables, prefix caching,
preemption and chunked prefill, with no model."""

from __future__ import annotations

import numpy as np
import pytest
from fake_engine import FakeEngine, next_token

from kiln.config import SchedulerConfig
from kiln.runtime.kv_manager import KVCacheManager
from kiln.runtime.request import Request
from kiln.runtime.runner import ModelRunner
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler


def make_runtime(num_blocks=64, block_size=4, **config):
    config = SchedulerConfig(**config)
    kv = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching)
    engine = FakeEngine(block_size)
    engine.allocate_kv(num_blocks)
    return Scheduler(config, kv), ModelRunner(engine, kv), engine


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    # Outputs equal this exactly: the fake engine's next token is integer arithmetic on the context it reads.
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def run(sched, runner, requests, max_steps=2000):
    for r in requests:
        sched.add_request(r)
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        steps += 1
        assert steps < max_steps


def greedy(rid, prompt, max_tokens):
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def test_a_step_packs_decodes_and_chunks_into_one_batch():
    sched, runner, engine = make_runtime(block_size=4, max_num_batched_tokens=8)
    a = greedy("a", [1, 2, 3], 3)
    sched.add_request(a)
    sched.update(out := sched.schedule(), runner.execute(out))      # a's prefill: 3 tokens
    sched.add_request(greedy("b", list(range(10, 20)), 2))          # 10 tokens, chunked to 7
    sched.update(out := sched.schedule(), runner.execute(out))
    batch = engine.batches[-1]
    assert batch.query_lens.tolist() == [1, 7]
    assert batch.past_lens.tolist() == [3, 0]
    assert batch.positions.tolist() == [3, 0, 1, 2, 3, 4, 5, 6]
    assert batch.input_ids.tolist() == [a.output_token_ids[0], *range(10, 17)]
    assert batch.logits_indices.tolist() == [0]                    # b's chunk samples nothing yet
    table_a, table_b = batch.block_tables
    assert batch.slot_mapping[0] == table_a[0] * 4 + 3
    assert batch.slot_mapping[1:].tolist() == [table_b[p // 4] * 4 + p % 4 for p in range(7)]


def test_greedy_through_paging_matches_the_reference():
    sched, runner, _ = make_runtime(num_blocks=64, max_num_batched_tokens=16)
    prompts = [list(range(i, i + n)) for i, n in enumerate([3, 17, 8, 30, 1])]
    requests = [greedy(str(i), p, 12) for i, p in enumerate(prompts)]
    run(sched, runner, requests)
    for r, p in zip(requests, prompts):
        assert r.output_token_ids == reference(p, 12)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_prefix_cache_hits_read_the_cached_blocks():
    sched, runner, engine = make_runtime(enable_prefix_caching=True)
    shared = list(range(5, 25))
    first = greedy("first", shared + [1], 4)
    run(sched, runner, [first])
    second = greedy("second", shared + [2], 4)
    run(sched, runner, [second])
    assert second.num_cached_tokens >= 16
    assert engine.batches[-4].past_lens.max() >= 16       # its prefill started past the hit
    assert second.output_token_ids == reference(shared + [2], 4)


def test_preemption_recomputes_and_still_matches():
    sched, runner, _ = make_runtime(num_blocks=12, block_size=4, max_num_batched_tokens=32)
    prompts = [list(range(3 * i, 3 * i + 9)) for i in range(4)]
    requests = [greedy(str(i), p, 14) for i, p in enumerate(prompts)]
    run(sched, runner, requests)
    assert sched.num_preemptions > 0
    for r, p in zip(requests, prompts):
        assert r.output_token_ids == reference(p, 14)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_runner_counts_engine_calls_and_tokens():
    sched, runner, engine = make_runtime()
    run(sched, runner, [greedy("a", [1, 2, 3, 4, 5], 3)])
    assert runner.stats.engine_calls == len(engine.batches) == 3
    assert runner.stats.real_tokens == 5 + 2 and runner.stats.padded_tokens == 0


def test_an_engine_error_propagates_from_execute():
    sched, runner, engine = make_runtime()
    engine.fail_on_call = 1
    sched.add_request(greedy("a", [1, 2], 2))
    with pytest.raises(RuntimeError, match="fake engine failure"):
        runner.execute(sched.schedule())
