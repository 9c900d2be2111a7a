"""Faults the engine client's failure policy cannot absorb, on the real tiny model: a step that
raises a BaseException (a native panic), an error inside the step-failure handler, and a step
that never returns (the watchdog). Each ends the requests in flight with EngineFault at once, sets
`client.fault` to the reason, refuses new requests, frees the KV blocks once the engine thread has
control again, and leaves no thread behind. And a stream's timeout fires while the loop is stuck."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kiln import LLM, RuntimeConfig, SamplingParams
from kiln.runtime.engine_client import EngineError, EngineFault
from waiting import wait_until

LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
PROMPT = [5, 6, 7, 8, 9]


class Panic(BaseException):
    """What a native extension's panic looks like from Python (pyo3's PanicException)."""


@pytest.fixture
def llm(tiny_llama_artifact):
    llm = LLM(tiny_llama_artifact, RuntimeConfig(kv_cache_memory=16 << 20, threads=1))
    yield llm
    llm.shutdown()


def _on_step(llm, n: int, action) -> None:
    """From the engine's n-th execute() on, run `action` (which raises or blocks) instead."""
    engine, calls = llm.core.engine, [0]
    real = engine.execute

    def execute(batch):
        calls[0] += 1
        if calls[0] >= n:
            action()
        return real(batch)
    engine.execute = execute


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("kiln-engine")}


def _all_free(llm) -> bool:
    kv = llm.core.kv
    return kv.num_free_blocks == kv.num_blocks and not llm.core.has_unfinished()


async def _run_stream(llm, timeout=20.0) -> tuple[list, BaseException | None, float]:
    """(deltas, error, seconds) of one long stream, bounded so the old code fails, not hangs."""
    deltas, t0 = [], time.monotonic()

    async def consume():
        async for d in llm.client.stream(llm.make_request(PROMPT, LONG)):
            deltas.append(d)
    try:
        await asyncio.wait_for(consume(), timeout)
    except (Exception, asyncio.TimeoutError) as e:
        return deltas, e, time.monotonic() - t0
    return deltas, None, time.monotonic() - t0


def _assert_faulted(llm, error, reason: str):
    assert isinstance(error, EngineFault), f"expected EngineFault, got {error!r}"
    assert llm.client.fault is not None and reason in llm.client.fault
    with pytest.raises(EngineFault, match=reason):     # refused at once, not queued forever
        llm.generate([PROMPT], SamplingParams(max_tokens=2))


def test_a_base_exception_in_a_step_ends_the_requests_and_faults_the_client(llm):
    def panic():
        raise Panic("native panic in the engine")
    _on_step(llm, 3, panic)
    deltas, error, seconds = asyncio.run(_run_stream(llm))
    assert deltas and not deltas[-1].finished and seconds < 10
    _assert_faulted(llm, error, "native panic in the engine")
    wait_until(lambda: llm.client._thread is None and not _threads())
    assert _all_free(llm) and llm.client.snapshot.kv_blocks_used == 0
    assert llm.client.snapshot.engine_failures == 1 and llm.client.snapshot.finished.get("error") == 1


def test_an_error_inside_the_failure_handler_faults_the_client(llm):
    def fault():
        raise RuntimeError("injected engine fault")
    _on_step(llm, 3, fault)
    real_abort = llm.core.abort

    def abort(request_id):                   # the clean-up after the failed step fails too
        raise RuntimeError("abort failed")
    llm.core.abort = abort
    try:
        deltas, error, seconds = asyncio.run(_run_stream(llm))
    finally:
        llm.core.abort = real_abort
    assert seconds < 10
    _assert_faulted(llm, error, "abort failed")
    wait_until(lambda: llm.client._thread is None and not _threads())


def test_an_ordinary_step_error_still_recovers(llm):
    """The policy for an Exception is unchanged: the requests fail, the client serves the next."""
    fired = threading.Event()

    def fault_once():
        if not fired.is_set():
            fired.set()
            raise RuntimeError("injected engine fault")
    _on_step(llm, 3, fault_once)
    deltas, error, _ = asyncio.run(_run_stream(llm))
    assert isinstance(error, EngineError) and not isinstance(error, EngineFault)
    assert llm.client.fault is None
    # ignore_eos: sampled at the default temperature, the tiny model may end on its EOS in two tokens
    assert llm.generate([PROMPT], SamplingParams(max_tokens=2, ignore_eos=True))[0].finish_reason == "length"


def test_the_watchdog_ends_a_stuck_step(llm):
    llm.client.step_timeout = 0.5
    release = threading.Event()
    _on_step(llm, 3, lambda: release.wait(60))
    try:
        deltas, error, seconds = asyncio.run(_run_stream(llm))
        assert seconds < 5, f"the stream waited {seconds:.1f} s"
        _assert_faulted(llm, error, "more than 0.5 s")
        assert llm.client._thread is not None and llm.client._thread.is_alive()   # still stuck
    finally:
        release.set()
    # Once the step comes back the engine thread frees the blocks and exits; so does the watchdog.
    wait_until(lambda: llm.client._thread is None and not _threads())
    assert _all_free(llm)
    assert llm.client.snapshot.kv_blocks_used == 0


def test_shutdown_does_not_hang_on_a_stuck_step(llm):
    llm.client.step_timeout = 0.3
    release = threading.Event()
    _on_step(llm, 2, lambda: release.wait(60))
    try:
        _, error, _ = asyncio.run(_run_stream(llm))
        assert isinstance(error, EngineFault)
        t0 = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - t0 < 5
    finally:
        release.set()
    wait_until(lambda: not _threads())


def test_a_stream_times_out_while_the_loop_is_stuck(llm):
    """No watchdog: the stream's own timeout ends it (finish_reason "timeout") without the loop."""
    release = threading.Event()
    _on_step(llm, 3, lambda: release.wait(60))

    async def go():
        request = llm.make_request(PROMPT, LONG)
        deltas, t0 = [], time.monotonic()
        asyncio.get_running_loop().call_later(0.3, llm.client.timeout, request.request_id)

        async def consume():
            async for d in llm.client.stream(request):
                deltas.append(d)
        await asyncio.wait_for(consume(), 20)
        return deltas, time.monotonic() - t0
    try:
        deltas, seconds = asyncio.run(go())
        assert deltas[-1].finished and deltas[-1].finish_reason == "timeout"
        assert seconds < 5
        assert llm.client.fault is None
    finally:
        release.set()
    wait_until(lambda: llm.client._thread is None and _all_free(llm))
