"""The serving pieces that need no server: response cache bounds, admission arithmetic."""

from __future__ import annotations

import pytest

from kiln.config import ServeConfig
from kiln.runtime.engine_stats import StepReport
from kiln.runtime.outputs import StreamDelta
from kiln.serving.admission import Admission, PrefillRate
from kiln.serving.errors import ApiError
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


def test_prefill_rate_starts_at_the_prior_and_learns():
    rate = PrefillRate()
    assert rate.tokens_per_second == pytest.approx(1024)
    for _ in range(200):
        rate.observe(StepReport(batch_size=4, num_scheduled_tokens=100, num_prefill_chunks=2, seconds=1.0))
    assert rate.tokens_per_second == pytest.approx(100, rel=0.01)
    rate.observe(StepReport(batch_size=4, num_scheduled_tokens=4, num_prefill_chunks=0, seconds=9.0))
    assert rate.tokens_per_second == pytest.approx(100, rel=0.01)      # decode-only steps do not count


def test_admission_bounds_and_release():
    adm = Admission(ServeConfig(max_waiting=2, max_waiting_tokens=1000), PrefillRate())
    a = adm.admit(400)
    adm.admit(500)
    with pytest.raises(ApiError) as e:
        adm.admit(1)
    assert e.value.status == 429 and e.value.code == "max_waiting" and int(e.value.headers["Retry-After"]) >= 1
    a.release()
    a.release()                                      # idempotent
    assert (adm.pending, adm.pending_tokens) == (1, 500)
    with pytest.raises(ApiError) as e:
        adm.admit(501)
    assert e.value.code == "max_waiting_tokens"
    adm.admit(500)


def test_admission_predicts_ttft_from_the_queue():
    rate = PrefillRate()
    for _ in range(300):
        rate.observe(StepReport(8, 100, 1, 1.0))     # 100 tokens/s
    adm = Admission(ServeConfig(ttft_slo=2.0), rate)
    adm.admit(150)
    assert adm.predicted_ttft(40) == pytest.approx(1.9, rel=0.02)
    with pytest.raises(ApiError) as e:
        adm.admit(60)                                # 2.1 s > 2 s
    assert e.value.code == "ttft_slo"
    adm.admit(40)
