"""Disaggregated prefill and decode on the tiny model: a prefill worker process and a decode worker
process over one artifact, the prompt's KV blocks handed over in shared memory. Greedy output is
the colocated runtime's token for token (one request at a time: the same engine, request and batch
shapes on both paths, so the comparison is exact); no KV block and no shared-memory segment is left
after completion, cancellation before and after the handover, and a killed worker."""

from __future__ import annotations

import glob
import time

import pytest

from kiln import LLM, RuntimeConfig, SamplingParams
from kiln.runtime.disagg.coordinator import DisaggregatedLLM, WorkerFailed
from kiln.runtime.disagg.handover import SEGMENT_PREFIX

CONFIG = RuntimeConfig(kv_cache_memory=16 << 20, threads=1)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9] * 7, [11, 12, 13], list(range(20, 60))]     # 35, 3 and 40 tokens: partial blocks


def segments() -> list[str]:
    return glob.glob(f"/dev/shm/{SEGMENT_PREFIX}*")


def all_free(llm: DisaggregatedLLM, role: str) -> bool:
    free, total, unfinished = llm.stats(role)
    return free == total and not unfinished


@pytest.fixture(scope="module")
def colocated(tiny_llama_artifact):
    llm = LLM(tiny_llama_artifact, CONFIG)
    outs = [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    llm.shutdown()
    return outs


@pytest.fixture
def disagg(tiny_llama_artifact):
    llm = DisaggregatedLLM(tiny_llama_artifact, CONFIG)
    yield llm
    llm.shutdown()
    assert not segments()


def _until(llm, predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        llm._pump(timeout)


def test_greedy_output_matches_the_colocated_runtime_and_nothing_leaks(disagg, colocated):
    got = [disagg.generate([p], GREEDY)[0] for p in PROMPTS]
    assert got == colocated
    assert len(disagg.generate(PROMPTS, GREEDY)) == 3                  # concurrent requests finish too
    assert all_free(disagg, "prefill") and all_free(disagg, "decode") and not segments()


def test_a_first_token_that_ends_the_request_never_reaches_the_decode_worker(disagg, colocated):
    (tokens, reason), = disagg.wait([disagg.submit(PROMPTS[0], SamplingParams(max_tokens=1, temperature=0))])
    assert (tokens, reason) == (colocated[0][:1], "length")
    assert all_free(disagg, "decode")


def test_cancelled_after_the_handover_frees_both_sides(disagg):
    request_id = disagg.submit(PROMPTS[2], LONG)
    _until(disagg, lambda: disagg.handed_over(request_id))
    disagg.abort(request_id)
    (tokens, reason), = disagg.wait([request_id])
    assert reason == "abort" and len(tokens) < 400
    assert all_free(disagg, "prefill") and all_free(disagg, "decode") and not segments()


def test_cancelled_before_the_handover_frees_both_sides(disagg):
    request_id = disagg.submit(PROMPTS[2], LONG)
    disagg.abort(request_id)                     # the prefill may or may not have handed it over yet
    (_, reason), = disagg.wait([request_id])
    assert reason == "abort"
    assert all_free(disagg, "prefill") and all_free(disagg, "decode") and not segments()


def test_a_killed_decode_worker_fails_its_requests_and_leaves_nothing_behind(disagg):
    request_id = disagg.submit(PROMPTS[0], LONG)
    _until(disagg, lambda: disagg.handed_over(request_id))
    disagg.workers["decode"][0].kill()
    with pytest.raises(WorkerFailed, match="decode worker died"):
        disagg.wait([request_id])
    assert disagg.results[request_id][1].startswith("error")
    assert all_free(disagg, "prefill") and not segments()
    with pytest.raises(WorkerFailed):
        disagg.submit(PROMPTS[1], GREEDY)


def test_a_killed_prefill_worker_fails_the_requests_it_held(disagg):
    disagg.workers["prefill"][0].kill()
    disagg.workers["prefill"][0].join(10)
    with pytest.raises(WorkerFailed, match="prefill worker died"):
        disagg.generate([PROMPTS[1]], GREEDY)
    assert all_free(disagg, "decode") and not segments()
