"""The engine client (the one loop every front end uses) on the real tiny model: its failure
policy when the engine raises mid-batch, generate() and stream() together, aborts, sinks that
fail, shutdown, and a thread that only lives while there is work."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from kiln import LLM, RuntimeConfig, SamplingParams
from kiln.runtime.engine_client import ClientClosed, EngineError
from token_agreement import TOP_K, assert_all_close, assert_outputs_close
from waiting import wait_until

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=TOP_K)
LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


def _prompts(n=4, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, k).tolist() for k in (5, 19, 33, 48)[:n]]


@pytest.fixture
def llm(tiny_llama_artifact):
    llm = LLM(tiny_llama_artifact, RuntimeConfig(kv_cache_memory=16 << 20))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_llama_artifact):
    """Each prompt generated alone on its own LLM: what every test expects back (bit-exact from a
    lone request, up to the first near-tie from a batch: tests/token_agreement.py)."""
    llm = LLM(tiny_llama_artifact, RuntimeConfig(kv_cache_memory=16 << 20))
    outs = [llm.generate([p], GREEDY)[0] for p in _prompts()]
    llm.shutdown()
    return outs


def _streamed(deltas) -> tuple[list[int], list]:
    return sum((d.token_ids for d in deltas), []), sum((d.logprobs for d in deltas), [])


def _all_free(llm) -> bool:
    kv = llm.core.kv
    return kv.num_free_blocks == kv.num_blocks and not llm.core.has_unfinished()


def _fail_on_call(llm, n: int, min_seqs: int = 1) -> list[int]:
    """Make the engine raise on its n-th execute() from now on (once) that decodes at least
    `min_seqs` sequences (each has a token out, whatever the prefill chunking); returns the count
    of such calls. (Counting every call would race: the streams reach the stepping thread one by
    one, and on a busy machine the first could run its n steps alone.)"""
    engine, calls = llm.core.engine, [0]
    real = engine.execute

    def execute(batch):
        counts = len(batch.query_lens) >= min_seqs and bool((batch.query_lens == 1).all())
        calls[0] += counts
        if counts and calls[0] == n:
            raise RuntimeError("injected engine fault")
        return real(batch)
    engine.execute = execute
    return calls


async def _collect(llm, prompt, params) -> tuple[list, Exception | None]:
    deltas = []
    try:
        async for d in llm.stream(prompt, params):
            deltas.append(d)
    except Exception as e:
        return deltas, e
    return deltas, None


def test_engine_failure_mid_batch_fails_every_stream_and_frees_every_block(llm, reference):
    prompts = _prompts()
    calls = _fail_on_call(llm, 3, min_seqs=len(prompts))   # steps with every stream holding blocks

    async def run_all():
        return await asyncio.gather(*(_collect(llm, p, GREEDY) for p in prompts))
    results = asyncio.run(run_all())

    assert calls[0] >= 3
    for deltas, error in results:
        assert isinstance(error, EngineError) and "injected engine fault" in str(error)
        assert deltas and not any(d.finished for d in deltas)     # failed mid-stream
    wait_until(lambda: llm.client.snapshot.engine_failures == 1)
    assert _all_free(llm)
    snapshot = llm.client.snapshot
    assert snapshot.kv_blocks_used == 0 and snapshot.num_running == 0
    assert snapshot.finished == {"error": len(prompts)}
    # The client stays usable: the same prompts are served again (batched: up to a near-tie).
    assert_all_close(llm.generate(prompts, GREEDY), reference, names=("again", "alone"))
    assert _all_free(llm)


def test_engine_failure_fails_generate_with_the_error(llm, reference):
    _fail_on_call(llm, 2)
    with pytest.raises(EngineError):
        llm.generate(_prompts(), GREEDY)
    wait_until(lambda: llm.client._thread is None)
    assert _all_free(llm)
    assert_all_close(llm.generate(_prompts(), GREEDY), reference, names=("again", "alone"))


def test_generate_and_streams_together_share_one_batch(llm, reference):
    prompts = _prompts()
    generated: list = []

    async def streams():
        thread = threading.Thread(target=lambda: generated.extend(llm.generate(prompts[2:], GREEDY)))
        thread.start()
        results = await asyncio.gather(*(_collect(llm, p, GREEDY) for p in prompts[:2]))
        await asyncio.to_thread(thread.join)
        return results
    streamed = asyncio.run(streams())

    assert_all_close([_streamed(deltas) for deltas, _ in streamed], reference[:2], names=("streamed", "alone"))
    assert all(error is None for _, error in streamed)
    assert_all_close(generated, reference[2:], names=("generated", "alone"))
    assert llm.client.snapshot.scheduled_sequences > llm.client.snapshot.steps   # batched, not in turns
    assert _all_free(llm)


def test_generate_from_threads_at_once(llm, reference):
    outs: dict[int, list] = {}
    threads = [threading.Thread(target=lambda i=i: outs.update({i: llm.generate([_prompts()[i]], GREEDY)}))
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert_all_close([outs[i][0] for i in range(4)], reference, names=("threaded", "alone"))
    assert _all_free(llm)


def test_a_request_that_cannot_run_fails_alone(llm, reference):
    too_long = [1] * 5000
    with pytest.raises(ValueError, match="max_model_len|context|long"):
        llm.generate([_prompts()[0], too_long], GREEDY)
    wait_until(lambda: _all_free(llm))
    assert llm.client.snapshot.finished.get("error") == 1
    # exact: alone again, as the reference ran it (5 tokens: no cached block to hit)
    assert llm.generate([_prompts()[0]], GREEDY)[0].token_ids == reference[0].token_ids


def test_consumer_that_stops_aborts_its_request(llm):
    async def read_three():
        stream = llm.stream(_prompts()[3], LONG)
        deltas = [await stream.__anext__() for _ in range(3)]
        await stream.aclose()
        return deltas
    assert len(asyncio.run(read_three())) == 3
    wait_until(lambda: _all_free(llm) and llm.client.snapshot.finished == {"abort": 1})


def test_timeout_ends_the_stream_with_a_final_delta(llm):
    async def run():
        request = llm.make_request(_prompts()[3], LONG, "slow")
        deltas = []
        async for d in llm.client.stream(request):
            deltas.append(d)
            if len(deltas) == 2:
                llm.client.timeout("slow")
        return deltas
    deltas = asyncio.run(run())
    assert deltas[-1].finished and deltas[-1].finish_reason == "timeout"
    wait_until(lambda: _all_free(llm))


class BrokenSink:
    """A consumer that went away: every delivery raises."""

    def __init__(self):
        self.calls = 0

    def deliver(self, delta):
        self.calls += 1
        raise ConnectionResetError("client gone")

    def fail(self, error):
        raise AssertionError("not expected")

    def cancelled(self):
        return False


def test_a_sink_that_raises_drops_its_request_only(llm, reference):
    sink = BrokenSink()
    llm.client.submit(llm.make_request(_prompts()[3], LONG), sink)
    # beside the long request (or alone, once the sink dropped it): up to a near-tie
    assert_outputs_close(llm.generate([_prompts()[0]], GREEDY)[0], reference[0], names=("generated", "alone"))
    wait_until(lambda: _all_free(llm))
    assert sink.calls == 1 and llm.client.snapshot.finished.get("abort") == 1


def test_shutdown_ends_streams_and_refuses_new_requests(llm):
    async def run():
        task = asyncio.ensure_future(_collect(llm, _prompts()[3], LONG))
        await asyncio.sleep(0)
        while llm.client.snapshot.num_running == 0:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(llm.shutdown)
        return await task
    deltas, error = asyncio.run(run())
    assert isinstance(error, ClientClosed) and deltas
    assert _all_free(llm)
    with pytest.raises(ClientClosed):
        llm.generate([_prompts()[0]], GREEDY)


def test_the_loop_thread_lives_only_while_there_is_work(llm, reference):
    for i, expected in enumerate(reference[:2]):   # it exits when idle, and a new request starts it again
        # exact: each prompt alone, its first time on this engine, as the reference ran it
        assert llm.generate([_prompts()[i]], GREEDY)[0].token_ids == expected.token_ids
        wait_until(lambda: llm.client._thread is None)
