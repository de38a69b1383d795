"""Issue 45: no churn, prompts and KV cache as load. The policy's new signals on hand-made observations, where the
operator reads them (Prometheus answers, scrapes), and the simulator on the committed traces (seconds in all)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from minedraft.operator.autoscale import observe
from minedraft.operator.autoscale.check import Row, verdict
from minedraft.operator.autoscale.policy import Observations, PolicyConfig, PolicyState, decide, kv_slots
from minedraft.operator.autoscale.replica_model import ReplicaModel
from minedraft.operator.autoscale.simulate import SimConfig, load_trace, parse_trace, simulate

ROOT = Path(__file__).resolve().parents[3]
MODEL = ReplicaModel.load(ROOT / "benchmarks" / "autoscale" / "replica-model.json")
TRACES = ROOT / "benchmarks" / "autoscale" / "traces"
CONFIG = PolicyConfig(min_replicas=1, max_replicas=20, target_utilization=0.8, requests_per_replica=32,
                      batch_slowdown=0.0)


def obs(running: float, *, replicas: int = 2, waiting: float = 0.0, kv: float | None = None,
        prefill: float | None = None) -> Observations:
    """`running` requests decoding at 40 tok/s each; 0.25 requests/s finish (160 tokens each)."""
    return Observations(age_seconds=5.0, reporting_replicas=replicas, running_requests=running,
                        waiting_requests=waiting, output_tokens_per_second=running * 40.0,
                        predicted_tokens_per_second=running * 40.0, finished_requests_per_second=running / 4,
                        kv_cache_usage=kv, kv_cache_usage_1m=kv, prefill_seconds_per_second=prefill)


def settled(config: PolicyConfig, o: Observations, current: int, evaluations: int = 3) -> tuple[Any, PolicyState]:
    """A few evaluations of the same figures 15 s apart (the arrival estimate needs two), the last decision."""
    state = PolicyState(first_observed_seconds=-1000.0)
    decision = None
    for i in range(evaluations):
        decision, state = decide(config, state, current, o, 15.0 * i)
    return decision, state


# -- the policy ------------------------------------------------------------------------------------------------


def test_the_kv_cache_decides_when_it_holds_fewer_requests_than_the_batch() -> None:
    """16 requests on 2 replicas with their KV caches 90% full: a request holds 11% of one, a replica 8 of them;
    decoding alone (640 tok/s on 2 x 32 x 40 of capacity) would need 1. The caches at 80%: 2 x 0.9 / 0.8 -> 3."""
    decision, _ = settled(CONFIG, obs(16, kv=0.9), 2)
    assert decision.inputs is not None and decision.inputs.signal == "kv", decision.reason
    assert decision.inputs.slots_per_replica == 8
    assert decision.desired == 3 and "KV cache holds 8 requests per replica" in decision.reason
    # The same figures without the prompt signals (output tokens/s alone, the policy before): nothing to add.
    blind, _ = settled(replace(CONFIG, prompt_signals=False), obs(16, kv=0.9), 2)
    assert blind.desired <= 2 and blind.inputs is not None and blind.inputs.signal != "kv"
    assert kv_slots(CONFIG, None) == 32 and kv_slots(CONFIG, 0.9 * 2 / 16) == 8 and kv_slots(CONFIG, 2.0) == 1


def test_prefill_time_is_time_a_replica_does_not_decode() -> None:
    """40 requests decoding need 40 x 40 / (0.8 x 32 x 40) = 1.6 replicas' time; prefill takes 1.5 replica-seconds
    per second more (75% of each of 2 replicas): (1.25 + ... ) -> (1600 / 1280 + 1.5 / 0.8) = 3.1 -> 4."""
    decision, _ = settled(CONFIG, obs(40, prefill=1.5), 2)
    assert decision.inputs is not None and decision.inputs.signal == "prefill", decision.reason
    assert decision.desired == 4 and "prefill 75% of a replica's time" in decision.reason
    assert decision.inputs.prefill_share == pytest.approx(0.75)
    blind, _ = settled(replace(CONFIG, prompt_signals=False), obs(40, prefill=1.5), 2)
    assert blind.desired == 2


def test_kv_per_request_rising_is_sized_for_when_new_replicas_serve() -> None:
    """Prompts growing: each evaluation a request holds 1% more of a cache. The share forecast for when replicas
    asked for now serve (a startup and an interval ahead) sizes the caches, not today's share."""
    state = PolicyState(first_observed_seconds=-1000.0)
    shares = [0.030 + 0.0003 * i for i in range(20)]
    for i, share in enumerate(shares):
        o = obs(20, replicas=2, kv=share * 20 / 2)
        decision, state = decide(CONFIG, state, 2, o, 15.0 * i)
    assert decision.inputs is not None
    assert max(v for _, v in state.kv_samples) == pytest.approx(shares[-1])
    # 20 requests at the minute's mean share (0.03525) need 0.88 replicas' caches at 80%; 75 s ahead (a prior
    # startup and an interval: 5 more steps of 0.0003) a request holds 0.0372: 0.94.
    today = 20 * sum(shares[-4:]) / 4 / 0.8
    assert decision.inputs.kv_replicas == pytest.approx(20 * shares[-1] * 0.0372 / (sum(shares[-4:]) / 4) / 0.8,
                                                        rel=1e-3)
    assert decision.inputs.kv_replicas > today * 1.05


def test_a_scale_up_is_kept_until_its_replicas_serve_and_the_queue_drained() -> None:
    """A surge asks for 8; the rates say 2 from the next evaluation on. Not removed while the new replicas start
    (the issue's 1 -> 4 -> 1 fifteen seconds later), nor while requests wait, nor for scale_up_hold_seconds once
    they serve with none waiting; then the window's sustained need applies."""
    config = replace(CONFIG, scale_down_stabilization_seconds=0.0)
    state = PolicyState(first_observed_seconds=-1000.0, last_in_system=(0.0, 40.0))
    surge = replace(obs(60, waiting=150), finished_requests_per_second=5.0)
    up, state = decide(config, state, 2, surge, 15.0)
    assert up.desired > 4 and up.inputs is not None and up.inputs.signal == "queue"
    calm = obs(20, replicas=2)
    for t in (30.0, 60.0, 120.0):  # the new replicas are still starting (2 report)
        held, state = decide(config, state, up.desired, calm, t)
        assert held.desired == up.desired and "do not all serve yet" in held.reason, held.reason
    serving = replace(calm, reporting_replicas=up.desired)
    held, state = decide(config, state, up.desired, replace(serving, waiting_requests=3.0), 150.0)
    assert held.desired == up.desired
    held, state = decide(config, state, up.desired, serving, 165.0)
    assert held.desired == up.desired and "serve with no request waiting since 165s" in held.reason
    held, state = decide(config, state, up.desired, serving, 165.0 + config.scale_up_hold_seconds - 1)
    assert held.desired == up.desired
    down, _ = decide(config, state, up.desired, serving, 165.0 + config.scale_up_hold_seconds)
    assert down.desired < up.desired
    # Without the memory of scale-ups (the policy before): removed at the next evaluation, before they served.
    old = replace(config, scale_up_hold_seconds=None)
    state = PolicyState(first_observed_seconds=-1000.0, last_in_system=(0.0, 40.0))
    up, state = decide(old, state, 2, surge, 15.0)
    churn, _ = decide(old, state, up.desired, calm, 30.0)
    assert churn.desired < up.desired


# -- where the operator reads them -------------------------------------------------------------------------------


def sample(value: float, **labels: str) -> dict[str, Any]:
    return {"metric": labels, "value": [1000.0, str(value)]}


def test_prometheus_answers_carry_kv_prefill_and_ttft() -> None:
    results = {"running": [sample(10, instance="a")], "running_at": [sample(999.0)], "kv_usage": [sample(0.7)],
               "kv_usage_1m": [sample(0.6)], "prefill_seconds": [sample(0.4)], "ttft_mean": [sample(0.8)]}
    o = observe.observations_from_prometheus(results, 1000.0)
    assert (o.kv_cache_usage, o.kv_cache_usage_1m, o.prefill_seconds_per_second, o.mean_ttft_seconds) == (
        0.7, 0.6, 0.4, 0.8)
    for name in ("kv_usage", "kv_usage_1m", "prefill_seconds", "ttft_mean"):
        assert "minedraft_engine_" in observe.PROMETHEUS_QUERIES[name]
    bare = observe.observations_from_prometheus({"running": [sample(1)]}, 1000.0)
    assert bare.kv_cache_usage is None and bare.prefill_seconds_per_second is None


def exposition(kv: float, prefill_seconds: float) -> str:
    registry = CollectorRegistry()
    Gauge("minedraft_engine_running_requests", "r", ["model"], registry=registry).labels("m").set(4)
    Gauge("minedraft_engine_kv_cache_usage_ratio", "k", ["model"], registry=registry).labels("m").set(kv)
    prefill = Counter("minedraft_engine_prefill_seconds", "p", ["model", "mode"], registry=registry)
    prefill.labels("m", "psd").inc(prefill_seconds)
    prefill.labels("m", "ar").inc(1.0)
    return generate_latest(registry).decode()


def test_scrapes_give_kv_usage_and_the_prefill_rate() -> None:
    before = {"a": observe.parse_exposition(exposition(0.5, 10.0), 100.0),
              "b": observe.parse_exposition(exposition(0.3, 0.0), 100.0)}
    now = {"a": observe.parse_exposition(exposition(0.7, 13.0), 110.0),
           "b": observe.parse_exposition(exposition(0.5, 2.0), 110.0)}
    o = observe.observations_from_scrapes(now, before)
    assert o.kv_cache_usage == pytest.approx(0.6) and o.prefill_seconds_per_second == pytest.approx(0.5)
    assert observe.observations_from_scrapes(now, {}).prefill_seconds_per_second is None


# -- the simulator ------------------------------------------------------------------------------------------------


def test_prefill_is_in_the_time_to_first_token() -> None:
    """One request per 10 s: a prompt of 10,000 tokens at 0.1 ms each takes 1 s to prefill, 30,000 take 3 s: past
    the 2.5 s target however many replicas run."""
    def trace(prompt: int) -> Any:
        return parse_trace("\n".join(json.dumps(r) for r in [
            {"config": {"duration_seconds": 600, "max_replicas": 4}},
            {"t": 0, "arrival_rps": 0.1, "prompt_tokens": prompt, "output_tokens": 16, "acceptance_rate": 0.6}]),
            f"prompt-{prompt}")
    model = replace(MODEL, kv_capacity_tokens=None)
    assert model.prefill_seconds_per_token == pytest.approx(1e-4)
    # (Two arriving in the same second wait for each other's prefill on one replica: 2 s each is 4 s for the second.)
    assert simulate(trace(10_000), model, SimConfig()).slo_violation_fraction == 0.0
    assert simulate(trace(30_000), model, SimConfig()).slo_violation_fraction == 1.0


def test_the_kv_cache_caps_the_batch() -> None:
    assert MODEL.slots(256, 128) == MODEL.max_batch  # the committed traces: the batch limits
    assert MODEL.slots(6144, 256) == 4  # 27,700 / 6,400
    assert replace(MODEL, kv_capacity_tokens=None).slots(10**6, 10**6) == MODEL.max_batch


def test_prompts_growing_16x_add_replicas_before_the_kv_cache_runs_out() -> None:
    """At a constant 4 requests/s, prompts grow from 384 to 6144 tokens: the KV cache of a replica holds 43 requests
    at first and 4 at the end, and prefill takes 16x the time. With the prompt signals the replicas follow and
    hardly a request misses its first-token target; on output tokens/s alone (the policy before) the replicas stay
    where the tokens put them, the caches fill and half the requests miss it."""
    trace = load_trace(TRACES / "growing-prompts.jsonl")
    for startup in (40.0, 180.0):
        ours = simulate(trace, MODEL, SimConfig(startup_seconds=startup))
        blind = simulate(trace, MODEL, SimConfig(startup_seconds=startup, prompt_signals=False))
        assert ours.slo_violation_fraction < 0.005 and ours.kv_full_seconds < 0.05 * trace.duration_seconds
        assert blind.slo_violation_fraction > 0.2 and blind.kv_full_seconds > 0.3 * trace.duration_seconds
        # More replicas as the prompts grow: the last hour's quarter holds more than the first.
        replicas = ours.timeline["replicas"]
        assert min(replicas[2700:]) > max(replicas[:900])
        assert ours.scale_downs_soon_after_scale_up == 0 and ours.removed_before_ready == 0


@pytest.mark.parametrize("name", ["step", "square-600s"])
def test_no_replica_is_removed_before_it_served(name: str) -> None:
    """Without the memory of scale-ups (the policy before) the simulator counts replicas removed while starting and
    scale-downs within 120 s of a scale-up on these traces; with it, none."""
    trace = load_trace(TRACES / f"{name}.jsonl")
    before = simulate(trace, MODEL, SimConfig(scale_up_hold_seconds=None))
    assert before.removed_before_ready > 0 and before.scale_downs_soon_after_scale_up > 0
    after = simulate(trace, MODEL, SimConfig())
    assert after.removed_before_ready == 0 and after.scale_downs_soon_after_scale_up == 0
    assert after.direction_changes <= before.direction_changes


def test_check_names_every_failure_of_the_bar() -> None:
    def row(policy: str, replica_seconds: float, slo: float, **churn: int) -> Row:
        return Row("t", 40.0, policy, replica_seconds, slo, churn.get("changes", 0), churn.get("removed", 0),
                   churn.get("soon", 0))
    good = verdict([row("minedraft", 70, 0.01), row("hpa-queue", 100, 0.008)])
    assert good["40"]["failures"] == [] and good["40"]["replica_seconds_ratio"] == 0.7
    bad = verdict([row("minedraft", 90, 0.02, soon=1, removed=2, changes=3), row("hpa-queue", 100, 0.01)])
    assert len(bad["40"]["failures"]) == 5, bad


def test_the_scale_down_window_is_at_least_three_start_ups() -> None:
    """With start-ups measured at 180 s a need of 6 replicas 400 s ago still holds them (540 s window); with the
    prior's (unmeasured) start-up the configured 300 s applies and they go."""
    from minedraft.operator.autoscale.policy import stabilization_seconds

    config = replace(CONFIG, scale_down_stabilization_seconds=300.0)
    assert stabilization_seconds(config, PolicyState()) == 300.0
    assert stabilization_seconds(config, PolicyState(startup_seconds=40.0)) == 300.0
    assert stabilization_seconds(config, PolicyState(startup_seconds=180.0)) == 540.0
    idle = obs(2, replicas=6)
    for startup, expected in ((180.0, 6), (None, 1)):
        state = PolicyState(first_observed_seconds=-2000.0, recommendations=((0.0, 6),), startup_seconds=startup)
        decision, _ = decide(config, state, 6, idle, 400.0)
        assert decision.desired == expected, decision.reason
