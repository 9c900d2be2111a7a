"""The batch wait window through the engine client on the tiny model: two prompts submitted a few
milliseconds apart share one prefill step, and a prompt arriving beside a running decode joins
it at once (the decode's steps are never held). Assertions are on the step reports, not on time:
the window is long (a second) so that only a stalled machine could split the pair."""

from __future__ import annotations

import threading
import time

from kiln import LLM, RuntimeConfig, SamplingParams
from kiln.config import SchedulerConfig
from kiln.runtime.sinks import CompletionSink

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _llm(artifact, **sched):
    return LLM(artifact, RuntimeConfig(kv_cache_memory=16 << 20, scheduler=SchedulerConfig(**sched)))


def _record_steps(llm) -> list:
    reports = []
    llm.client.step_listeners.append(reports.append)
    return reports


def _submit(llm, prompt, params=GREEDY):
    request = llm.make_request(prompt, params)
    sink = CompletionSink(request, llm.outputs)
    llm.client.submit(request, sink)
    return request, sink


def test_two_prompts_a_few_ms_apart_share_one_prefill_step(tiny_llama_artifact):
    llm = _llm(tiny_llama_artifact, batch_wait=1.0, batch_wait_batch=2)
    try:
        reports = _record_steps(llm)
        _, first = _submit(llm, [5, 6, 7, 8, 9])
        time.sleep(0.005)
        _, second = _submit(llm, [11, 12, 13])
        first.result(), second.result()
        assert (reports[0].batch_size, reports[0].num_prefill_chunks) == (2, 2)
        assert reports[0].batch_wait_seconds is not None
        assert all(r.batch_size > 0 for r in reports)       # holds never count as steps
    finally:
        llm.shutdown()


def test_without_the_window_the_first_prompt_prefills_alone(tiny_llama_artifact):
    llm = _llm(tiny_llama_artifact)
    try:
        reports = _record_steps(llm)
        started = threading.Event()
        llm.client.step_listeners.append(lambda r: started.set())
        _, first = _submit(llm, [5, 6, 7, 8, 9])
        assert started.wait(20)
        _, second = _submit(llm, [11, 12, 13])
        first.result(), second.result()
        assert (reports[0].batch_size, reports[0].num_prefill_chunks) == (1, 1)
    finally:
        llm.shutdown()


def test_a_running_decode_is_not_held_by_the_window(tiny_llama_artifact):
    """With a 1 s window and a preferred batch of 8, a hold beside decodes would keep b out
    until a finished (its 40 steps take far less than a second here) or the window ended."""
    llm = _llm(tiny_llama_artifact, batch_wait=1.0, batch_wait_batch=8)
    try:
        reports = _record_steps(llm)
        decoding = threading.Event()
        llm.client.step_listeners.append(lambda r: len(reports) >= 3 and decoding.set())
        long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        a, first = _submit(llm, [5, 6, 7, 8, 9], long)
        assert decoding.wait(20)
        b, second = _submit(llm, [11, 12, 13])
        first.result(), second.result()
        joined = [r for r in reports if r.batch_size == 2 and r.num_prefill_chunks == 1]
        assert joined, "b never prefilled beside a's decode"
        # 40 steps in all: a gained a token at every one (none skipped for the window), and all
        # of b's steps ran beside a's
        assert a.num_output_tokens == 40 and b.num_output_tokens == 8 and len(reports) == 40
    finally:
        llm.shutdown()
