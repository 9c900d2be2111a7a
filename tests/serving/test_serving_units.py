"""The serving pieces that need no server: response cache bounds, the engine limits the server checks
requests against (admission: test_admission.py)."""

from __future__ import annotations

import pytest

from kiln.config import SchedulerConfig
from kiln.runtime.engine_stats import EngineSnapshot
from kiln.runtime.kv_manager import KVCacheManager
from kiln.runtime.outputs import StreamDelta
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler
from kiln.serving.traffic.flights import Recording, Usage
from kiln.serving.openai.requests import EngineLimits
from kiln.serving.cache.response_cache import ResponseCache


def _recording(text: str) -> Recording:
    return Recording([StreamDelta("r", text, [1] * len(text), True, "length")], Usage(3, len(text), 0))


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_cache_is_lru_bounded_in_entries():
    cache = ResponseCache(max_entries=2, max_bytes=1 << 20, ttl=60)
    for key in "abc":
        cache.put(key, _recording(key))
    assert cache.get("a") is None and cache.get("b") is not None
    cache.put("d", _recording("d"))                 # "b" was used last: "c" goes
    assert cache.get("c") is None and cache.get("b") is not None and len(cache) == 2


def test_cache_is_bounded_in_bytes_and_skips_giants():
    one = _recording("x" * 100).nbytes
    cache = ResponseCache(max_entries=100, max_bytes=int(2.5 * one), ttl=60)
    for key in "abc":
        cache.put(key, _recording("x" * 100))
    assert len(cache) == 2 and cache.nbytes <= 2.5 * one
    cache.put("giant", _recording("y" * 10_000))
    assert cache.get("giant") is None and len(cache) == 2


def test_cache_entries_expire():
    clock = Clock()
    cache = ResponseCache(max_entries=10, max_bytes=1 << 20, ttl=5, clock=clock)
    cache.put("k", _recording("v"))
    clock.now = 4.9
    assert cache.get("k") is not None
    clock.now = 5.1
    assert cache.get("k") is None and cache.nbytes == 0


def test_log_level_sets_kilns_loggers_and_refuses_unknown_levels():
    import logging

    import pytest

    from kiln.config import ServeConfig
    from kiln.logs import configure_logging

    kiln_log = logging.getLogger("kiln")
    before = kiln_log.level
    try:
        configure_logging(ServeConfig(log_level="debug").log_level)
        assert logging.getLogger("kiln.runtime").isEnabledFor(logging.DEBUG)
        assert not logging.getLogger("httpx").isEnabledFor(logging.DEBUG)      # libraries stay at info
        configure_logging(ServeConfig().log_level)
        assert not logging.getLogger("kiln.serving.traffic.admission").isEnabledFor(logging.DEBUG)
    finally:
        kiln_log.setLevel(before)
    with pytest.raises(ValueError, match="log_level"):
        ServeConfig(log_level="loud")


def test_the_server_and_the_scheduler_share_one_fit_rule():
    """The longest request the server lets through is the longest the scheduler can ever run."""
    manifest = type("Manifest", (), {"generation": {"eos_token_ids": [2]},
                                     "spec": type("Spec", (), {"vocab_size": 256})})
    limits = EngineLimits.of(EngineSnapshot(max_model_len=100, kv_blocks_total=4, kv_block_size=4), manifest)
    assert (limits.max_model_len, limits.num_kv_blocks, limits.block_size, limits.eos_token_ids) == (100, 4, 4, (2,))
    assert limits.kv_tokens == 17                   # 16 slots: the last sampled token is never computed
    sched = Scheduler(SchedulerConfig(max_model_len=100), KVCacheManager(4, 4))

    def request(rid, num_tokens):
        return Request(rid, list(range(10)), SamplingParams(max_tokens=num_tokens - 10))
    sched.add_request(request("fits", limits.kv_tokens))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(request("too-long", limits.kv_tokens + 1))


def test_the_server_gives_the_scheduler_its_ttft_objective_unless_the_runtime_names_one():
    from kiln.config import RuntimeConfig, SchedulerConfig

    assert RuntimeConfig().with_ttft_target(3.0).scheduler.target_ttft == 3.0
    own = RuntimeConfig(scheduler=SchedulerConfig(target_ttft=1.0))
    assert own.with_ttft_target(3.0).scheduler.target_ttft == 1.0
    assert RuntimeConfig().with_ttft_target(0).scheduler.target_ttft == 0
