"""The backend's pure parts: request tensors -> SamplingParams, replies, and the engine client
with Triton-like sinks on the tiny model (no Triton)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kiln import LLM, RuntimeConfig, SamplingParams
from kiln.runtime.outputs import StreamDelta
from kiln.serving.triton.requests import ReplyBuilder, parse_request
from token_agreement import TOP_K, assert_all_close
from waiting import wait_until


def _inputs(**values):
    arrays = {k: np.asarray(v if isinstance(v, list) else [v]) for k, v in values.items()}
    for k in ("text_input", "stop"):
        if k in arrays:
            arrays[k] = arrays[k].astype(np.object_)
    return arrays.get


def test_defaults_are_kilns():
    req = parse_request(_inputs(text_input=b"hi"))
    assert req.prompt == "hi" and not req.stream
    assert req.params == SamplingParams()


def test_every_knob():
    req = parse_request(_inputs(text_input=b"hi", max_tokens=np.int32(5), temperature=np.float32(0.5),
                                top_p=np.float32(0.5), top_k=np.int32(3), seed=np.int64(7),
                                stop=[b"a", b"bc"], ignore_eos=True, stream=True))
    assert req.stream
    assert req.params == SamplingParams(max_tokens=5, temperature=0.5, top_p=0.5, top_k=3, seed=7,
                                        stop=("a", "bc"), ignore_eos=True)


@pytest.mark.parametrize("inputs, message", [
    (dict(max_tokens=3), "text_input is required"),
    (dict(text_input=b"hi", temperature=np.float32(-1)), "temperature must be >= 0"),
    (dict(text_input=b"hi", top_p=np.float32(0)), "top_p must be in"),
    (dict(text_input=b"hi", max_tokens=[1, 2]), "exactly one value"),
    (dict(text_input=b"\xff"), "UTF-8"),
])
def test_bad_requests(inputs, message):
    with pytest.raises(ValueError, match=message):
        parse_request(_inputs(**inputs))


def test_replies_streamed_or_whole():
    deltas = [StreamDelta("r", "Hel", [1]), StreamDelta("r", "lo", [2, 3], True, "length")]
    streamed = [ReplyBuilder(stream=True).on_delta(d, 2) for d in deltas]
    assert [(r.text, r.final) for r in streamed] == [("Hel", False), ("lo", True)]
    whole = ReplyBuilder(stream=False)
    assert whole.on_delta(deltas[0], 1) is None
    reply = whole.on_delta(deltas[1], 1)
    assert (reply.text, reply.token_ids, reply.finish_reason, reply.final) == ("Hello", [1, 2, 3], "length", True)
    arrays = reply.arrays()
    assert arrays["text_output"][0] == b"Hello" and arrays["token_ids"].dtype == np.int32


class ListSink:
    """Records what the engine client hands a Triton request's sink (as TritonSink does, with the
    batch size of the step that produced each delta)."""

    def __init__(self, llm):
        self.llm = llm
        self.deltas, self.errors, self.batch_sizes = [], [], []
        self.cancel, self.done = False, threading.Event()

    def deliver(self, delta):
        self.deltas.append(delta)
        self.batch_sizes.append(self.llm.client.last_step.batch_size)
        if delta.finished:
            self.done.set()

    def fail(self, error):
        self.errors.append(str(error))
        self.done.set()

    def cancelled(self):
        return self.cancel


@pytest.fixture
def llm(tiny_llama_artifact):
    llm = LLM(tiny_llama_artifact, RuntimeConfig(kv_cache_memory=16 << 20))
    yield llm
    llm.shutdown()


def test_client_batches_concurrent_requests_and_matches_generate(llm):
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=TOP_K)
    prompts = ["The quick brown fox", "Hello", "Once upon a time", "abc"]
    expected = llm.generate(prompts, greedy)
    snapshots = []
    llm.client.snapshot_listeners.append(snapshots.append)
    sinks = [ListSink(llm) for _ in prompts]
    for prompt, sink in zip(prompts, sinks):
        llm.client.submit(llm.make_request(prompt, greedy), sink)
    for sink in sinks:
        assert sink.done.wait(20)
    wait_until(lambda: snapshots[-1].num_running == 0)
    # submitted one by one (and the second time with prefix-cache hits): up to a near-tie
    got = [(sum((d.token_ids for d in s.deltas), []), sum((d.logprobs for d in s.deltas), [])) for s in sinks]
    ties = assert_all_close(got, expected, names=("submitted", "generated"))
    for sink, e, tie in zip(sinks, expected, ties):
        assert tie is not None or "".join(d.text for d in sink.deltas) == e.text
    assert max(b for s in sinks for b in s.batch_sizes) > 1
    last = snapshots[-1]
    assert last.kv_blocks_used == 0 and last.finished == {"length": 8}     # generate's 4, then these
    assert last.scheduled_sequences > last.steps        # mean batch above one


def test_cancelled_request_frees_blocks_and_bad_prompt_fails(llm):
    snapshots = []
    llm.client.snapshot_listeners.append(snapshots.append)
    sink = ListSink(llm)
    llm.client.submit(llm.make_request("x" * 40, SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)), sink)
    wait_until(lambda: len(sink.deltas) >= 3)
    assert snapshots[-1].kv_blocks_used > 0
    sink.cancel = True
    assert sink.done.wait(10)
    assert sink.deltas[-1].finished and sink.deltas[-1].finish_reason == "abort"
    wait_until(lambda: snapshots[-1].kv_blocks_used == 0)
    assert snapshots[-1].finished == {"abort": 1}

    too_long = ListSink(llm)
    llm.client.submit(llm.make_request("y" * 2000, SamplingParams()), too_long)
    assert too_long.done.wait(10)
    assert "max_model_len" in too_long.errors[0]
