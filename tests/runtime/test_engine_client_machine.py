"""A Hypothesis state machine over the engine client on the real tiny model: requests submitted,
aborted, timed out, refused (too long) and caught by engine faults, in any order, while the
client's thread steps on its own. Whatever happens, every request ends exactly once (a final delta
or an error, nothing after it), the books balance, and every KV block comes back."""

from __future__ import annotations

import threading
import time

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test

from kiln import LLM, RuntimeConfig, SamplingParams
from kiln.runtime.engine_client import EngineError


class RecordingSink:
    def __init__(self):
        self.events: list[tuple[str, object]] = []
        self.done = threading.Event()

    def deliver(self, delta):
        self.events.append(("delta", delta))
        if delta.finished:
            self.done.set()

    def fail(self, error):
        self.events.append(("error", error))
        self.done.set()

    def cancelled(self):
        return False

    def ended_once(self) -> bool:
        ends = [i for i, (kind, x) in enumerate(self.events) if kind == "error" or x.finished]
        return ends == [len(self.events) - 1]


class FaultyEngine:
    """Arms a one-shot fault into the real engine's execute()."""

    def __init__(self, engine):
        self.armed = threading.Event()
        real = engine.execute

        def execute(batch):
            if self.armed.is_set():
                self.armed.clear()
                raise RuntimeError("injected engine fault")
            return real(batch)
        engine.execute = execute


class EngineClientMachine(RuleBasedStateMachine):
    llm: LLM                    # one engine for every example (set by the test below)
    faults: FaultyEngine

    def __init__(self):
        super().__init__()
        self.client = self.llm.client
        self.sinks: dict[str, RecordingSink] = {}
        self.finished_before = sum(self.client.snapshot.finished.values())
        self.failures_before = self.client.snapshot.engine_failures
        self.next_id = 0

    @rule(prompt_len=st.sampled_from([1, 7, 16, 33, 90, 150, 2000]), max_tokens=st.integers(1, 60),
          temperature=st.sampled_from([0.0, 1.0]))
    def submit(self, prompt_len, max_tokens, temperature):
        request_id = f"m{self.next_id}"
        self.next_id += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=1, ignore_eos=True)
        self.sinks[request_id] = RecordingSink()
        prompt = [(i * 7 + self.next_id) % 256 for i in range(prompt_len)]
        self.client.submit(self.llm.make_request(prompt, params, request_id), self.sinks[request_id])

    @precondition(lambda self: self.sinks)
    @rule(data=st.data())
    def abort(self, data):
        self.client.abort(data.draw(st.sampled_from(sorted(self.sinks))))

    @precondition(lambda self: self.sinks)
    @rule(data=st.data())
    def time_out(self, data):
        self.client.timeout(data.draw(st.sampled_from(sorted(self.sinks))))

    @rule()
    def fault_in_the_next_step(self):
        self.faults.armed.set()

    @rule()
    def wait_for_one(self):
        """Let the engine run until some request ends (if any is still open)."""
        open_ = [s for s in self.sinks.values() if not s.done.is_set()]
        if open_:
            open_[0].done.wait(30)

    def teardown(self):
        for request_id, sink in self.sinks.items():
            assert sink.done.wait(60), f"{request_id} never ended"
        self.faults.armed.clear()
        deadline = time.monotonic() + 30
        while self.client._thread is not None:         # the loop exits once idle
            assert time.monotonic() < deadline, "the engine loop did not go idle"
            time.sleep(0.005)
        kv = self.llm.core.kv
        assert kv.num_free_blocks == kv.num_blocks and not self.llm.core.has_unfinished()
        assert all(s.ended_once() for s in self.sinks.values())
        snapshot = self.client.snapshot
        assert sum(snapshot.finished.values()) - self.finished_before == len(self.sinks)
        failed = [s for s in self.sinks.values() if isinstance(s.events[-1][1], EngineError)]
        assert bool(failed) <= (snapshot.engine_failures > self.failures_before)
        for s in self.sinks.values():
            kind, last = s.events[-1]
            event(f"ended: {type(last).__name__ if kind == 'error' else last.finish_reason}")


def test_engine_client_state_machine(tiny_llama_artifact):
    # NOTE: 16 blocks of 16 tokens: a few long requests at once force preemption and refusals.
    llm = LLM(tiny_llama_artifact, RuntimeConfig(kv_cache_memory=16 << 20, max_kv_blocks=16, threads=1))
    EngineClientMachine.llm, EngineClientMachine.faults = llm, FaultyEngine(llm.core.engine)
    try:
        run_state_machine_as_test(EngineClientMachine, settings=settings(
            max_examples=25, stateful_step_count=12, deadline=None,
            suppress_health_check=[HealthCheck.too_slow]))
    finally:
        llm.shutdown()
        del EngineClientMachine.llm, EngineClientMachine.faults

