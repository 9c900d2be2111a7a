"""What the engine client publishes (its snapshot and last step) on the real tiny model: the limits
from the start, before any thread runs; the prefix cache's view once asked for; the last step's
batch; and a stop string finished by the client, not by the output processor."""

from __future__ import annotations

import time

import pytest

from kiln import LLM, RuntimeConfig, SamplingParams
from kiln.runtime.engine_stats import NO_PREFIX_CACHE

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture
def llm(tiny_llama_artifact):
    llm = LLM(tiny_llama_artifact, RuntimeConfig(kv_cache_memory=16 << 20))
    yield llm
    llm.shutdown()


def _idle(llm, timeout=20.0) -> None:
    """Until the engine thread has exited (the core is the caller's to read again)."""
    deadline = time.monotonic() + timeout
    while llm.client._thread is not None:
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_first_snapshot_has_the_limits_before_any_thread_runs(llm):
    client, core = llm.client, llm.core
    s = client.snapshot
    assert client._thread is None
    assert s.kv_plan is core.plan and s.kv_blocks_total == core.kv.num_blocks == s.kv_plan.num_blocks
    assert s.kv_block_size == core.kv.block_size and s.max_model_len == core.scheduler.config.max_model_len
    assert s.max_num_seqs == core.scheduler.config.max_num_seqs and not s.speculative
    assert (s.num_running, s.num_waiting, s.kv_blocks_used, s.steps) == (0, 0, 0, 0)
    assert s.prefix_cache is NO_PREFIX_CACHE


def test_snapshots_carry_the_prefix_cache_only_once_asked(llm):
    first, second = list(range(1, 70)), list(range(100, 170))
    llm.generate([first], GREEDY)
    _idle(llm)
    assert llm.client.snapshot.prefix_cache is NO_PREFIX_CACHE
    llm.client.publish_prefix_cache()
    llm.generate([second], GREEDY)
    _idle(llm)
    view = llm.client.snapshot.prefix_cache
    for prompt in (first, second, first[:20] + second):
        assert view.cached_prefix_tokens(prompt) == llm.core.kv.cached_prefix_tokens(prompt)
    assert view.cached_prefix_tokens(first) > 0 and view.cached_prefix_tokens(second) > 0


def test_the_last_step_is_published(llm):
    reports = []
    llm.client.step_listeners.append(reports.append)
    llm.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]], GREEDY)
    _idle(llm)
    last = llm.core.scheduler.last_step_stats
    assert llm.client.last_step == reports[-1] and reports[-1].batch_size == last.batch_size
    assert llm.client.snapshot.last_batch_size == last.batch_size
    assert max(r.batch_size for r in reports) == 3 and llm.client.snapshot.steps == len(reports)


def test_a_stop_string_is_finished_by_the_client_and_frees_its_blocks(llm):
    full = llm.generate([[5, 6, 7]], GREEDY)[0]
    stop = full.text[3:5]
    assert stop
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=[stop]))[0]
    _idle(llm)
    assert out.finish_reason == "stop" and out.stop_reason == stop and len(out.token_ids) < 8
    assert not llm.core.has_unfinished() and llm.core.kv.num_free_blocks == llm.core.kv.num_blocks
    assert llm.client.snapshot.finished == {"length": 1, "stop": 1}
