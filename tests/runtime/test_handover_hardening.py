"""Hardening, second round (issue 45, item 11): the disaggregated handover on the tiny model. A
handover the decode worker cannot take (a shape that is not its pool's layout, a segment shorter
than its shape, a segment outside the session, a first token outside the vocabulary) ends that
request with an error and the worker goes on serving; segments never read (still in the pipe) are
gone after a shutdown, and after the coordinator is dropped without one."""

from __future__ import annotations

import gc
import glob
import time
import uuid
from dataclasses import replace
from multiprocessing import resource_tracker, shared_memory

import pytest

from kiln import RuntimeConfig, SamplingParams
from kiln.runtime.disagg.coordinator import DisaggregatedLLM
from kiln.runtime.disagg.handover import SEGMENT_PREFIX

CONFIG = RuntimeConfig(kv_cache_memory=16 << 20, threads=1)
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
PROMPT = list(range(20, 60))


def _segments(prefix: str = SEGMENT_PREFIX) -> list[str]:
    return glob.glob(f"/dev/shm/{prefix}*")


def _make_segment(name: str, size: int) -> None:
    segment = shared_memory.SharedMemory(create=True, size=size, name=name)
    resource_tracker.unregister(segment._name, "shared_memory")   # noqa: SLF001 (the test unlinks it)
    segment.close()


def _unlink(name: str) -> None:
    try:
        segment = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return
    segment.close()
    segment.unlink()


@pytest.fixture(scope="module")
def disagg(tiny_llama_artifact):
    llm = DisaggregatedLLM(tiny_llama_artifact, CONFIG)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def real_handover(disagg):
    """A handover as the prefill worker writes it (its segment imported and gone by now)."""
    request_id = disagg.submit(PROMPT, LONG)
    deadline = time.monotonic() + 60
    while not disagg.handed_over(request_id):
        assert time.monotonic() < deadline
        disagg._pump(60)
    handover = disagg._handovers[request_id]
    disagg.abort(request_id)
    disagg.wait([request_id])
    return handover


def _send_to_decode(llm: DisaggregatedLLM, handover) -> tuple[list[int], str]:
    llm._params[handover.request_id] = GREEDY
    llm._send("decode", ("decode", handover, GREEDY))
    return llm.wait([handover.request_id], timeout=60)[0]


def _prefix(llm) -> str:
    return getattr(llm, "prefix", SEGMENT_PREFIX)


@pytest.mark.parametrize("flaw", ["shape", "short_segment", "foreign_segment", "first_token"])
def test_a_bad_handover_ends_its_request_and_the_decode_worker_lives(disagg, real_handover, flaw):
    request_id = f"bad-{flaw}-{uuid.uuid4().hex[:6]}"
    name = f"{_prefix(disagg)}{uuid.uuid4().hex[:12]}"
    nbytes = 4
    for d in real_handover.shape:
        nbytes *= d
    handover = replace(real_handover, request_id=request_id, segment=name)
    if flaw == "shape":
        handover = replace(handover, shape=(*real_handover.shape[:3], real_handover.shape[3] + 50,
                                            *real_handover.shape[4:]))
    elif flaw == "short_segment":
        nbytes = 64
    elif flaw == "foreign_segment":
        name = f"kiln-test-victim-{uuid.uuid4().hex[:12]}"            # someone else's segment
        handover = replace(handover, segment=name)
    elif flaw == "first_token":
        handover = replace(handover, first_token=10 ** 9)
    _make_segment(name, nbytes)
    try:
        tokens, reason = _send_to_decode(disagg, handover)
        assert tokens == [] and reason.startswith("error: bad handover"), reason
        assert disagg.workers["decode"][0].is_alive()
        assert (f"/dev/shm/{name}" in glob.glob(f"/dev/shm/{name}")) == (flaw == "foreign_segment")
        free, total, unfinished = disagg.stats("decode")
        assert free == total and not unfinished
        assert disagg.generate([PROMPT[:9]], GREEDY)[0]                  # and it serves the next request
    finally:
        _unlink(name)


@pytest.mark.parametrize("ending", ["shutdown", "dropped"])
def test_handovers_never_read_leave_no_segment(tiny_llama_artifact, ending):
    """Three prompts' handovers written and sent, never read by the coordinator: a shutdown, or the
    coordinator dropped without one (an exception unwinding past it), unlinks them all."""
    llm = DisaggregatedLLM(tiny_llama_artifact, CONFIG)
    prefix = _prefix(llm)
    procs = [proc for proc, _ in llm.workers.values()]
    try:
        for i in range(3):
            llm.submit([i + 5] * 20, LONG)
        deadline = time.monotonic() + 60
        while len(_segments(prefix)) < 3:
            assert time.monotonic() < deadline, "the prefill worker wrote no handovers"
            time.sleep(0.05)
        if ending == "shutdown":
            llm.shutdown()
        else:
            del llm
            gc.collect()
        assert not _segments(prefix)
        assert not any(proc.is_alive() for proc in procs)
    finally:
        for name in _segments(prefix):                                  # old code's leftovers
            _unlink(name.rsplit("/", 1)[1])
        for proc in procs:
            if proc.is_alive():
                proc.kill()
