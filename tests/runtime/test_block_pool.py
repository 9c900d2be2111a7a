import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kiln.runtime.block_pool import BlockPool, FreeBlockQueue, Block


def ids(blocks):
    return [b.block_id for b in blocks]


def test_new_blocks_come_from_the_front_in_id_order():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    assert ids(blocks) == [0, 1]
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert pool.num_free_blocks == 2
    assert ids(pool.free_queue) == [2, 3]


def test_freed_blocks_join_the_tail_in_the_order_given():
    pool = BlockPool(4)
    b0, b1, b2, _ = pool.get_new_blocks(4)
    pool.free_blocks([b2, b0])
    assert ids(pool.free_queue) == [2, 0]
    assert ids(pool.get_new_blocks(1)) == [2]


def test_shared_block_stays_used_until_the_last_reference_goes():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 2


def test_double_free_is_refused():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError):
        pool.free_blocks([block])


def test_asking_for_too_many_blocks_changes_nothing():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2 and ids(pool.free_queue) == [0, 1]


def test_least_recently_freed_cached_block_is_evicted_first():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    for block, h in zip(blocks, (100, 101, 102)):
        pool.cache_full_block(block, h)
    pool.free_blocks([blocks[1]])
    pool.free_blocks([blocks[0], blocks[2]])
    assert pool.num_cached_free_blocks == 3
    assert ids(pool.get_new_blocks(2)) == [1, 0]
    assert pool.evictions == 2
    assert pool.get_cached_block(101) is None and pool.get_cached_block(100) is None
    assert pool.get_cached_block(102) is blocks[2]
    assert blocks[1].block_hash is None


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(2)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_full_block(b0, 7)
    pool.free_blocks([b1, b0])
    hit = pool.get_cached_block(7)
    pool.touch([hit])
    assert hit.ref_cnt == 1 and hit not in pool.free_queue
    assert ids(pool.get_new_blocks(1)) == [1]
    assert pool.evictions == 0


def test_one_hash_maps_to_one_block():
    pool = BlockPool(2)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_full_block(b0, 7)
    pool.cache_full_block(b1, 7)
    assert pool.get_cached_block(7) is b0 and b1.block_hash is None


def test_caching_disabled_never_hashes():
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, 7)
    assert block.block_hash is None and pool.get_cached_block(7) is None


def test_free_queue_removes_from_the_middle():
    blocks = [Block(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.append(blocks[2])
    assert len(queue) == 4
    assert [queue.popleft().block_id for _ in range(4)] == [0, 1, 3, 2]


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / free / touch / cache sequences against a model of who holds what."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(6)
        self.held: list = []        # one entry per reference taken

    @rule(n=st.integers(0, 4))
    def allocate(self, n):
        if n > self.pool.num_free_blocks:
            with pytest.raises(ValueError):
                self.pool.get_new_blocks(n)
            return
        self.held += self.pool.get_new_blocks(n)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data):
        block = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.pool.free_blocks([block])

    @precondition(lambda self: self.pool.cached)
    @rule(data=st.data())
    def touch_cached(self, data):
        block_hash = data.draw(st.sampled_from(sorted(self.pool.cached)))
        block = self.pool.get_cached_block(block_hash)
        self.pool.touch([block])
        self.held.append(block)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), block_hash=st.integers(0, 5))
    def cache(self, data, block_hash):
        self.pool.cache_full_block(data.draw(st.sampled_from(self.held)), block_hash)

    @invariant()
    def bookkeeping_is_consistent(self):
        self.pool.check_invariants()
        used = sum(1 for b in self.pool.blocks if b.ref_cnt > 0)
        assert used + self.pool.num_free_blocks == self.pool.num_blocks
        for block in self.pool.blocks:
            assert block.ref_cnt == sum(1 for h in self.held if h is block)


TestBlockPoolMachine = BlockPoolMachine.TestCase
