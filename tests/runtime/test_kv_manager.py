from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kiln.runtime.kv_manager import KVCacheManager, hash_block_tokens
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams

BS = 4


def make_request(rid, prompt):
    return Request(rid, list(prompt), SamplingParams(max_tokens=64))


def compute(kv, request, n, hits=()):
    """What the scheduler and one step do: allocate, run the chunk, then offer full blocks."""
    hit_tokens = len(hits) * kv.block_size
    assert kv.allocate_slots(request, n, hits)
    request.num_computed_tokens += hit_tokens + n
    kv.cache_computed_blocks(request)


def test_hash_chains_parent_and_tokens():
    h = hash_block_tokens(None, (1, 2, 3, 4))
    assert h == hash_block_tokens(None, [1, 2, 3, 4])
    assert h != hash_block_tokens(None, (1, 2, 3, 5))
    assert hash_block_tokens(h, (5, 6, 7, 8)) != hash_block_tokens(None, (5, 6, 7, 8))
    assert hash_block_tokens(None, (1, 2, 3, 4), extra_keys=("lora", 1)) != h


def test_prompt_gets_blocks_in_id_order_and_grows_by_block():
    kv = KVCacheManager(8, BS)
    a = make_request("a", range(10))
    compute(kv, a, 10)
    assert kv.block_table("a") == [0, 1, 2]
    a.append_output_token(99)
    compute(kv, a, 1)                       # 11 tokens still fit in 3 blocks
    assert kv.block_table("a") == [0, 1, 2]
    for t in (98, 97):
        a.append_output_token(t)
        compute(kv, a, 1)
    assert kv.block_table("a") == [0, 1, 2, 3]
    assert kv.num_free_blocks == 4 and kv.usage == 0.5


def test_only_full_computed_blocks_are_hashed():
    kv = KVCacheManager(8, BS)
    a = make_request("a", range(10))
    assert kv.allocate_slots(a, 10)
    assert not kv.pool.cached              # nothing computed yet
    a.num_computed_tokens = 10
    kv.cache_computed_blocks(a)
    assert sorted(b.block_id for b in kv.pool.cached.values()) == [0, 1]


def test_blocks_that_decodes_fill_are_cached_too():
    """A block a request fills while decoding (here the prompt's tail block) is cached once full,
    so a follow-up turn (prompt + answer) hits it."""
    kv = KVCacheManager(8, BS)
    a = make_request("a", range(6))
    compute(kv, a, 6)                       # block 0 full, block 1 half
    for t in (90, 91, 92):
        a.append_output_token(t)
        compute(kv, a, 1)
    assert kv.num_free_blocks == 5
    assert sorted(b.block_id for b in kv.pool.cached.values()) == [0, 1]
    assert len(kv.pool.cached) == 2


def test_prefix_hit_across_two_requests_shares_blocks():
    kv = KVCacheManager(8, BS)
    a = make_request("a", range(12))
    compute(kv, a, 12)
    b = make_request("b", list(range(8)) + [50, 51, 52, 53, 54])
    hits, num_hit = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and num_hit == 8
    compute(kv, b, 5, hits)
    assert kv.block_table("b") == [0, 1, 3, 4]
    assert [kv.pool.blocks[i].ref_cnt for i in range(5)] == [2, 2, 1, 1, 1]
    stats = kv.stats()
    assert (stats.prefix_queries, stats.prefix_hits) == (13, 8)


def test_whole_prompt_cached_is_capped_one_token_short():
    kv = KVCacheManager(8, BS)
    compute(kv, make_request("a", range(12)), 12)
    _, num_hit = kv.get_computed_blocks(make_request("b", range(12)))
    assert num_hit == 8                     # the last block is dropped
    _, num_hit = kv.get_computed_blocks(make_request("c", range(13)))
    assert num_hit == 12


def test_freed_cached_blocks_are_revived_by_a_hit():
    kv = KVCacheManager(4, BS)
    a = make_request("a", range(9))
    compute(kv, a, 9)
    kv.free(a)
    assert kv.block_table("a") == [] and kv.num_free_blocks == 4
    assert kv.stats().cached == 2
    b = make_request("b", range(9))
    hits, num_hit = kv.get_computed_blocks(b)
    compute(kv, b, 1, hits)
    assert kv.block_table("b") == [0, 1, 3] and kv.stats().evictions == 0  # 3 was free longest


def test_eviction_takes_a_requests_tail_before_its_head_and_older_frees_first():
    kv = KVCacheManager(6, BS)
    a, b = make_request("a", range(12)), make_request("b", range(100, 108))
    compute(kv, a, 12)                       # blocks 0 1 2
    compute(kv, b, 8)                        # blocks 3 4
    kv.free(a)
    kv.free(b)
    assert [blk.block_id for blk in kv.pool.free_queue] == [5, 2, 1, 0, 4, 3]
    compute(kv, make_request("c", range(200, 212)), 12)
    assert kv.block_table("c") == [5, 2, 1]
    assert kv.stats().evictions == 2
    _, num_hit = kv.get_computed_blocks(make_request("a2", range(12)))
    assert num_hit == 4                      # a's head block survived
    _, num_hit = kv.get_computed_blocks(make_request("b2", range(100, 109)))
    assert num_hit == 8


def test_failed_allocation_leaves_state_unchanged():
    kv = KVCacheManager(3, BS)
    a = make_request("a", range(8))
    compute(kv, a, 8)
    kv.free(a)                               # blocks 0 1 free but cached
    b = make_request("b", range(16))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    # 2 hits + 2 new blocks > 3, although 3 blocks are free: reviving hits uses them up.
    before = [(blk.block_id, blk.ref_cnt, blk.block_hash) for blk in kv.pool.blocks]
    assert not kv.allocate_slots(b, 8, hits)
    assert [(blk.block_id, blk.ref_cnt, blk.block_hash) for blk in kv.pool.blocks] == before
    assert kv.block_table("b") == [] and kv.num_free_blocks == 3
    assert kv.stats().allocation_failures == 1
    kv.pool.check_invariants()


def test_caching_disabled_never_hits():
    kv = KVCacheManager(8, BS, enable_caching=False)
    compute(kv, make_request("a", range(12)), 12)
    assert kv.get_computed_blocks(make_request("b", range(12))) == ([], 0)
    assert not kv.pool.cached


def test_stats_add_up():
    kv = KVCacheManager(8, BS)
    a = make_request("a", range(9))
    compute(kv, a, 9)
    s = kv.stats()
    assert (s.num_blocks, s.used, s.free, s.cached) == (8, 3, 5, 0)
    kv.free(a)
    s = kv.stats()
    assert (s.used, s.free, s.cached) == (0, 8, 2)


class KVManagerMachine(RuleBasedStateMachine):
    """Requests over a two-token vocabulary (prefixes collide often) on a tiny pool. A model of
    what each block holds checks that a prefix hit never serves another prefix's KV."""

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(8, 2)
        self.live: dict[str, Request] = {}
        self.content: dict[tuple[int, int], int] = {}   # (block id, offset) -> token written
        self.full_hashes: set[int] = set()              # chain hashes of computed full blocks
        self.next_id = 0

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=9), data=st.data())
    def admit(self, prompt, data):
        request = make_request(f"r{self.next_id}", prompt)
        self.next_id += 1
        hits, num_hit = self.kv.get_computed_blocks(request)
        assert num_hit < len(prompt)
        n = data.draw(st.integers(1, len(prompt) - num_hit))
        if self.kv.allocate_slots(request, n, hits):
            self.live[request.request_id] = request
            self._check_hit(request, num_hit)
            event(f"prefix hit: {num_hit > 0}")
            request.num_computed_tokens = num_hit
            self._run(request, n)
        else:
            self.kv.free(request)           # drops the hash chain it built

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 1))
    def step(self, data, token):
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(token)
        n = data.draw(st.integers(1, request.num_tokens - request.num_computed_tokens))
        if self.kv.allocate_slots(request, n):
            self._run(request, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        self.kv.free(self.live.pop(data.draw(st.sampled_from(sorted(self.live)))))

    def _check_hit(self, request, num_hit):
        table = self.kv.block_table(request.request_id)
        for pos in range(num_hit):
            assert self.content[table[pos // 2], pos % 2] == request.all_token_ids[pos]

    def _run(self, request, n):
        table = self.kv._requests[request.request_id].blocks
        start = request.num_computed_tokens
        for pos in range(start, start + n):
            block = table[pos // 2]
            assert block.ref_cnt == 1 and block.block_hash is None   # never write a shared block
            self.content[block.block_id, pos % 2] = request.all_token_ids[pos]
        request.num_computed_tokens += n
        self.kv.cache_computed_blocks(request)
        self._record_full_hashes(request)

    def _record_full_hashes(self, request):
        tokens, parent = request.all_token_ids, None
        for i in range(request.num_computed_tokens // 2):
            parent = hash_block_tokens(parent, tokens[2 * i:2 * i + 2])
            self.full_hashes.add(parent)

    @invariant()
    def pool_is_consistent(self):
        pool = self.kv.pool
        pool.check_invariants()
        used = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert used + pool.num_free_blocks == pool.num_blocks
        assert set(pool.cached) <= self.full_hashes
        in_tables = sum(len(self.kv.block_table(rid)) for rid in self.live)
        assert sum(b.ref_cnt for b in pool.blocks) == in_tables

    def teardown(self):
        for request in self.live.values():
            self.kv.free(request)
        assert self.kv.num_free_blocks == self.kv.num_blocks


TestKVManagerMachine = KVManagerMachine.TestCase
