"""The scaling policy as a pure function: bounds, steps, stabilisation, starting pods, stale metrics, speculation."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from minedraft.operator.autoscale.policy import (
    Observations,
    PolicyConfig,
    PolicyState,
    SpeculationFigures,
    batch_slowdown,
    decide,
    estimate_demand,
    evaluate_early,
    forecast_arrivals,
    lead_seconds,
    per_request_speed,
    planned_batch,
    projected_backlog,
    queue_growth_seconds,
    surge_replicas,
)

CONFIG = PolicyConfig(min_replicas=1, max_replicas=10, target_utilization=0.8, interval_seconds=15,
                      scale_down_stabilization_seconds=300, max_scale_up_step=2, requests_per_replica=32,
                      batch_slowdown=0.0)  # speed independent of the batch: exact arithmetic below


def obs(running: float, waiting: float = 0.0, tokens_per_request: float = 40.0, replicas: int = 2,
        age: float = 5.0, predicted: bool = True) -> Observations:
    """Engines serving `running` requests at `tokens_per_request` tok/s each."""
    return Observations(age_seconds=age, reporting_replicas=replicas, running_requests=running,
                        waiting_requests=waiting, output_tokens_per_second=running * tokens_per_request,
                        predicted_tokens_per_second=running * tokens_per_request if predicted else None)


def run(config: PolicyConfig, current: int, series: list[Observations], start: float = 0.0,
        state: PolicyState | None = None) -> tuple[list[int], PolicyState]:
    """Apply the policy every interval, following its decisions; the replica counts after each one."""
    state = state or PolicyState()
    counts = []
    for i, o in enumerate(series):
        decision, state = decide(config, state, current, o, start + i * config.interval_seconds)
        current = decision.desired
        counts.append(current)
    return counts, state


def test_desired_is_demand_over_utilised_capacity() -> None:
    # 2 replicas x 32 slots x 40 tok/s = 2560 tok/s of capacity; 60 running = 2400 tok/s demand; at 0.8: 2400 /
    # (0.8 x 1280) = 2.34 -> 3.
    decision, _ = decide(CONFIG, PolicyState(), 2, obs(60), 0.0)
    assert decision.desired == 3 and decision.metrics_available
    assert decision.inputs is not None and decision.inputs.capacity_tokens_per_second_per_replica == 1280
    assert decision.reason.startswith("scale up")


def test_waiting_requests_raise_demand() -> None:
    quiet, _ = decide(CONFIG, PolicyState(), 2, obs(40), 0.0)
    queued, _ = decide(CONFIG, PolicyState(), 2, obs(40, waiting=80), 0.0)
    assert quiet.desired == 2 and queued.desired == 4


def test_never_beyond_max_nor_below_min() -> None:
    counts, _ = run(CONFIG, 9, [obs(1000, waiting=500)] * 5)
    assert counts == [10] * 5
    config = replace(CONFIG, scale_down_stabilization_seconds=0)
    counts, _ = run(config, 3, [obs(0, tokens_per_request=0)] * 3)
    assert min(counts) == 1


def test_never_to_zero_unless_min_is_zero() -> None:
    config = replace(CONFIG, scale_down_stabilization_seconds=0)
    idle = Observations(age_seconds=1, reporting_replicas=1, running_requests=0, waiting_requests=0,
                        output_tokens_per_second=0)
    assert decide(config, PolicyState(), 1, idle, 0.0)[0].desired == 1
    assert decide(replace(config, min_replicas=0), PolicyState(), 1, idle, 0.0)[0].desired == 0


def test_out_of_bounds_replicas_come_back_within_bounds() -> None:
    assert decide(CONFIG, PolicyState(), 12, None, 0.0)[0].desired == 10
    assert decide(replace(CONFIG, min_replicas=3), PolicyState(), 1, None, 0.0)[0].desired == 3


def test_scale_up_is_step_limited_per_decision() -> None:
    fixed = replace(CONFIG, max_scale_up_percent=0)
    counts, _ = run(fixed, 1, [obs(300, waiting=300, replicas=1)] * 4)
    assert counts == [3, 5, 7, 9]
    first, _ = decide(fixed, PolicyState(), 1, obs(300, waiting=300, replicas=1), 0.0)
    assert "step limited to +2" in first.reason


def test_scale_up_may_double_as_the_hpa_default_allows() -> None:
    # The larger of +2 and +100% of the current count: 1 -> 3 (+2), 3 -> 6 (+3), 6 -> 10 (+6, clamped to max 10).
    counts, _ = run(CONFIG, 1, [obs(300, waiting=300, replicas=1)] * 4)
    assert counts == [3, 6, 10, 10]
    third, _ = decide(CONFIG, PolicyState(), 3, obs(300, waiting=300, replicas=3), 0.0)
    assert "step limited to +3" in third.reason


def test_scale_down_waits_for_the_window_then_one_step_per_window() -> None:
    high = obs(200, replicas=8)  # needs 8 at 40 tok/s per request
    low = obs(20, replicas=8)  # needs 1
    counts, _ = run(CONFIG, 8, [high] * 4 + [low] * 60)
    # The high recommendations age out of the 300 s window 20 intervals after the last one; then one step down.
    first_down = counts.index(next(c for c in counts if c < 8))
    assert 4 + 300 / 15 - 1 <= first_down <= 4 + 300 / 15 + 1, counts
    changes = [i for i in range(1, len(counts)) if counts[i] != counts[i - 1]]
    assert all(b - a >= 300 / 15 for a, b in itertools.pairwise(changes)), counts
    assert counts[-1] < 8


def test_no_scale_down_while_the_requests_in_the_system_rise() -> None:
    """A whole window of light load on 8 replicas; then the requests in the system jump from 20 to 40: the rates (a
    minute's average) would still allow fewer replicas, but capacity is not removed during a visible rise."""
    low = obs(20, replicas=8)
    counts, state = run(CONFIG, 8, [low] * 20)  # t = 0 .. 285 s: the window is not yet whole
    assert counts[-1] == 8 and state.last_scale_down_seconds is None
    decision, _ = decide(CONFIG, state, 8, obs(40, replicas=8), 300.0)
    assert decision.desired == 8 and "rose from 20 to 40" in decision.reason
    # Within the tolerance (+10%) it is noise: the scale-down goes ahead.
    decision, _ = decide(CONFIG, state, 8, obs(22, replicas=8), 300.0)
    assert decision.desired < 8 and decision.reason.startswith("scale down")


def test_no_scale_down_before_a_whole_window_was_observed() -> None:
    # A restarted operator has no history: it must not shrink on its first look.
    counts, _ = run(CONFIG, 6, [obs(10, replicas=6)] * 10)
    assert counts == [6] * 10


def test_dip_inside_window_does_not_scale_down() -> None:
    counts, _ = run(CONFIG, 4, [obs(100, replicas=4)] * 21 + [obs(10, replicas=4)] * 3 + [obs(100, replicas=4)] * 5)
    assert set(counts) == {4}


def test_starting_pods_count_as_capacity() -> None:
    # spec.replicas is already 5 (3 starting): while only 2 report, the same load must not add more.
    load = obs(60, waiting=0, replicas=2)
    decision, _ = decide(CONFIG, PolicyState(), 5, load, 0.0)
    assert decision.desired == 5
    # What starting pods will cover is not asked for again: 150 requests need 6 (6000 / 1024), not 5 + 2.
    decision, _ = decide(CONFIG, PolicyState(), 5, obs(60, waiting=90, replicas=2), 0.0)
    assert decision.desired == 6


def test_missing_or_stale_metrics_make_no_decision() -> None:
    for observation, why in ((None, "no engine metrics"), (obs(500, age=120), "old"),
                             (obs(500, replicas=0), "no engine replica")):
        decision, state = decide(CONFIG, PolicyState(), 3, observation, 0.0)
        assert decision.desired == 3 and not decision.metrics_available and why in decision.reason
        assert state == PolicyState()  # nothing learned from nothing


def test_acceptance_drop_lowers_capacity_and_scales_up_without_a_queue() -> None:
    """No predicted-goodput gauge: speed from speculation figures. Same requests, no queue; acceptance halves."""
    def figures(accepted_length: float) -> Observations:
        speculation = SpeculationFigures(acceptance_rate=(accepted_length - 1) / 3,
                                         mean_accepted_length=accepted_length, draft_seconds_per_step=0.02,
                                         verify_seconds_per_step=0.05,
                                         overlap_fraction=0.9)
        speed = accepted_length / (0.05 + 0.1 * 0.02)
        return Observations(age_seconds=1, reporting_replicas=3, running_requests=64, waiting_requests=0,
                            output_tokens_per_second=64 * speed, speculation=speculation)

    before, after = figures(3.4), figures(1.6)
    speed_before, speed_after = per_request_speed(before), per_request_speed(after)
    assert speed_before is not None and speed_after is not None
    assert speed_after[0] < speed_before[0] and speed_after[1] == "speculation"
    # Output tokens/s fall with the speed while arrivals do not: in-system count is what a queue policy would see
    # next; this one sees the capacity drop. Demand in tokens: the same arrivals need the old token rate.
    held = replace(after, output_tokens_per_second=before.output_tokens_per_second)
    steady, _ = decide(CONFIG, PolicyState(), 3, before, 0.0)
    collapsed, _ = decide(CONFIG, PolicyState(), 3, held, 0.0)
    # 64 requests x 65.4 tok/s = 4185 tok/s of demand; capacity 32 x 30.8 = 985 tok/s: 4185 / (0.8 x 985) = 5.3 -> 6
    # (+3 is within +100% of 3).
    assert steady.desired == 3 and collapsed.desired == 6
    assert collapsed.inputs is not None and steady.inputs is not None
    before_capacity = steady.inputs.capacity_tokens_per_second_per_replica
    assert collapsed.inputs.capacity_tokens_per_second_per_replica < before_capacity


def test_small_capacity_fluctuations_do_not_move_replicas() -> None:
    """Engines switch mode and k on their own: a few percent of measured speed must not flap the replica count."""
    config = replace(CONFIG, scale_down_stabilization_seconds=0)
    series = [obs(77, tokens_per_request=40 * (1 + 0.05 * (-1) ** i), replicas=3) for i in range(20)]
    counts, _ = run(config, 3, series)
    assert set(counts) == {3}


def test_predicted_goodput_is_preferred_over_step_figures() -> None:
    o = replace(obs(10), speculation=SpeculationFigures(verify_seconds_per_step=1.0, mean_accepted_length=1.0))
    speed = per_request_speed(o)
    assert speed == (40.0, "predicted")
    assert per_request_speed(replace(o, predicted_tokens_per_second=None)) == (1.0, "speculation")


def test_batch_slowdown_is_learned_and_makes_consolidation_cautious() -> None:
    """Seconds per token linear in the batch (s = 0.01 + 0.001 c): learned from observations at several batches."""
    from minedraft.operator.autoscale.policy import batch_slowdown

    samples = tuple((c, 0.01 + 0.001 * c) for c in (4.0, 8.0, 16.0, 24.0))
    assert abs(batch_slowdown(samples) - 0.1) < 1e-9
    assert batch_slowdown(samples[:2]) == 1 / 16  # too few samples: the prior
    # 4 replicas at batch 4 (fast): flat speed would consolidate to 1 replica; with the slowdown, not that far.
    config = replace(CONFIG, batch_slowdown=None, scale_down_stabilization_seconds=0)
    state = PolicyState(speed_samples=samples)
    speed = 1 / (0.01 + 0.001 * 4)
    light = Observations(age_seconds=1, reporting_replicas=4, running_requests=16, waiting_requests=0,
                         output_tokens_per_second=16 * speed, predicted_tokens_per_second=16 * speed)
    flat, _ = decide(replace(config, batch_slowdown=0.0), PolicyState(), 4, light, 0.0)
    learned, _ = decide(config, state, 4, light, 0.0)
    assert flat.inputs is not None and flat.inputs.recommended == 1
    assert flat.desired == 1
    # 16 requests at 71 tok/s need 1143 tok/s: one replica's batch would grow without bound (c = 11.4 + 1.14 c).
    assert learned.desired == 2


def test_scale_down_goes_to_the_windows_highest_need_in_one_step() -> None:
    """No halving per step: after a large drop the replicas go to what the window still needs at once (halving once
    per window held a step's replicas for several windows: the 'above the oracle' property failed on 8 traces)."""
    config = replace(CONFIG, scale_down_stabilization_seconds=0)
    decision, _ = decide(config, PolicyState(), 9, obs(10, replicas=9), 0.0)
    assert decision.inputs is not None and decision.inputs.recommended == 1
    assert decision.desired == 1
    windowed = PolicyState(recommendations=((100.0, 4),), first_observed_seconds=0.0)
    decision, _ = decide(CONFIG, windowed, 9, obs(10, replicas=9), 350.0)
    assert decision.desired == 4


def test_the_window_remembers_the_loads_need_not_a_drained_queue() -> None:
    """A queue (built while replicas started) asks for replicas to drain it; once it is drained the window's floor
    is what the arrivals need, not what the queue asked for. While requests still wait, nothing is removed."""
    config = replace(CONFIG, max_replicas=20, max_scale_up_step=20)
    # 10 requests/s finish at 128 tokens (1280 tok/s: one replica of 32 x 40 at 0.8 needs 2); 300 wait, growing.
    busy = replace(obs(64, waiting=300), finished_requests_per_second=10.0, output_tokens_per_second=1280.0)
    state = PolicyState(last_in_system=(0.0, 300.0), first_observed_seconds=-1000.0)
    up, state = decide(config, state, 2, busy, 15.0)
    assert up.desired > 4  # the queue's drain asks for more
    waiting = replace(busy, waiting_requests=50.0, running_requests=60.0)
    held, state = decide(config, state, up.desired, waiting, 30.0)
    assert held.desired == up.desired and "wait" in held.reason
    # Drained, and every replica asked for serves: the scale-up is kept for scale_up_hold_seconds more (removing
    # replicas that just started is churn), then the floor is what the arrivals need.
    drained = replace(busy, waiting_requests=0.0, running_requests=20.0, reporting_replicas=up.desired)
    kept, state = decide(config, state, up.desired, drained, 45.0)
    assert kept.desired == up.desired and f"the scale-up to {up.desired} at 15s is kept" in kept.reason
    kept, state = decide(config, state, up.desired, drained, 45.0 + config.scale_up_hold_seconds - 15.0)
    assert kept.desired == up.desired
    down, _ = decide(config, state, up.desired, drained, 45.0 + config.scale_up_hold_seconds)
    assert down.desired < up.desired
    assert down.desired <= 4


def test_demand_from_arrivals_when_finished_rate_is_known() -> None:
    """10 requests/s finish at 100 tokens each; in-system grew by 75 in 15 s: 15 requests/s arrive -> 1500 tok/s,
    plus the queue drained over backlog_drain_seconds: 75 waiting and 5 more per second until a replica asked for
    now serves (the 60 s prior startup), 375 x 100 tokens."""
    from minedraft.operator.autoscale.policy import estimate_demand

    config = replace(CONFIG, backlog_drain_seconds=30)
    o = replace(obs(50, waiting=75, tokens_per_request=20), output_tokens_per_second=1000.0,
                finished_requests_per_second=10.0)
    demand, basis = estimate_demand(config, PolicyState(last_in_system=(0.0, 50.0)), o, 20.0, 15.0)
    assert basis == "arrivals" and demand == pytest.approx(15 * 100 + (75 + 5 * 60) * 100 / 30)
    # No previous look (or no finished rate): every request in the system at today's speed.
    demand, basis = estimate_demand(config, PolicyState(), o, 20.0, 15.0)
    assert basis == "in system" and demand == pytest.approx(max(125 * 20.0, 1000 * 125 / 50))


def test_no_cascade_while_replicas_start() -> None:
    """A step saturates 2 replicas; 4 more start. While they load, the queue keeps growing at the rate the policy
    already planned for: it must not keep adding replicas every interval."""
    config = replace(CONFIG, max_scale_up_step=4)
    state = PolicyState()
    current = 2
    waiting = 0.0
    counts = []
    for i in range(6):  # 90 s of model load: the new replicas never report
        waiting += 15 * (12 - 8)  # 12 requests/s arrive, 8/s finish (2 replicas x 32 slots, 200 tokens at 25 tok/s)
        o = Observations(age_seconds=1, reporting_replicas=2, running_requests=64, waiting_requests=waiting,
                         output_tokens_per_second=64 * 25.0, predicted_tokens_per_second=64 * 25.0,
                         finished_requests_per_second=8.0)
        decision, state = decide(config, state, current, o, i * 15.0)
        current = decision.desired
        counts.append(current)
    # Arrivals need 12 x 200 = 2400 tok/s (3.75 replicas at 0.8 x 800 tok/s) plus the growing backlog over 30 s; the
    # whole queue counted as demand would run to the maximum (10) within three intervals.
    assert counts[0] > 2 and counts[-1] <= counts[1] + 2, counts
    assert max(counts) <= 7, counts


def test_capacity_is_what_a_full_batch_gives() -> None:
    """Seconds per token grow 10% per request in the batch (g = 0.1). 2 replicas at batch 24 of 32, 40 tok/s each.
    A full batch: 40 x (1 + 2.4) / (1 + 3.2) = 32.38 tok/s per request, 1036.2 tok/s per replica; the 1920 tok/s
    these requests take need 1920 / (0.8 x 1036.2) = 2.32 -> 3 replicas. (Planned as 80% of the slots at the speed
    of that batch instead, 2 replicas would do: each at 92.6% of what it can produce.)"""
    from minedraft.operator.autoscale.policy import full_batch_capacity

    assert full_batch_capacity(40.0, 24.0, 0.1, 32) == pytest.approx(32 * 40 * 3.4 / 4.2)
    assert full_batch_capacity(40.0, 24.0, 0.0, 32) == pytest.approx(32 * 40)
    config = replace(CONFIG, batch_slowdown=0.1)
    decision, _ = decide(config, PolicyState(), 2, obs(48), 0.0)
    assert decision.inputs is not None
    assert decision.inputs.capacity_tokens_per_second_per_replica == pytest.approx(1036.19, abs=0.01)
    assert decision.desired == 3


def test_slowdown_samples_keep_every_batch_size_seen() -> None:
    """s = 0.01 + 0.001 c seen once at batches 4 and 8, then for 50 evaluations at 16: the newest sample per batch
    size is kept, so the fit still spans 4..16 (a ring of the last 40 would hold only batch 16, and the prior)."""
    config = replace(CONFIG, batch_slowdown=None)

    def at(batch: int) -> Observations:
        return obs(2 * batch, tokens_per_request=1 / (0.01 + 0.001 * batch))

    _, state = run(config, 2, [at(4), at(8)] + [at(16)] * 50)
    assert sorted(round(c) for c, _ in state.speed_samples) == [4, 8, 16]
    assert batch_slowdown(state.speed_samples) == pytest.approx(0.1)


def test_rising_arrivals_are_forecast_to_when_a_new_replica_serves() -> None:
    """Arrivals 10, 11, .. 14 req/s at t = 0, 15, .. 60: 1/15 req/s per second. Startup measured at 45 s, so a replica
    asked for at 60 s serves by 60 + 45 + 15 = 120 s, when 12 + (120 - 30) / 15 = 18 req/s arrive."""
    rising = ((0.0, 10.0), (15.0, 11.0), (30.0, 12.0), (45.0, 13.0), (60.0, 14.0))
    assert forecast_arrivals(rising, 60.0, 60.0) == pytest.approx(18.0)
    assert forecast_arrivals(tuple((t, 24 - a) for t, a in rising), 60.0, 60.0) is None  # falling: not used
    assert forecast_arrivals(rising[:3], 60.0, 60.0) is None  # too few to tell
    state = PolicyState(last_in_system=(45.0, 50.0), arrival_samples=rising[:4], startup_seconds=45.0)
    assert lead_seconds(CONFIG, state) == 60.0
    # 14 requests/s finish at 100 tokens each, none waiting, the count steady: arrivals 14/s now, 18/s forecast.
    o = replace(obs(50), output_tokens_per_second=1400.0, finished_requests_per_second=14.0)
    demand, basis = estimate_demand(CONFIG, state, o, 28.0, 60.0)
    assert basis == "arrivals rising" and demand == pytest.approx(18 * 100)
    flat = replace(state, arrival_samples=tuple((t, 14.0) for t, _ in rising[:4]))
    assert estimate_demand(CONFIG, flat, o, 28.0, 60.0) == (pytest.approx(14 * 100), "arrivals")


def test_startup_is_measured_from_a_scale_up_to_its_replicas_reporting() -> None:
    # 96 requests at 40 tok/s: 3840 / (0.8 x 1280) = 3.75 -> 4. Asked at 0 s; the two new replicas report at 45 s.
    state = PolicyState()
    decision, state = decide(CONFIG, state, 2, obs(96, replicas=2), 0.0)
    assert decision.desired == 4 and state.pending_scale_up == (0.0, 4)
    assert lead_seconds(CONFIG, state) == 60.0 + 15  # the prior until measured
    for t in (15.0, 30.0):
        decision, state = decide(CONFIG, state, 4, obs(96, replicas=2), t)
        assert decision.desired == 4 and state.startup_seconds is None
    _, state = decide(CONFIG, state, 4, obs(96, replicas=4), 45.0)
    assert state.startup_seconds == 45.0 and state.pending_scale_up is None
    assert lead_seconds(CONFIG, state) == 45.0 + 15


def test_a_growing_queue_is_sized_for_what_it_will_be_when_new_replicas_serve() -> None:
    """20 requests in the system, then 164 (64 running on 2 replicas, 100 waiting) 15 s later: 9.6 more per second.
    12.8 requests/s finish at 200 tokens, so (12.8 + 9.6) x 200 = 4480 tok/s arrive. A replica asked for now serves
    a startup (the 60 s prior) later, when 100 + 60 x 9.6 = 676 wait: 676 x 200 / 30 = 4507 tok/s to drain them.
    8987 tok/s at 0.8 x 1280 per replica: 8.8 -> 9 (today's 100 waiting alone would say 5.03 -> 6)."""
    config = replace(CONFIG, max_scale_up_step=8)
    state = PolicyState(last_in_system=(0.0, 20.0))
    o = replace(obs(64, waiting=100), output_tokens_per_second=2560.0, finished_requests_per_second=12.8)
    assert queue_growth_seconds(state, 15.0) == 60.0
    assert projected_backlog(state, o, 15.0) == pytest.approx(676)
    decision, after = decide(config, state, 2, o, 15.0)
    assert decision.desired == 9 and "(arrivals)" in decision.reason
    # 15 s later the 9 are starting: the queue grows only until they serve (45 s more), not a whole startup again.
    assert queue_growth_seconds(after, 30.0) == 45.0
    later = replace(o, waiting_requests=244.0)
    assert projected_backlog(after, later, 30.0) == pytest.approx(244 + 9.6 * 45)
    # No queue: growth into free slots is no backlog; a shrinking queue is just what waits now.
    assert projected_backlog(state, replace(o, waiting_requests=0.0), 15.0) == 0.0
    assert projected_backlog(PolicyState(last_in_system=(0.0, 300.0)), o, 15.0) == 100.0


def test_a_surge_of_requests_scales_up_before_the_rates_show_it() -> None:
    """40 requests in the system, then 60 running and 4 waiting on 2 replicas of 32 slots; the minute's rates still
    say 6.4 requests/s of 200 tokens finish: (6.4 + 24 / 15) x 200 = 1600 tok/s, 1.6 replicas -> 2. The requests in
    the system need 64 slots at 0.8 x 32 per replica: 2.5 -> 3."""
    config = replace(CONFIG, max_scale_up_step=8)
    state = PolicyState(last_in_system=(0.0, 40.0))
    o = replace(obs(60, waiting=4), output_tokens_per_second=1280.0, finished_requests_per_second=6.4)
    decision, _ = decide(config, state, 2, o, 15.0)
    assert decision.desired == 3 and "(arrivals)" in decision.reason and "(surge)" in decision.reason
    assert decision.inputs is not None and decision.inputs.signal == "surge"
    # No surge the replicas take without a queue, nor a rise within a Poisson count's noise (55 -> 64 < 55 + 2 x
    # sqrt(55)): there the rates decide.
    for quiet in (replace(o, waiting_requests=0.0, running_requests=64.0), o):
        start = PolicyState(last_in_system=(0.0, 55.0 if quiet is o else 40.0))
        decision, _ = decide(config, start, 2, quiet, 15.0)
        assert decision.desired == 2 and "(surge)" not in decision.reason, decision.reason
    o = replace(obs(64, waiting=100), output_tokens_per_second=2560.0, finished_requests_per_second=12.8)
    state = PolicyState(last_in_system=(0.0, 20.0))
    assert surge_replicas(config, state, o, 2) == pytest.approx(164 / 25.6)
    # Where a full batch adds little throughput (g = 0.1), a replica is planned to run fewer requests: at 25.6 /
    # (1 + 0.1 x 32 x 0.2) = 15.6, where it gives 80% of its full-batch throughput; 164 requests need 10.5.
    assert planned_batch(config, 0.1) == pytest.approx(25.6 / 1.64)
    c = planned_batch(config, 0.1)
    assert c / (1 + 0.1 * c) == pytest.approx(0.8 * 32 / (1 + 0.1 * 32))
    assert surge_replicas(config, state, o, 2, shape=0.1) == pytest.approx(164 / (25.6 / 1.64))
    # No surge within 80% of the replicas' slots (51.2 on 2), while a replica is starting (its queue is expected),
    # nor when the count falls (a queue draining).
    assert surge_replicas(config, state, replace(o, running_requests=50.0, waiting_requests=0.0), 2) == 0.0
    assert surge_replicas(config, state, o, 3) == 0.0
    assert surge_replicas(config, PolicyState(last_in_system=(0.0, 200.0)), o, 2) == 0.0
    assert surge_replicas(config, PolicyState(), o, 2) == 0.0
    starting, _ = decide(config, state, 3, o, 15.0)
    assert starting.desired == 9 and "surge" not in starting.reason


def _idle_light_load(replicas: int = 2) -> Observations:
    """Nothing running at this instant, at a light load: the last minute finished 3.7 requests/s of 128 tokens."""
    return Observations(age_seconds=5, reporting_replicas=replicas, running_requests=0, waiting_requests=0,
                        output_tokens_per_second=476.0, finished_requests_per_second=476.0 / 128)


def test_idle_replicas_keep_their_measured_capacity() -> None:
    """Issue 19: idle at an evaluation (normal at light load) made the capacity 0 and the policy ask for
    maxReplicas ("capacity 0 tok/s per replica (idle) needs 20"). The capacity is the replica's: the last speed
    measured, rescaled to a full batch."""
    config = replace(CONFIG, max_replicas=20)
    # A minute ago the two replicas decoded 4 requests at 40 tok/s each.
    _, state = run(config, 2, [obs(4)])
    decision, _ = decide(config, replace(state, last_in_system=(15.0, 0.0)), 2, _idle_light_load(), 30.0)
    assert decision.inputs is not None
    assert decision.inputs.capacity_tokens_per_second_per_replica == pytest.approx(32 * 40)
    assert decision.inputs.capacity_source == "last measured"
    # 476 tok/s on 2 x 1280 tok/s at 0.8: one replica would do; nothing is added.
    assert decision.desired <= 2
    assert not decision.reason.startswith("scale up")


def test_idle_replicas_with_nothing_measured_do_not_scale_up() -> None:
    """No speed measured yet (an operator restarted while idle) and no prior: capacity unknown, the count stays."""
    config = replace(CONFIG, max_replicas=20)
    decision, _ = decide(config, PolicyState(last_in_system=(15.0, 0.0)), 2, _idle_light_load(), 30.0)
    assert decision.desired == 2 and decision.metrics_available
    # With the replica model's prior, the capacity is that prior.
    prior = replace(config, prior_capacity_tokens_per_second_per_replica=2000.0)
    decision, _ = decide(prior, PolicyState(last_in_system=(15.0, 0.0)), 2, _idle_light_load(), 30.0)
    assert decision.inputs is not None and decision.inputs.capacity_source == "prior"
    assert decision.inputs.capacity_tokens_per_second_per_replica == 2000.0
    assert decision.desired == 2


def test_fractional_running_requests_measure_the_speed() -> None:
    """A time-averaged gauge below one request (a light load) still gives a speed: requests decoding alone."""
    config = replace(CONFIG, max_replicas=20)
    o = replace(obs(0.4, replicas=1), finished_requests_per_second=0.3, output_tokens_per_second=16.0)
    decision, state = decide(config, PolicyState(), 1, o, 0.0)
    assert decision.inputs is not None and decision.inputs.capacity_source == "predicted"
    assert state.speed_samples == ((1.0, 1 / 40),)
    assert decision.desired == 1


def test_wake_from_zero_on_a_waiting_stream_only() -> None:
    from minedraft.operator.autoscale.policy import wake_from_zero

    config = replace(CONFIG, min_replicas=0)
    assert wake_from_zero(config, 0, None) is None  # no gateway figure: nothing to act on
    assert wake_from_zero(config, 0, 0.0) is None
    assert wake_from_zero(config, 1, 5.0) is None  # not at zero: the regular evaluation sizes it
    woken = wake_from_zero(config, 0, 3.0)
    assert woken is not None and (woken.current, woken.desired) == (0, 1) and woken.metrics_available


def test_idle_for_a_whole_window_goes_to_zero_when_min_is_zero() -> None:
    """Measured once busy, then idle: zero once every recommendation of the window says so (not before)."""
    config = replace(CONFIG, min_replicas=0)
    idle = Observations(age_seconds=1, reporting_replicas=1, running_requests=0, waiting_requests=0,
                        output_tokens_per_second=0, finished_requests_per_second=0.0)
    counts, _ = run(config, 1, [obs(4, replicas=1)] + [idle] * 25)
    assert counts[0] == 1 and 0 in counts
    assert counts.index(0) * config.interval_seconds >= config.scale_down_stabilization_seconds


def _busy_without_a_speed(replicas: int = 2) -> Observations:
    """Replicas full and requests waiting, but no speed figure exported (no predicted goodput, no step seconds):
    the engines' gauges are not there yet, and a restarted operator has measured nothing."""
    return Observations(age_seconds=5, reporting_replicas=replicas, running_requests=32.0 * replicas,
                        waiting_requests=100.0, output_tokens_per_second=0.0)


def test_after_a_restart_the_capacity_prior_lets_the_policy_scale_up() -> None:
    """A restarted operator has no speed in memory: without a prior, a queue cannot be sized (no decision); with
    spec.autoscaling.replicaCapacityTokensPerSecond it is sized on the prior until a speed is measured."""
    from minedraft.operator import spec as s
    from minedraft.operator.autoscale.loop import policy_config

    base = {"target": {"source": {"huggingFace": {"id": "org/model"}}},
            "draft": {"source": {"huggingFace": {"id": "org/draft"}}}, "engine": {"maxNumSeqs": 32}}
    unset = policy_config(s.parse_spec({**base, "autoscaling": {"maxReplicas": 10}}))
    assert unset.prior_capacity_tokens_per_second_per_replica is None
    decision, _ = decide(unset, PolicyState(), 2, _busy_without_a_speed(), 0.0)
    assert decision.desired == 2 and not decision.metrics_available
    config = policy_config(s.parse_spec({**base, "autoscaling": {"maxReplicas": 10,
                                                                 "replicaCapacityTokensPerSecond": 1000}}))
    assert config.prior_capacity_tokens_per_second_per_replica == 1000.0
    decision, _ = decide(config, PolicyState(), 2, _busy_without_a_speed(), 0.0)
    assert decision.inputs is not None and decision.inputs.capacity_source == "prior"
    assert decision.inputs.capacity_tokens_per_second_per_replica == 1000.0
    # 164 requests at the prior's 1000 / 32 tok/s each need 5125 tok/s: 7 replicas at 0.8, by at most +2 at once.
    assert decision.inputs.recommended == 7 and decision.desired == 4
    # Once the engines report a speed, the measured figure wins over the prior.
    measured, _ = decide(config, PolicyState(), 2, obs(64, waiting=100, tokens_per_request=10.0), 0.0)
    assert measured.inputs is not None and measured.inputs.capacity_source == "predicted"


def test_the_arrivals_need_is_added_at_once_and_only_the_backlog_is_step_limited() -> None:
    """60 requests/s finish at 128 tokens and 2 more arrive per second than finish (94 in the system, 64 a
    decision ago): the arrivals alone need ceil(62 x 128 / (0.8 x 1280)) = 8 replicas. They are asked for at once
    (a step of +2 per 15 s would leave requests waiting a startup per step); the queue's drain on top is
    step-limited."""
    config = replace(CONFIG, max_replicas=20, max_scale_up_percent=0)
    busy = replace(obs(64, waiting=30), finished_requests_per_second=60.0, output_tokens_per_second=60 * 128.0)
    decision, _ = decide(config, PolicyState(last_in_system=(0.0, 64.0)), 2, busy, 15.0)
    assert decision.inputs is not None and decision.inputs.recommended == 9
    assert decision.desired == 8 and "step limited" in decision.reason


def test_a_surge_is_met_at_once() -> None:
    """200 requests in the system (40 a decision ago) on 2 replicas of 32 slots: they are there now, so the replicas
    they need at the planned batch (200 / 25.6 -> 8) are asked for at once, not +2 per interval."""
    config = replace(CONFIG, max_replicas=20, max_scale_up_percent=0)
    decision, _ = decide(config, PolicyState(last_in_system=(0.0, 40.0)), 2, obs(64, waiting=136), 15.0)
    assert decision.inputs is not None and decision.inputs.recommended == 8
    assert decision.desired == 8 and "step limited" not in decision.reason


def test_tokens_per_request_at_a_rise_come_from_the_longer_average() -> None:
    """For ten minutes 2 requests/s finished at 100 tokens each. Then load rises: this minute's output tokens/s
    (800) include requests still decoding whose completions it has not seen (2/s), a ratio of 400 tokens per request
    that would size for four times the demand. The ten-minute average (about 100) is used, the lower of the two."""
    config = replace(CONFIG, max_replicas=20)
    steady = replace(obs(5), finished_requests_per_second=2.0, output_tokens_per_second=200.0)
    _, state = run(config, 1, [steady] * 40)
    rising = replace(obs(20), finished_requests_per_second=2.0, output_tokens_per_second=800.0)
    demand, basis = estimate_demand(config, replace(state, last_in_system=(40 * 15.0, 20.0)), rising, 40.0,
                                    41 * 15.0)
    assert basis == "arrivals"
    assert demand == pytest.approx(2.0 * 200.0 / 2.0, rel=0.05)  # 2 arrivals/s x ~100 tokens, no queue


def test_evaluate_early_when_the_queue_grew_since_the_last_evaluation() -> None:
    """The fast path's trigger: waiting requests up since the last evaluation, at most once per tick."""
    # last evaluation at t=100 saw 2 waiting; 5 s ticks.
    assert evaluate_early(CONFIG, 3, 2.0, 100.0, 6.0, 105.0, 5.0)
    assert evaluate_early(CONFIG, 3, 0.0, 100.0, 1.0, 110.0, 5.0)  # a queue where there was none
    assert not evaluate_early(CONFIG, 3, 2.0, 100.0, 2.0, 105.0, 5.0)  # not grown
    assert not evaluate_early(CONFIG, 3, 6.0, 100.0, 2.0, 105.0, 5.0)  # shrinking
    assert not evaluate_early(CONFIG, 3, 0.0, 100.0, 0.0, 105.0, 5.0)  # no queue
    assert not evaluate_early(CONFIG, 3, 2.0, 100.0, 6.0, 102.0, 5.0)  # within a tick of the last evaluation
    assert evaluate_early(CONFIG, 3, 2.0, 100.0, 6.0, 104.8, 5.0)  # a tick landing just short still counts
    assert not evaluate_early(CONFIG, 3, None, None, 6.0, 105.0, 5.0)  # no evaluation yet: the interval's job
    assert not evaluate_early(CONFIG, 3, 2.0, 100.0, None, 105.0, 5.0)  # no figure now
    assert not evaluate_early(CONFIG, CONFIG.max_replicas, 2.0, 100.0, 6.0, 105.0, 5.0)  # nothing to add
    assert not evaluate_early(CONFIG, 0, 2.0, 100.0, 6.0, 105.0, 5.0)  # at zero: the gateway's gauge wakes
    # The scale-up step is per interval (15 s here): no early evaluation within an interval of the last scale-up.
    assert not evaluate_early(CONFIG, 3, 2.0, 100.0, 6.0, 105.0, 5.0, last_scale_up_seconds=95.0)
    assert evaluate_early(CONFIG, 3, 2.0, 100.0, 6.0, 110.0, 5.0, last_scale_up_seconds=95.0)

