"""The speculative rollback as a state machine (no model): requests come, decode with random
proposals of which a random prefix is accepted, get preempted and aborted; after every step each
request's block table covers exactly its computed tokens, the pool's books balance, and at the
end every block is free."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kiln.config import SchedulerConfig
from kiln.runtime.kv_manager import KVCacheManager
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import RunnerOutput, Scheduler
from kiln.runtime.speculative.speculator import Speculator

BS, BLOCKS = 4, 12


class RandomProposer:
    """Proposes k copies of a token drawn by the state machine (a Proposer)."""

    def __init__(self):
        self.token = 5

    def propose(self, requests):
        return {r.request_id: [self.token] * k for r, k in requests}

    def forget(self, request_id):
        pass


class RollbackMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.proposer = RandomProposer()
        config = SchedulerConfig(max_num_batched_tokens=12, max_model_len=40, target_itl=0)
        self.kv = KVCacheManager(BLOCKS, BS, enable_caching=True)
        self.sched = Scheduler(config, self.kv, Speculator(self.proposer, 4, max_step_tokens=12))
        self.ids = 0

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=10), max_tokens=st.integers(1, 12))
    def add(self, prompt, max_tokens):
        self.ids += 1
        self.sched.add_request(Request(f"r{self.ids}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0)))

    @rule(data=st.data())
    def step(self, data):
        self.proposer.token = data.draw(st.integers(0, 3))
        out = self.sched.schedule()
        runner = RunnerOutput()
        for s in out.scheduled:
            if s.samples_token:
                runner.sampled_token_ids[s.request.request_id] = data.draw(st.integers(0, 3))
            if s.proposed:
                runner.num_accepted[s.request.request_id] = data.draw(st.integers(0, len(s.proposed)))
        self.sched.update(out, runner)

    @rule(data=st.data())
    def abort(self, data):
        if self.sched.requests:
            self.sched.abort(data.draw(st.sampled_from(sorted(self.sched.requests))))

    @invariant()
    def tables_cover_exactly_the_computed_tokens(self):
        self.kv.pool.check_invariants()
        for r in self.sched.requests.values():
            assert len(self.kv.block_table(r.request_id)) == -(-r.num_computed_tokens // BS), r
            assert r.num_computed_tokens <= r.num_tokens - 1 or r.num_computed_tokens == 0

    def teardown(self):
        for rid in list(self.sched.requests):
            self.sched.abort(rid)
        assert self.kv.num_free_blocks == BLOCKS
        self.kv.pool.check_invariants()


TestRollback = RollbackMachine.TestCase
