"""KVCacheManager.cached_prefix_tokens and the PrefixCacheView the engine client publishes for
admission control: what get_computed_blocks would hit, no state change."""

from kiln.runtime.kv_manager import KVCacheManager, PrefixCacheView
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams


def computed(kv, prompt, rid="a"):
    request = Request(rid, list(prompt), SamplingParams(max_tokens=8))
    assert kv.allocate_slots(request, len(prompt))
    request.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(request)
    return request


def test_the_probe_counts_the_cached_full_blocks_of_a_prefix():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(10))                         # blocks [0-3] [4-7] full, [8, 9] partial
    assert kv.cached_prefix_tokens(prompt) == 0
    computed(kv, prompt)
    stats = (kv.prefix_queries, kv.prefix_hits, kv.num_free_blocks)
    assert kv.cached_prefix_tokens(prompt + [50, 51]) == 8
    assert kv.cached_prefix_tokens(prompt[:4] + [99] * 8) == 4      # diverges in the second block
    assert kv.cached_prefix_tokens([99] + prompt) == 0              # chain hashes: a prefix, not a substring
    assert kv.cached_prefix_tokens(prompt[:8]) == 4                 # one token short: 7 // 4 blocks
    assert (kv.prefix_queries, kv.prefix_hits, kv.num_free_blocks) == stats   # nothing changed
    # It agrees with what the scheduler's lookup would hit.
    other = Request("b", prompt + [50, 51], SamplingParams(max_tokens=8))
    assert kv.get_computed_blocks(other)[1] == kv.cached_prefix_tokens(prompt + [50, 51])


def test_no_caching_no_hits():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False)
    computed(kv, list(range(10)))
    assert kv.cached_prefix_tokens(list(range(12))) == 0


def test_the_view_answers_as_the_probe_did_when_it_was_taken():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prompt = list(range(10))
    empty = kv.prefix_view()
    a = computed(kv, prompt)
    view = kv.prefix_view()
    assert view is not empty and empty.cached_prefix_tokens(prompt + [50]) == 0
    for probe in (prompt + [50, 51], prompt[:4] + [99] * 8, [99] + prompt, prompt[:8], [1]):
        assert view.cached_prefix_tokens(probe) == kv.cached_prefix_tokens(probe)
    assert kv.prefix_view() is view                  # unchanged cache: the same view
    kv.free(a)
    assert kv.prefix_view() is view                  # freed blocks keep their hashes
    computed(kv, [90 + i for i in range(16)], "b")   # reuses every block: the old hashes are evicted
    assert kv.prefix_view() is not view and kv.prefix_view().cached_prefix_tokens(prompt + [50]) == 0
    assert view.cached_prefix_tokens(prompt + [50]) == 8          # a view never changes


def test_an_empty_view_hits_nothing():
    assert PrefixCacheView().cached_prefix_tokens(list(range(40))) == 0
