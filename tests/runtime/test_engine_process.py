"""The engine in a process of its own (kiln/runtime/engine_process.py), on the real tiny model:
the same tokens as the in-process engine, the request's usage and timings back in the API
process, cancellation, timeouts, structured output bound again in the engine process, a
refused artifact, the engine process dying (a fault, never a hang) and shutdown."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time

import pytest

from kiln import LLM, RuntimeConfig, SamplingParams
from kiln.contract.artifact import ArtifactError
from kiln.runtime.engine_client import ClientClosed, EngineFault
from kiln.runtime.engine_process import EngineProcess
from kiln.runtime.structured.spec import StructuredOutput
from waiting import wait_until

CONFIG = RuntimeConfig(kv_cache_memory=16 << 20, threads=1)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama_artifact):
    engine = EngineProcess(tiny_llama_artifact, CONFIG)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def in_process(tiny_llama_artifact):
    llm = LLM(tiny_llama_artifact, CONFIG)
    yield llm
    llm.shutdown()


async def _deltas(client, request, stop_after=None):
    out = []
    async for delta in client.stream(request):
        out.append(delta)
        if stop_after is not None and len(out) >= stop_after:
            break
    return out


def test_the_engine_runs_in_another_process(engine):
    assert engine.process.pid != os.getpid() and engine.process.poll() is None
    cmdline = open(f"/proc/{engine.process.pid}/cmdline", "rb").read().split(b"\0")
    assert b"kiln.runtime.engine_worker" in cmdline                 # the engine lives there, not here
    assert not hasattr(engine, "core")


def test_same_tokens_as_the_engine_in_this_process(engine, in_process):
    prompts = [[5, 6, 7, 8], list(range(3, 40)), [9] * 20]
    ours = engine.client.complete([engine.make_request(p, GREEDY) for p in prompts])
    theirs = in_process.generate(prompts, GREEDY)
    assert [o.token_ids for o in ours] == [t.token_ids for t in theirs]
    assert [o.text for o in ours] == [t.text for t in theirs]
    assert all(o.finish_reason == "length" and o.metrics.ttft > 0 for o in ours)


def test_a_stream_carries_the_requests_usage_and_timings_back(engine):
    prompt = list(range(10, 74))           # four full blocks of 16: the second run hits the prefix cache
    first = engine.make_request(prompt, GREEDY)
    deltas = asyncio.run(_deltas(engine.client, first))
    assert sum(len(d.token_ids) for d in deltas) == GREEDY.max_tokens and deltas[-1].finished
    again = engine.make_request(prompt, GREEDY)
    asyncio.run(_deltas(engine.client, again))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 48
    t = again.timings
    assert again.arrival_time <= t.first_scheduled_time <= t.first_token_time <= t.finished_time
    assert len(t.token_times) == GREEDY.max_tokens


def test_a_consumer_that_stops_frees_the_requests_blocks(engine):
    deltas = asyncio.run(_deltas(engine.client, engine.make_request([5, 6, 7], LONG), stop_after=2))
    assert len(deltas) == 2 and not deltas[-1].finished
    wait_until(lambda: engine.client.snapshot.num_running == 0 and engine.client.snapshot.kv_blocks_used == 0)
    assert engine.client.snapshot.finished.get("abort", 0) >= 1


def test_timeout_ends_the_stream_with_a_final_delta(engine):
    async def run():
        request = engine.make_request([5, 6, 7], LONG)
        stream = engine.client.stream(request)
        first = await stream.__anext__()                  # running in the engine process now
        engine.client.timeout(request.request_id)
        return [first, *[d async for d in stream]]
    deltas = asyncio.run(run())
    assert deltas[-1].finished and deltas[-1].finish_reason == "timeout"
    assert sum(len(d.token_ids) for d in deltas) < LONG.max_tokens


def test_structured_output_is_bound_again_in_the_engine_process(engine, in_process):
    params = SamplingParams(max_tokens=40, temperature=0,
                            structured=StructuredOutput.choice(["yes", "no", "maybe"]))
    out = engine.client.complete([engine.make_request([5, 6, 7], params)])[0]
    assert out.text in ("yes", "no", "maybe") and out.finish_reason == "stop"
    schema = StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                           "required": ["a"], "additionalProperties": False})
    params = SamplingParams(max_tokens=30, temperature=0, structured=schema)
    out = engine.client.complete([engine.make_request([8, 9], params)])[0]
    assert out.text.startswith('{') and out.text == in_process.generate([[8, 9]], params)[0].text


def test_steps_reach_the_listeners_and_the_backlog_empties(engine):
    reports = []
    engine.client.step_listeners.append(reports.append)
    try:
        engine.client.complete([engine.make_request([5, 6, 7], GREEDY)])
    finally:
        engine.client.step_listeners.remove(reports.append)
    assert len(reports) >= GREEDY.max_tokens and all(r.batch_size >= 1 for r in reports)
    assert engine.client.last_step is reports[-1]
    assert engine.client.backlog() == 0


def test_a_refused_artifact_is_refused_at_start_with_the_engines_reason(tiny_llama_artifact, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_artifact, broken)
    onnx = next(p for p in broken.rglob("*") if p.is_file() and p.suffix in (".onnx", ".xml", ".bin"))
    onnx.write_bytes(onnx.read_bytes()[:-1] + b"\0")
    with pytest.raises(ArtifactError, match="checksum|rebuild"):
        EngineProcess(broken, CONFIG)


def test_an_engine_process_that_dies_faults_the_client_at_once(tiny_llama_artifact):
    engine = EngineProcess(tiny_llama_artifact, CONFIG)
    try:
        async def run():
            request = engine.make_request([5, 6, 7], LONG)
            stream = engine.client.stream(request)
            await stream.__anext__()
            os.kill(engine.process.pid, signal.SIGKILL)
            async for _ in stream:
                pass
        with pytest.raises(EngineFault, match="exited"):
            asyncio.run(run())
        assert "code -9" in engine.client.fault
        with pytest.raises(EngineFault):
            engine.client.complete([engine.make_request([1, 2], GREEDY)])
    finally:
        engine.shutdown()


def test_shutdown_ends_requests_in_flight_and_the_process(tiny_llama_artifact):
    engine = EngineProcess(tiny_llama_artifact, CONFIG)

    async def run():
        request = engine.make_request([5, 6, 7], LONG)
        stream = engine.client.stream(request)
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        async for _ in stream:
            pass
    with pytest.raises(ClientClosed):
        asyncio.run(run())
    assert engine.process.poll() is not None
    with pytest.raises(ClientClosed):
        engine.client.complete([engine.make_request([1, 2], GREEDY)])
