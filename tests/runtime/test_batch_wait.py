"""The batch wait window on the scheduler, with a made-up clock: prompts that arrive within the
window share one prefill step; a running decode is never held; the hold ends at the window, at
the preferred batch, or when the waiting prompts fill the step's prefill budget."""

import pytest

from kiln.config import SCHEDULER_PRESETS, SchedulerConfig
from kiln.runtime.kv_manager import KVCacheManager
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import RunnerOutput, Scheduler


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def make(window=0.010, preferred=0, **config):
    cfg = SchedulerConfig(batch_wait=window, batch_wait_batch=preferred, **config)
    sched = Scheduler(cfg, KVCacheManager(64, 4, True))
    clock = Clock()
    sched.batch_wait.clock = clock
    return sched, clock


def request(rid, clock, n_prompt=4, max_tokens=4, start=10):
    return Request(rid, list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens),
                   eos_token_id=2, arrival_time=clock.now)


def step(sched):
    out = sched.schedule()
    sched.update(out, RunnerOutput({s.request.request_id: 7 for s in out.scheduled if s.samples_token}))
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def test_prompts_arriving_within_the_window_share_one_prefill_step():
    sched, clock = make(window=0.010)
    sched.add_request(request("a", clock))
    assert step(sched) == {}
    assert sched.batch_wait.remaining == pytest.approx(0.010)
    clock.now += 0.004
    sched.add_request(request("b", clock, start=40))
    assert step(sched) == {}
    assert sched.batch_wait.remaining == pytest.approx(0.006)     # counted from a's arrival
    clock.now += 0.007
    assert step(sched) == {"a": 4, "b": 4}
    assert sched.last_step_stats.num_prefill_chunks == 2
    assert sched.last_step_stats.batch_wait_seconds == pytest.approx(0.011)


def test_without_a_window_the_first_prompt_runs_alone():
    sched, clock = make(window=0.0)
    sched.add_request(request("a", clock))
    assert step(sched) == {"a": 4}
    sched.add_request(request("b", clock, start=40))
    assert step(sched) == {"a": 1, "b": 4}
    assert sched.last_step_stats.batch_wait_seconds is None


def test_a_running_decode_is_never_held_and_newcomers_join_it():
    sched, clock = make(window=0.5, preferred=8)
    sched.add_request(request("a", clock, max_tokens=10))
    clock.now += 0.5
    assert step(sched) == {"a": 4}              # the window passed: a prefills alone
    sched.add_request(request("b", clock, start=40))
    assert step(sched) == {"a": 1, "b": 4}      # a decodes: b joins at once, no hold
    for _ in range(3):
        assert step(sched) == {"a": 1, "b": 1}
    assert sched.batch_wait.remaining == 0


def test_a_running_chunked_prefill_goes_on_while_newcomers_are_held():
    sched, clock = make(window=0.010, preferred=8, max_num_batched_tokens=8)
    sched.add_request(request("a", clock, n_prompt=20))
    clock.now += 0.010
    assert step(sched) == {"a": 8}
    sched.add_request(request("b", clock, start=40))
    assert step(sched) == {"a": 8}              # a's prefill is not held; b waits for company
    clock.now += 0.010
    assert step(sched) == {"a": 4, "b": 4}


def test_the_preferred_batch_releases_the_hold_at_once():
    sched, clock = make(window=0.5, preferred=2)
    sched.add_request(request("a", clock))
    assert step(sched) == {}
    sched.add_request(request("b", clock, start=40))
    assert step(sched) == {"a": 4, "b": 4}
    assert sched.last_step_stats.batch_wait_seconds == 0


def test_prompts_that_fill_the_prefill_budget_are_not_held():
    sched, clock = make(window=0.5, preferred=8, max_num_batched_tokens=16, target_itl=0)
    sched.add_request(request("a", clock, n_prompt=16))
    assert step(sched) == {"a": 16}


def test_an_aborted_held_prompt_ends_the_hold():
    sched, clock = make(window=0.5)
    sched.add_request(request("a", clock))
    assert step(sched) == {}
    sched.abort("a")
    assert step(sched) == {} and sched.batch_wait.remaining == 0
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_window_bounds_and_presets():
    with pytest.raises(ValueError, match="batch_wait"):
        SchedulerConfig(batch_wait=-0.001)
    with pytest.raises(ValueError, match="batch_wait"):
        SchedulerConfig(batch_wait=2.0)
    with pytest.raises(ValueError, match="batch_wait_batch"):
        SchedulerConfig(batch_wait_batch=-1)
    assert SchedulerConfig().batch_wait == 0                 # off by default: it costs TTFT
    assert SCHEDULER_PRESETS["latency"]["batch_wait"] == 0
    assert SchedulerConfig.preset("throughput").batch_wait > 0


def test_the_wait_histogram_counts_released_holds_only():
    from kiln.runtime.engine_stats import StepReport
    from kiln.serving.http.metrics import ServerMetrics

    metrics = ServerMetrics()
    metrics.observe_step(StepReport(2, 8, 2, 0.01, batch_wait_seconds=0.004))
    metrics.observe_step(StepReport(1, 1, 0, 0.01))              # a step the window had no part in
    count = metrics.registry.get_sample_value("kiln_batch_wait_seconds_count")
    total = metrics.registry.get_sample_value("kiln_batch_wait_seconds_sum")
    assert (count, total) == (1, pytest.approx(0.004))
