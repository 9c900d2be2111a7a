"""The serving pieces that need no server: response cache bounds (admission: test_admission.py)."""

from __future__ import annotations

from kiln.runtime.outputs import StreamDelta
from kiln.serving.flights import Recording, Usage
from kiln.serving.response_cache import ResponseCache


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
    from kiln.serving.server import configure_logging

    kiln_log = logging.getLogger("kiln")
    before = kiln_log.level
    try:
        configure_logging(ServeConfig(log_level="debug"))
        assert logging.getLogger("kiln.runtime").isEnabledFor(logging.DEBUG)
        assert not logging.getLogger("httpx").isEnabledFor(logging.DEBUG)      # libraries stay at info
        configure_logging(ServeConfig())
        assert not logging.getLogger("kiln.serving.admission").isEnabledFor(logging.DEBUG)
    finally:
        kiln_log.setLevel(before)
    with pytest.raises(ValueError, match="log_level"):
        ServeConfig(log_level="loud")
