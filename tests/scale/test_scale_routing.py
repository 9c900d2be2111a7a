"""The prefix-aware choice, without Ray: block hashes as the KV manager makes them, the bounded
summary a replica reports, and which replica a request goes to."""

from __future__ import annotations

import pytest

from kiln.runtime.kv_manager import KVCacheManager
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams
from kiln.scale.prefix import RecentPrefixes, matched_blocks, prompt_block_hashes
from kiln.scale.routing import Candidate, Imbalance, choose

BLOCK = 4


def _cached_in_manager(prompt: list[int], salt: str | None) -> frozenset[int]:
    """The hashes a real KV manager caches after computing `prompt` (with that salt)."""
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    request = Request("r", prompt, SamplingParams(max_tokens=1, cache_salt=salt))
    assert kv.allocate_slots(request, len(prompt))
    request.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(request)
    kv.free(request)
    return kv.prefix_view().hashes


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_block_hashes_are_the_kv_managers(salt):
    prompt = list(range(100, 114))                         # 3 full blocks and 2 tokens
    cached = _cached_in_manager(prompt, salt)
    hashes = prompt_block_hashes(prompt, BLOCK, salt)
    assert len(hashes) == 3 and set(hashes) == cached
    # a prompt sharing two blocks matches two; another salt matches none
    other = prompt[:8] + [1, 2, 3, 4, 5]
    assert matched_blocks(prompt_block_hashes(other, BLOCK, salt), cached) == 2
    assert matched_blocks(prompt_block_hashes(prompt, BLOCK, "someone-else"), cached) == 0


def test_the_last_token_block_is_never_routed_on():
    # 8 tokens = 2 full blocks, but the block holding the last token is never a cache hit
    assert len(prompt_block_hashes(list(range(8)), BLOCK)) == 1
    assert prompt_block_hashes([], BLOCK) == () and prompt_block_hashes([7], BLOCK) == ()
    assert len(prompt_block_hashes(list(range(1000)), BLOCK, max_blocks=5)) == 5


def test_the_summary_is_bounded_recent_and_drops_evicted_blocks():
    recent = RecentPrefixes(capacity=3)
    recent.add([1, 2])
    recent.add([3, 4])                                     # 1 falls out: oldest first
    assert recent.summary({1, 2, 3, 4}) == [2, 3, 4]
    assert recent.summary({3, 4}) == [3, 4] and len(recent) == 2      # 2 was evicted from the cache
    recent.add([3])                                        # seen again: most recent
    assert recent.summary({3, 4}) == [4, 3]


def test_longest_cached_prefix_wins():
    hashes = (11, 12, 13)
    a = Candidate("a", load=1, held={11})
    b = Candidate("b", load=2, held={11, 12})
    c = Candidate("c", load=0)
    d = choose([a, b, c], hashes)
    assert d.ranks[0] == ["b"] and d.matched == 2 and d.reason == "prefix"
    assert d.ranks[1] == ["c", "a"]                        # the rest by load


def test_an_overloaded_prefix_holder_is_passed_over():
    hashes = (11, 12)
    holder = Candidate("holder", load=10, held={11, 12})
    idle = Candidate("idle", load=2)
    d = choose([holder, idle], hashes, Imbalance(abs_threshold=4, rel_threshold=1.5))
    assert d.ranks[0] == ["idle"] and d.reason == "overloaded"
    # within the imbalance (10 - 7 <= 4) the cache hit is worth the wait
    assert choose([holder, Candidate("idle", load=7)], hashes).ranks[0] == ["holder"]
    # both thresholds must be passed: 100 vs 90 is more than 4 requests but not 1.5 times
    assert choose([Candidate("h", 100, {11}), Candidate("i", 90)], hashes).ranks[0] == ["h"]


def test_without_a_match_the_least_loaded_then_the_emptiest_replica():
    d = choose([Candidate("a", 3), Candidate("b", 1), Candidate("c", 1, num_prefixes=5)], (42,))
    assert d.ranks == [["b"], ["c", "a"]] and d.reason == "least_loaded"
    # equal loads: a new prefix goes to the replica holding fewer, so distinct prefixes spread
    assert choose([Candidate("a", 0, num_prefixes=2), Candidate("b", 0, num_prefixes=1)], (1,)).ranks[0] == ["b"]


def test_avoid_passes_over_a_replica_unless_it_is_the_only_one():
    a, b = Candidate("a", 0, {1}), Candidate("b", 5)
    assert choose([a, b], (1,), avoid="a").ranks == [["b"]]
    assert choose([a], (1,), avoid="a").ranks == [["a"]]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="no replica"):
        choose([], (1,))
    with pytest.raises(ValueError, match="rel_threshold"):
        Imbalance(4, 0.5)


class Replicas:
    """What the Serve router keeps per replica, without Ray: the hashes it routed there (its cached
    work) and nothing in flight (requests sent one at a time)."""

    def __init__(self, *ids: str):
        self.routed = {i: RecentPrefixes() for i in ids}

    def send(self, prompt: list[int]) -> str:
        hashes = prompt_block_hashes(prompt, BLOCK)
        candidates = [Candidate(i, 0, _HeldBy(r), r.count_with(frozenset())) for i, r in self.routed.items()]
        chosen = choose(candidates, hashes).ranks[0][0]
        self.routed[chosen].add(hashes)
        return chosen


class _HeldBy:
    def __init__(self, recent: RecentPrefixes):
        self.recent = recent

    def __contains__(self, h) -> bool:
        return self.recent.has(h)


TEMPLATE = [1, 2, 3, 4]                                   # one block every prompt starts with (a chat header)


def system_prompt(i: int) -> list[int]:
    return TEMPLATE + [1000 * (i + 1) + t for t in range(40)]       # ten blocks of its own


def test_distinct_prefixes_sent_one_at_a_time_use_both_replicas_and_shared_ones_stick():
    replicas = Replicas("a", "b")
    landed: dict[int, list[str]] = {}
    for i in range(3):                                    # three system prompts, four questions each
        for q in range(4):
            question = [50_000 + 100 * i + 10 * q + t for t in range(6)]
            landed.setdefault(i, []).append(replicas.send(system_prompt(i) + question))
    assert {r for rs in landed.values() for r in rs} == {"a", "b"}, landed
    for i, rs in landed.items():                          # each system prompt stays where it first went
        assert len(set(rs)) == 1, (i, rs)


def test_a_shared_template_block_alone_is_no_home():
    hashes = prompt_block_hashes(system_prompt(0) + [9, 9], BLOCK)
    holder = Candidate("a", 0, set(hashes[:1]), num_prefixes=30)     # holds only the template's block
    idle = Candidate("b", 0)
    d = choose([holder, idle], hashes)
    assert d.ranks[0] == ["b"] and d.reason == "least_loaded" and d.matched == 0
    # a prefix that is a real part of the prompt is a home, however much the holder caches
    holder = Candidate("a", 0, set(hashes[:5]), num_prefixes=30)
    assert choose([holder, idle], hashes).ranks[0] == ["a"]


def test_equal_replicas_are_ranked_per_prefix_not_by_id():
    fresh = [Candidate("a", 0), Candidate("b", 0)]
    firsts = {p: choose(fresh, prompt_block_hashes(system_prompt(p), BLOCK)).ranks[0][0] for p in range(16)}
    assert set(firsts.values()) == {"a", "b"}, firsts          # distinct prefixes: both replicas
    again = {p: choose(fresh[::-1], prompt_block_hashes(system_prompt(p), BLOCK)).ranks[0][0] for p in range(16)}
    assert again == firsts                                   # and each prefix always the same one


def test_cached_work_counts_reported_and_routed_hashes_once():
    recent = RecentPrefixes()
    recent.add([1, 2, 3])
    assert recent.count_with(frozenset({2, 3, 4, 5})) == 5 and recent.count_with(frozenset()) == 3
