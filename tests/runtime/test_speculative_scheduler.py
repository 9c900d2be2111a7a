"""Speculative decoding in the scheduler and runner, with no model: a decode's proposals ride in
its chunk, rejected ones are rolled back (num_computed_tokens, and blocks that hold only them),
and over a fake engine that reads its context back through the block tables the output equals
one-token-at-a-time decoding whatever is proposed, chunked, preempted or cached."""

from __future__ import annotations

import numpy as np
from fake_engine import VOCAB, FakeEngine, next_token
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.config import SchedulerConfig
from kiln.runtime.kv_manager import KVCacheManager
from kiln.runtime.request import Request
from kiln.runtime.runner import ModelRunner
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import RunnerOutput, Scheduler
from kiln.runtime.speculative.speculator import Speculator


class ScriptedProposer:
    """Proposes what a test scripts, per request id (a Proposer)."""

    def __init__(self, script: dict[str, list[int]] | None = None):
        self.script = script or {}
        self.forgotten: list[str] = []

    def propose(self, requests):
        return {r.request_id: self.script[r.request_id][:k] for r, k in requests if r.request_id in self.script}

    def forget(self, request_id):
        self.forgotten.append(request_id)


class OracleProposer:
    """Proposes the true continuation for a random number of tokens, then random tokens."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def propose(self, requests):
        out = {}
        for r, k in requests:
            tokens, good = list(r.all_token_ids), int(self.rng.integers(0, k + 1))
            for i in range(k):
                tokens.append(next_token(tokens) if i < good else int(self.rng.integers(0, VOCAB)))
            out[r.request_id] = tokens[r.num_tokens:]
        return out

    def forget(self, request_id):
        pass


def make_scheduler(proposer, num_blocks=64, block_size=4, k=5, max_step_tokens=16, **config):
    config = SchedulerConfig(**config)
    kv = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching)
    return Scheduler(config, kv, Speculator(proposer, k, max_step_tokens))


def greedy(rid, prompt, max_tokens=8):
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def _prefill(sched, token=7):
    out = sched.schedule()
    sched.update(out, RunnerOutput({s.request.request_id: token for s in out.scheduled if s.samples_token}))


def test_proposals_ride_in_the_decode_chunk_and_rejected_ones_roll_back():
    sched = make_scheduler(ScriptedProposer({"a": [20, 21, 22, 23, 24]}), block_size=4, k=5)
    a = greedy("a", [1, 2, 3], max_tokens=20)
    sched.add_request(a)
    _prefill(sched)                                        # 3 prompt tokens; sampled 7
    assert (a.num_tokens, a.num_computed_tokens) == (4, 3)
    out = sched.schedule()
    (s,) = out.scheduled
    # ceil(5 x 0.6) = 3 proposals after the last token: positions 3..6, blocks 0 and 1
    assert s.proposed == (20, 21, 22) and s.num_new_tokens == 4
    assert len(sched.kv.block_table("a")) == 2
    sched.update(out, RunnerOutput({"a": 9}, num_accepted={"a": 1}))
    assert a.output_token_ids == [7, 20, 9]
    assert a.num_computed_tokens == 5                      # 3 + the last token + 1 kept proposal
    assert len(sched.kv.block_table("a")) == 2             # position 4 lives in block 1
    stats = sched.speculator.stats
    assert (stats.proposed, stats.accepted) == (3, 1)


def test_update_returns_the_accepted_tokens_up_to_a_stop_token():
    sched = make_scheduler(ScriptedProposer({"a": [20, 21, 22, 23, 24]}), block_size=4, k=5)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[21]))
    sched.add_request(a)
    _prefill(sched)
    out = sched.schedule()
    update = sched.update(out, RunnerOutput({"a": 9}, num_accepted={"a": 3}))
    (delta,) = update.deltas
    assert delta.new_token_ids == [20, 21] and a.output_token_ids == [7, 20, 21]   # 22 and 9 dropped
    assert update.finished == [a] and a.finish_reason == "stop" and a.stop_reason == 21


def test_a_block_holding_only_rejected_proposals_is_freed():
    sched = make_scheduler(ScriptedProposer({"a": [20, 21, 22, 23, 24]}), block_size=4, k=5)
    a = greedy("a", [1, 2, 3], max_tokens=20)
    sched.add_request(a)
    _prefill(sched)
    out = sched.schedule()
    assert len(sched.kv.block_table("a")) == 2
    sched.update(out, RunnerOutput({"a": 9}, num_accepted={"a": 0}))
    assert a.num_computed_tokens == 4 and a.output_token_ids == [7, 9]
    assert len(sched.kv.block_table("a")) == 1             # block 1 held only positions 4..6
    assert sched.kv.num_free_blocks == 63
    sched.kv.pool.check_invariants()


def test_proposals_leave_room_for_the_decodes_after_them_and_never_preempt():
    proposer = ScriptedProposer({"a": [20] * 5, "b": [30] * 5})
    sched = make_scheduler(proposer, block_size=4, k=5, max_num_batched_tokens=5)
    a, b = greedy("a", [1, 2, 3], 20), greedy("b", [4, 5, 6], 20)
    sched.add_request(a)
    sched.add_request(b)
    _prefill(sched)
    out = sched.schedule()
    # budget 5: a may take 3 (its own, 3 proposals) only if b keeps 1; b gets what is left
    assert [(s.request.request_id, len(s.proposed)) for s in out.scheduled] == [("a", 3), ("b", 0)]

    # two blocks of 4, one each: a's 3 proposals would need a second block, so they are dropped
    tight = make_scheduler(ScriptedProposer({"a": [20] * 5}), num_blocks=2, block_size=4, k=5)
    for r in (greedy("a", [1, 2, 3], 5), greedy("b", [4, 5, 6], 2)):
        tight.add_request(r)
    _prefill(tight)
    out = tight.schedule()
    assert [(s.request.request_id, s.num_new_tokens, s.proposed) for s in out.scheduled] == [("a", 1, ()), ("b", 1, ())]
    assert not out.preempted_request_ids


def test_finished_requests_are_forgotten_by_the_proposer():
    proposer = ScriptedProposer()
    sched = make_scheduler(proposer)
    sched.add_request(greedy("a", [1, 2, 3], 1))
    _prefill(sched)
    assert proposer.forgotten == ["a"]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.sampled_from([6, 9, 64]),
       budget=st.sampled_from([4, 7, 64]), k=st.integers(1, 6), caching=st.booleans())
def test_output_equals_plain_decoding_whatever_is_proposed(seed, num_blocks, budget, k, caching):
    config = SchedulerConfig(max_num_batched_tokens=budget, enable_prefix_caching=caching,
                             max_model_len=64, target_itl=0)
    kv = KVCacheManager(num_blocks, 4, caching)
    engine = FakeEngine(4)
    engine.allocate_kv(num_blocks)
    sched = Scheduler(config, kv, Speculator(OracleProposer(seed), k, max_step_tokens=16))
    runner = ModelRunner(engine, kv)
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, VOCAB, 9).tolist()             # a prefix the prompts share: cache hits
    prompts = [shared + rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(1, 6, 4)]
    requests = [greedy(f"r{i}", p, int(rng.integers(1, 12))) for i, p in enumerate(prompts)]
    for r in requests:
        sched.add_request(r)
    for _ in range(500):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        kv.pool.check_invariants()
        _cached_blocks_hold_their_tokens(sched, engine)
    assert not sched.has_unfinished()
    for r, p in zip(requests, prompts):
        assert r.output_token_ids == _reference(p, r.max_tokens)
    assert kv.num_free_blocks == num_blocks


def _cached_blocks_hold_their_tokens(sched, engine):
    """Every block the prefix cache knows holds, in the engine's slots, the tokens of the
    running request that computed it: no rejected proposal ever enters the cache."""
    bs = sched.kv.block_size
    for r in sched.running:
        table = sched.kv.block_table(r.request_id)
        for i, block_id in enumerate(table[:r.num_computed_tokens // bs]):
            block = sched.kv.pool.blocks[block_id]
            if block.block_hash is not None:
                stored = engine.slots[block_id * bs:(block_id + 1) * bs].tolist()
                assert stored == r.all_token_ids[i * bs:(i + 1) * bs]


def _reference(prompt, max_tokens):
    # exact: the fake engine's next token is integer arithmetic on the context (no near-ties)
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]
