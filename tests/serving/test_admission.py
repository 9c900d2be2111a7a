"""Admission arithmetic on made-up engine snapshots: the bounds, and a TTFT prediction that counts
the waiting prompts, the decode load and the seats."""

from __future__ import annotations

import random

from dataclasses import replace
from types import SimpleNamespace

import pytest

from kiln.config import AdmissionConfig
from kiln.runtime.engine_stats import EngineSnapshot
from kiln.runtime.step_costs import StepCosts
from kiln.serving.traffic.admission import Admission
from kiln.serving.http.errors import ApiError

# 1 ms per prefill token; a decode step of 16 takes 40 ms; steps aim at 100 ms while streams decode.
COSTS = StepCosts(target_itl=0.1, min_prefill_chunk=8, max_tokens=512,
                  decode_seconds_by_bucket=((4, 0.02), (16, 0.04)), prefill_seconds_per_token=0.001)


def engine(num_running=0, max_num_seqs=32, remaining=(), costs=COSTS, prefilled=0, num_prefilling=0):
    """What Admission reads of the engine client: its latest snapshot."""
    snapshot = EngineSnapshot(num_running=num_running, max_num_seqs=max_num_seqs, step_costs=costs,
                              remaining_tokens=tuple(sorted(remaining)), prefilled_tokens=prefilled,
                              num_prefilling=num_prefilling)
    return SimpleNamespace(snapshot=snapshot)


def strict(**kw) -> AdmissionConfig:
    """Refusal at the objective itself (ttft_refuse_factor 1): these tests check the prediction's
    arithmetic against the bound, so they put the bound at the objective."""
    return AdmissionConfig(ttft_refuse_factor=1.0, **kw)


def proven(adm: Admission) -> None:
    """As if requests predicted past the refusal bound had lately taken past it (Audit.trusted)."""
    for _ in range(adm.audit.MIN_VERDICTS):
        adm.audit.shadow(realised=100.0, bound=1.0)


def refusal(adm: Admission, n: int) -> ApiError:
    with pytest.raises(ApiError) as e:
        adm.admit(n)
    assert e.value.status == 429 and int(e.value.headers["Retry-After"]) >= 1
    return e.value


def test_bounds_refuse_and_tickets_give_their_place_back():
    adm = Admission(AdmissionConfig(max_waiting=2, max_waiting_tokens=1000, ttft_slo=0), engine())
    a = adm.admit(400)
    adm.admit(500)
    assert refusal(adm, 1).code == "max_waiting"
    a.release()
    a.release()                                      # idempotent
    assert (adm.pending, adm.pending_tokens) == (1, 500)
    assert refusal(adm, 501).code == "max_waiting_tokens"
    adm.admit(500)


def test_idle_prediction_is_the_queue_over_the_prefill_rate():
    adm = Admission(strict(ttft_slo=1.0), engine())
    assert adm.prefill_tokens_per_second == pytest.approx(1000)
    assert adm.predicted_ttft(400) == pytest.approx(0.4)
    adm.admit(400)
    # Nothing decodes yet: the first step prefills the whole token budget, 400 + 112 of the next
    # prompt (0.512 s). The queue's oldest prompt is late by then (half the objective, 0.5 s): the
    # first request decodes beside the rest in late steps of 130 ms (1.3 x 100 ms), each taking
    # 110 tokens (the bucket of 4 at 20 ms, conservatively), four of them, then the 48 left.
    assert adm.predicted_ttft(600) == pytest.approx(0.512 + 4 * 0.13 + 0.068)
    error = refusal(adm, 600)
    assert error.code == "ttft_slo" and "exceeds the 1 s objective" in error.message
    assert adm.predicted_ttft(300) < 1.0
    adm.admit(300)


def test_decode_load_raises_the_prediction():
    idle, busy = (Admission(strict(ttft_slo=1.0), engine(num_running=n)) for n in (0, 16))
    assert idle.predicted_ttft(600) == pytest.approx(0.6)
    # 16 streams: each 100 ms step prefills (0.1 - 0.04) / 0.001 = 60 tokens; 5 steps until the
    # prompt is late (0.5 s), then late steps of 130 ms take 90 tokens: three, then the 30 left.
    assert busy.predicted_ttft(600) == pytest.approx(5 * 0.1 + 3 * 0.13 + 0.07)
    idle.admit(600)
    assert refusal(busy, 700).code == "ttft_slo"


def test_a_prompt_still_prefilling_is_not_also_a_decode():
    """16 clients: 12 streams decode, 4 prompts wait (2 of them already running, mid-prefill).
    The old prediction counted the 2 twice and all 4 as decoding from the start: 18 decodes,
    past the largest bucket seen (16), so 80 ms a decode step and 20 prefill tokens a step ->
    600 tokens in 30 steps, 3 s, refused at a 2 s objective. The engine decodes 12 streams, then
    up to 16, at 40 ms a step: 60 tokens a step, 10 steps, 1 s."""
    client = engine(num_running=14, num_prefilling=2)
    adm = Admission(strict(ttft_slo=2.0), client)
    for _ in range(4):
        adm.admit(100)
    assert adm.predicted_ttft(200) == pytest.approx(10 * 0.1)
    assert adm.predicted_ttft(200) == pytest.approx(COSTS.queue_prefill_seconds([100] * 4 + [200], 12, 32))
    adm.admit(200)


def test_waiting_prompts_join_the_decodes_once_prefilled():
    """Nothing decodes: the first prompt prefills at the idle rate; later prompts share steps with
    the streams the earlier ones became."""
    adm = Admission(AdmissionConfig(ttft_slo=0), engine())
    adm.admit(512)
    # Step 1: 512 tokens alone (0.512 s). Then one stream decodes: 80 tokens per 100 ms step.
    assert adm.predicted_ttft(160) == pytest.approx(0.512 + 2 * 0.1)
    adm.admit(160)
    # Two streams now decode beside the third prompt (still the bucket of 4).
    assert adm.predicted_ttft(80) == pytest.approx(0.512 + 3 * 0.1)


def test_chunks_already_prefilled_are_not_counted_again():
    client = engine()
    adm = Admission(AdmissionConfig(ttft_slo=0), client)
    adm.admit(800)
    before = adm.predicted_ttft(100)
    client.snapshot = EngineSnapshot(num_running=1, num_prefilling=1, max_num_seqs=32, step_costs=COSTS,
                                     prefilled_tokens=600)
    # 200 tokens left of the first prompt and 100 of the new one, nothing decoding: one step.
    assert adm.predicted_ttft(100) == pytest.approx(0.3) and adm.predicted_ttft(100) < before
    client.snapshot = EngineSnapshot(max_num_seqs=32, step_costs=COSTS, prefilled_tokens=5000)   # stale
    # The first prompt counts as prefilled, so as a decode beside the new one.
    assert adm.predicted_ttft(100) == pytest.approx(COSTS.prefill_seconds(100, 1))


def test_prompt_tokens_in_the_prefix_cache_are_not_prefilled_again():
    """Prompts the engine has seen (a shared system prompt; the bench's levels share their first
    requests) prefill only their uncached tail."""
    seen = list(range(512))
    adm = Admission(strict(ttft_slo=0.5), engine(),
                    cached_prefix=lambda ids, salt=None: 496 if list(ids) == seen else 0)
    for _ in range(3):
        adm.admit_prompt(seen)                       # 16 tokens each left to compute
    # Counted whole, the 4th would take 4 x 512 tokens: 0.512 s alone, then 1.5 s more beside
    # the decodes. Cached: 4 x 16 tokens in one idle step.
    assert adm.predicted_ttft(512, 496) == pytest.approx(0.064)
    ticket = adm.admit_prompt(seen)
    assert (ticket.num_tokens, ticket.num_cached) == (512, 496) and adm.pending_tokens == 4 * 512
    # A new prompt: 64 + 448 in the first (idle) step; the queue is late by then (half of 0.5 s):
    # its last 64 tokens in a late step beside the four cached prompts' decodes.
    assert adm.predicted_ttft(512) == pytest.approx(0.512 + 0.02 + 0.064)
    assert refusal(adm, 512).code == "ttft_slo"
    # Once the engine computed the first prompt (its hits included), it decodes beside 3 x 16.
    adm.client.snapshot = EngineSnapshot(num_running=1, num_prefilling=1, max_num_seqs=32, step_costs=COSTS,
                                         prefilled_tokens=512)
    assert adm.predicted_ttft(16) == pytest.approx(0.02 + 0.064)


def test_full_seats_add_the_wait_for_the_shortest_replies():
    full = engine(num_running=4, max_num_seqs=4, remaining=(3, 10, 50, 50))
    adm = Admission(strict(ttft_slo=5.0), full)
    # Every seat is taken: wait until the shortest reply ends, 3 decode steps of 20 ms (the
    # target ITL of 100 ms does not stretch them: no prompt is waiting to be prefilled).
    assert adm.predicted_ttft(100) == pytest.approx(3 * 0.02 + COSTS.prefill_seconds(100, 4))
    adm.admit(100)
    # The next one waits for the second shortest (10 steps), then for both prompts' prefill.
    assert adm.predicted_ttft(100) == pytest.approx(10 * 0.02 + COSTS.queue_prefill_seconds([100, 100], 4, 4))


def test_seats_free_a_batch_at_a_time_behind_a_single_running_reply():
    # One reply of 64 steps runs, three seats are free: the first three of seven waiting prompts
    # take them at once, the fourth takes the running one's seat after 64 steps and the last
    # three the first three's after 64 more (their replies assumed as long as the running one's).
    # The newcomer, eighth in line, waits for one of those: 128 steps of a full batch (20 ms).
    adm = Admission(AdmissionConfig(ttft_slo=60.0), engine(num_running=1, max_num_seqs=4, remaining=(64,)))
    for _ in range(7):
        adm.admit(200)
    assert adm.predicted_ttft(200) == pytest.approx(128 * 0.02 + COSTS.queue_prefill_seconds([200] * 8, 1, 4,
                                                                                              decode_ends=(64,)))


def test_no_refusal_by_prediction_before_a_decode_step_was_timed():
    # A cold server: the step-cost model has timed no step with streams decoding, so a prediction
    # with decodes in it rests on the prior (20 ms a step) and refuses nothing; the queue bound
    # still does. Once a decode step is timed, the same prediction refuses.
    cold = StepCosts(target_itl=0.02, min_prefill_chunk=16, max_tokens=512, prefill_seconds_per_token=0.001)
    adm = Admission(strict(ttft_slo=0.5, max_waiting=10), engine(num_running=1, max_num_seqs=4, remaining=(64,),
                                                               costs=cold))
    for _ in range(8):
        adm.admit(200)
    assert adm.predicted_ttft(200) > 0.5 and adm.pending == 8
    # The engine times its first decode step (here as slow as the prior): the model is measured.
    adm.client = engine(num_running=1, max_num_seqs=4, remaining=(64,),
                        costs=replace(cold, decode_seconds_by_bucket=((1, 0.02),)))
    assert refusal(adm, 200).code == "ttft_slo"
    adm.client = engine(num_running=1, max_num_seqs=4, remaining=(64,), costs=cold)
    adm.admit(200)
    adm.admit(200)
    assert refusal(adm, 200).code == "max_waiting"
    # An idle server with nothing waiting predicts from the prefill rate alone, and refuses on it.
    assert refusal(Admission(strict(ttft_slo=0.5), engine(costs=cold)), 600).code == "ttft_slo"


def test_a_refusal_stops_predicting_once_past_the_objective():
    adm = Admission(strict(ttft_slo=1.0), engine(num_running=4))
    for _ in range(10):
        adm.admit(30)                                # 60-80 tokens a step beside 4-14 decodes
    whole = adm.predicted_ttft(4000)                 # then 60 a step until late, then 512 a step
    assert whole > 4.0
    error = refusal(adm, 4000)
    assert error.code == "ttft_slo" and 1 <= int(error.headers["Retry-After"]) <= 7
    assert 1.0 < adm.predicted_ttft(4000, horizon=1.0) < whole


def test_objective_zero_disables_the_prediction_check():
    adm = Admission(AdmissionConfig(ttft_slo=0), engine())
    adm.admit(100_000)
    adm.admit(100_000)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_objective_must_be_a_finite_non_negative_number(bad):
    with pytest.raises(ValueError, match="ttft_slo"):
        AdmissionConfig(ttft_slo=bad)


def test_the_default_objective_is_two_seconds():
    assert AdmissionConfig().ttft_slo == 2.0


def test_by_default_a_request_past_the_objective_queues_and_past_five_times_it_is_refused():
    """The default a closed-loop benchmark can live with: predicted 1.1 s against a 1 s objective
    is admitted (strict mode refuses it); past 5 s it is refused, naming the multiple."""
    assert AdmissionConfig().ttft_refuse_factor == 5.0
    adm = Admission(AdmissionConfig(ttft_slo=1.0), engine())
    adm.admit(400)
    assert adm.predicted_ttft(600) == pytest.approx(1.1) and adm.predicted_ttft(600) > 1.0
    adm.admit(600)
    assert refusal(Admission(strict(ttft_slo=1.0), engine()), 1100).code == "ttft_slo"
    proven(adm)
    error = refusal(adm, 6000)
    assert error.code == "ttft_slo" and "exceeds 5 x the 1 s objective" in error.message
    assert int(error.headers["Retry-After"]) >= 1


@pytest.mark.parametrize("bad", [0.5, float("inf"), float("nan")])
def test_refuse_factor_is_at_least_one(bad):
    with pytest.raises(ValueError, match="ttft_refuse_factor"):
        AdmissionConfig(ttft_refuse_factor=bad)


def test_calibration_scales_the_prediction_by_what_first_tokens_took():
    adm = Admission(strict(ttft_slo=1.0), engine())
    assert adm.predicted_ttft(600) == pytest.approx(0.6)
    for _ in range(60):                              # each first token took twice the prediction
        adm.calibration.observe(predicted=0.3, realised=0.6)
    assert adm.calibration.factor == pytest.approx(2.0, rel=0.06)
    assert adm.predicted_ttft(600) == pytest.approx(1.2, rel=0.06)
    adm.admit(600)                                   # past the objective as calibrated, but a refusal
    assert refusal(adm, 1100).code == "ttft_slo"     # needs the model's own prediction past the bound
    for _ in range(200):                             # a wild outlier cannot push it past its bounds
        adm.calibration.observe(predicted=0.1, realised=100.0)
    assert adm.calibration.factor == pytest.approx(4.0)
    adm.calibration.observe(predicted=0.001, realised=5.0)   # too short to learn from
    assert adm.calibration.factor == pytest.approx(4.0)


def test_calibration_settles_on_the_ninetieth_percentile_of_the_ratios():
    import random

    rng = random.Random(0)
    adm = Admission(AdmissionConfig(), engine())
    for _ in range(3000):                            # ratios uniform in [0.5, 1.5]: p90 = 1.4
        adm.calibration.observe(predicted=1.0, realised=rng.uniform(0.5, 1.5))
    assert adm.calibration.factor == pytest.approx(1.4, abs=0.08)


def test_a_ticket_learns_at_its_first_token_not_when_it_ends_without_one():
    adm = Admission(AdmissionConfig(ttft_slo=0), engine())
    ticket = adm.admit(600)                          # predicted 0.6 s; its first token comes at once
    assert ticket.predicted == pytest.approx(0.6)
    ticket.first_token()
    assert adm.calibration.factor < 1.0 and (adm.pending, adm.pending_tokens) == (0, 0)
    factor = adm.calibration.factor
    adm.admit(600).release()                         # aborted before its first token
    ticket.first_token()                             # a second call changes nothing
    assert adm.calibration.factor == factor and (adm.pending, adm.pending_tokens) == (0, 0)


def test_admission_counts_only_the_blocks_the_request_s_salt_can_hit():
    """Blocks cached under salt A do not shorten a prediction for salt B (or none): otherwise the
    429 boundary would tell B what the prefix cache refuses to."""
    from kiln.runtime.kv_manager import PrefixCacheView, _chain_hashes

    prompt = list(range(512))
    client = engine()
    client.snapshot = EngineSnapshot(max_num_seqs=32, step_costs=COSTS,
                                     prefix_cache=PrefixCacheView(16, frozenset(_chain_hashes(prompt, 16, "A"))))
    adm = Admission(strict(ttft_slo=0.3), client)
    assert adm.admit_prompt(prompt, "A").num_cached == 496      # the last block is always computed
    for other in ("B", None):
        with pytest.raises(ApiError) as refused:                # 512 tokens: 0.512 s > 0.3 s
            adm.admit_prompt(prompt, other)
        assert refused.value.code == "ttft_slo"


def test_the_audit_counts_admitted_requests_late_or_on_time():
    adm = Admission(strict(ttft_slo=1.0), engine())
    on_time = adm.admit(100)
    late = adm.admit(100)
    on_time.first_token()                            # at once: within the objective
    late.admitted_at -= 2.0                          # as if admitted two seconds ago
    late.first_token()
    assert (adm.audit.admitted_on_time, adm.audit.admitted_late) == (1, 1)


def test_a_calibration_above_one_never_turns_an_admission_into_a_refusal():
    adm = Admission(strict(ttft_slo=1.0), engine())
    for _ in range(60):
        adm.calibration.observe(predicted=0.3, realised=0.9)    # first tokens took three times the model
    assert adm.predicted_ttft(800) > 2.0
    adm.admit(800)                                   # the model says 0.8 s: it queues


def test_a_refusal_the_next_admitted_request_proves_unneeded_relaxes_the_calibration():
    """Refused for a predicted TTFT past the bound, while the request admitted right after it got
    its first token at once: an unneeded refusal, counted, and the prediction scaled down."""
    adm = Admission(strict(ttft_slo=1.0), engine())
    for _ in range(60):
        adm.calibration.observe(predicted=0.3, realised=0.9)    # a model that learnt to be pessimistic
    refusal(adm, 1200)
    assert (adm.audit.refused, adm.audit.refused_unneeded) == (1, 0)
    before = adm.refusal_calibration.factor
    ticket = adm.admit(10)
    ticket.first_token()
    assert adm.audit.refused_unneeded == 1
    assert adm.refusal_calibration.factor < before * 0.95
    adm.admit(10).first_token()                      # a refusal is judged once
    assert adm.audit.refused_unneeded == 1


def test_a_refusal_is_judged_on_a_quick_outcome_the_queue_on_a_slow_one():
    """First tokens that took between half and all of the model's prediction: the queue's
    prediction keeps the slow end (seldom late), a refusal the quick end, so a request that the
    model puts a little past the bound queues, and one far past it is refused."""
    rng = random.Random(0)
    adm = Admission(strict(ttft_slo=1.0), engine())
    for _ in range(400):
        ticket = adm.admit(10)
        ticket.predicted = 1.0
        ticket.admitted_at -= rng.uniform(0.5, 1.0)
        ticket.first_token()
    assert adm.calibration.factor > 0.85 > 0.8 > adm.refusal_calibration.factor
    assert adm.predicted_ttft(1200) > 1.0        # the model says 1.2 s: past the objective ...
    adm.admit(1200).release()                    # ... but a quick outcome is within it: it queues
    assert refusal(adm, 3000).code == "ttft_slo"


def test_a_refusal_the_next_admitted_request_confirms_is_not_counted():
    adm = Admission(strict(ttft_slo=1.0), engine())
    refusal(adm, 2000)
    ticket = adm.admit(10)
    ticket.admitted_at -= 5.0                         # its first token took past the bound
    ticket.first_token()
    assert (adm.audit.refused, adm.audit.refused_unneeded) == (1, 0)


def test_past_the_multiple_a_refusal_needs_predictions_that_came_true():
    """By default (5 x the objective) a request predicted past the bound is admitted until such
    predictions have come true: its first token is the evidence. Unneeded ones keep it admitting."""
    adm = Admission(AdmissionConfig(ttft_slo=1.0), engine())
    adm.admit(400)
    tickets = [adm.admit(6000) for _ in range(4)]            # each predicted past 5 s: admitted all the same
    assert all(t.shadow_bound == 5.0 for t in tickets)
    for t in tickets:
        t.first_token()                                      # at once: the predictions did not come true
    assert not adm.audit.trusted()
    adm.admit(6000).release()
    for t in [adm.admit(6000) for _ in range(adm.audit.VERDICTS)]:
        t.admitted_at -= 60.0                               # these took a minute: the predictions came true
        t.first_token()
    assert adm.audit.trusted()
    assert refusal(adm, 6000).code == "ttft_slo"


def test_the_strict_mode_refuses_on_the_prediction_alone():
    adm = Admission(strict(ttft_slo=1.0), engine())
    assert not adm.audit.trusted()
    assert refusal(adm, 1100).code == "ttft_slo"
