"""The autoscaling policy as a pure function of the replicas' admission signals."""

from __future__ import annotations

from types import SimpleNamespace

from kiln.scale.autoscale import ReplicaSignals, desired_replicas, kiln_autoscaling_policy, signals_by_replica

SLO = 2.0       # seconds; a replica's budget is TARGET (half) of it


def test_idle_replicas_scale_down_to_the_minimum():
    idle = [ReplicaSignals(0.05, SLO), ReplicaSignals(0.0, SLO), ReplicaSignals(0.1, SLO)]
    assert desired_replicas(idle, current=3, min_replicas=1, max_replicas=4) == 1


def test_queues_past_the_budget_ask_for_more():
    # each replica's queue predicts 2 s against a 1 s budget: twice the replicas
    busy = [ReplicaSignals(2.0, SLO), ReplicaSignals(2.0, SLO)]
    assert desired_replicas(busy, current=2, min_replicas=1, max_replicas=8) == 4
    assert desired_replicas(busy, current=2, min_replicas=1, max_replicas=3) == 3     # capped


def test_waiting_prefill_counts_even_when_the_ttft_model_lags():
    # 3000 waiting tokens at 1000 tokens/s = 3 s of prefill against a 1 s budget
    s = ReplicaSignals(predicted_ttft=0.1, ttft_slo=SLO, waiting_tokens=3000, prefill_tps=1000)
    assert s.pressure == 3.0
    assert desired_replicas([s], current=1, max_replicas=5) == 3


def test_refusals_add_a_replica_whatever_the_prediction():
    refusing = [ReplicaSignals(0.2, SLO, refused_per_s=0.5), ReplicaSignals(0.2, SLO)]
    assert desired_replicas(refusing, current=2, max_replicas=4) == 3
    assert desired_replicas(refusing, current=4, max_replicas=4) == 4


def test_no_objective_uses_a_one_second_budget_and_no_reports_keep_the_count():
    assert ReplicaSignals(predicted_ttft=1.5).pressure == 3.0
    assert desired_replicas([], current=3, min_replicas=1, max_replicas=5) == 3


def test_the_serve_policy_reads_aggregated_metrics_per_replica():
    metrics = {"predicted_ttft": {"r1": 3.0, "r2": 1.0}, "ttft_slo": {"r1": SLO, "r2": SLO},
               "refused_per_s": {"r1": 0.0, "r2": 0.0}}
    assert [s.predicted_ttft for s in signals_by_replica(metrics)] == [3.0, 1.0]
    ctx = SimpleNamespace(aggregated_metrics=metrics, current_num_replicas=2,
                          capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=10)
    assert kiln_autoscaling_policy(ctx) == (4, {})
    assert signals_by_replica(None) == []
