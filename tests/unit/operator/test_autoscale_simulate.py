"""Simulator properties on the committed traces and replica model (deterministic; ~5 s in all)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from minedraft.operator.autoscale.hpa import HpaConfig, HpaState, hpa_decide
from minedraft.operator.autoscale.policy import Observations, PolicyConfig, PolicyState, decide
from minedraft.operator.autoscale.replica_model import ReplicaModel, calibrate
from minedraft.operator.autoscale.simulate import SimConfig, load_trace, parse_trace, simulate
from minedraft.operator.autoscale.traces import make_traces

ROOT = Path(__file__).resolve().parents[3]
MODEL = ReplicaModel.load(ROOT / "benchmarks" / "autoscale" / "replica-model.json")
TRACES = ROOT / "benchmarks" / "autoscale" / "traces"
# The diurnal day is 24x longer than the rest: left to `minedraft autoscale compare`.
SHORT = ("step", "ramp", "burst", "acceptance-collapse")


def test_committed_traces_are_what_the_generator_makes() -> None:
    for name, lines in make_traces().items():
        committed = (TRACES / f"{name}.jsonl").read_text()
        assert committed == "".join(json.dumps(line) + "\n" for line in lines), name


def test_committed_replica_model_is_the_calibration_of_the_committed_benchmarks() -> None:
    bench = [ROOT / "benchmarks" / "results" / name for name in MODEL.calibrated_from]
    assert calibrate(bench, MODEL.startup_seconds, speedup=MODEL.speedup, max_batch=MODEL.max_batch,
                     kv_capacity_tokens=MODEL.kv_capacity_tokens,
                     prefill_seconds_per_token=MODEL.prefill_seconds_per_token, assumptions=MODEL.assumptions) == MODEL
    # What the benchmarks do not measure is said to be assumed, with where it came from.
    assert MODEL.kv_capacity_tokens and MODEL.prefill_seconds_per_token > 0
    assert [a.split()[0] for a in MODEL.assumptions] == ["kv_capacity_tokens", "prefill_seconds_per_token"]


@pytest.mark.parametrize("name", SHORT)
@pytest.mark.parametrize("policy", ["minedraft", "hpa-queue"])
def test_replicas_never_leave_the_bounds(name: str, policy: str) -> None:
    trace = load_trace(TRACES / f"{name}.jsonl")
    result = simulate(trace, MODEL, SimConfig(policy=policy, hpa_target_per_pod=12))
    replicas = result.timeline["replicas"]
    assert trace.min_replicas <= min(replicas) and max(replicas) <= trace.max_replicas
    assert all(trace.min_replicas <= d["to"] <= trace.max_replicas for d in result.decisions)


def test_steady_load_changes_direction_at_most_once_per_window() -> None:
    steady = parse_trace("\n".join(json.dumps(r) for r in [
        {"config": {"duration_seconds": 3600, "max_replicas": 20}},
        {"t": 0, "arrival_rps": 45, "prompt_tokens": 256, "output_tokens": 128, "acceptance_rate": 0.6}]), "steady")
    for seed in range(3):
        result = simulate(steady, MODEL, SimConfig(seed=seed, initial_replicas=1))
        directions = [(d["t"], 1 if d["to"] > d["from"] else -1) for d in result.decisions]
        changes = [t for (t, d), (_, before) in zip(directions[1:], directions, strict=False) if d != before]
        for i, t in enumerate(changes):
            assert not any(t < other < t + 300 for other in changes[i + 1:]), (seed, result.decisions)


def test_reacts_to_a_step_within_two_intervals() -> None:
    result = simulate(load_trace(TRACES / "step.jsonl"), MODEL, SimConfig())
    assert result.first_reaction_seconds is not None and result.first_reaction_seconds <= 2 * 15


def test_a_step_is_met_at_the_first_evaluation_after_it() -> None:
    # The step (at a sync) shows in the requests in the system before the averaged rates: scaled up at once.
    result = simulate(load_trace(TRACES / "step.jsonl"), MODEL, SimConfig())
    assert result.first_reaction_seconds == 0, result.decisions[:3]


def test_a_ramp_is_served_within_the_slo() -> None:
    # Planned at 80% of what a full batch gives (not of the slots), replicas keep ahead of a 40-minute ramp.
    result = simulate(load_trace(TRACES / "ramp.jsonl"), MODEL, SimConfig())
    assert result.slo_violation_fraction < 0.001, result.decisions


def test_deterministic_for_a_seed_and_seed_matters() -> None:
    trace = load_trace(TRACES / "burst.jsonl")
    a, b = simulate(trace, MODEL, SimConfig(seed=1)), simulate(trace, MODEL, SimConfig(seed=1))
    assert a.summary() == b.summary() and a.decisions == b.decisions
    assert simulate(trace, MODEL, SimConfig(seed=2)).requests != a.requests


def test_hpa_algorithm_tolerance_missing_pods_and_stabilisation() -> None:
    config = HpaConfig(target_per_pod=10, min_replicas=1, max_replicas=20)
    # Within 10%: no change.
    assert hpa_decide(config, HpaState(), 4, 4, 43, 0)[0] == 4
    # 4 pods at 20 each: ratio 2 -> 8 (limit: +100% or +4).
    assert hpa_decide(config, HpaState(), 4, 4, 80, 0)[0] == 8
    assert hpa_decide(config, HpaState(), 2, 2, 200, 0)[0] == 6  # +4 pods beats +100%
    # 2 of 4 pods still starting count as 0 when scaling up: 60 / 4 = 15 per pod -> 6.
    assert hpa_decide(config, HpaState(), 4, 2, 60, 0)[0] == 6
    # Scale-down takes the highest recommendation of the last 300 s.
    state = HpaState()
    _, _, state = hpa_decide(config, state, 8, 8, 80, 0)
    assert hpa_decide(config, state, 8, 8, 20, 150)[0] == 8
    assert hpa_decide(config, state, 8, 8, 20, 301)[0] == 2


def test_acceptance_collapse_lowers_the_model_capacity() -> None:
    # Where speculation pays (light batches of the memory-bound constructed pair), a collapse costs a replica more
    # than half its tokens/s; at no batch does lower acceptance give more.
    assert MODEL.best(2, 0.1)[0] < 0.5 * MODEL.best(2, 0.9)[0]
    assert all(MODEL.best(b, 0.1)[0] <= MODEL.best(b, 0.9)[0] + 1e-9 for b in range(1, MODEL.max_batch + 1))


def test_acceptance_drop_lowers_capacity_and_scales_up_with_the_replica_model() -> None:
    """Engines with 4 slots each (where this pair's speculation pays), 4 replicas x 3 requests, their predicted
    goodput from the committed model. Acceptance 0.9 -> 0.1 with the same arrivals (the last minute's finished and
    token rates unchanged, nothing queued): the capacity per replica falls and the policy scales up at once."""
    config = PolicyConfig(min_replicas=1, max_replicas=20, requests_per_replica=4, max_scale_up_step=8)
    produced = 4 * MODEL.best(3, 0.9)[0]  # what the 4 replicas decode now, at high acceptance

    def observe(acceptance: float) -> Observations:
        return Observations(age_seconds=1, reporting_replicas=4, running_requests=12, waiting_requests=0,
                            output_tokens_per_second=produced,
                            predicted_tokens_per_second=4 * MODEL.best(3, acceptance)[0],
                            finished_requests_per_second=produced / 128)

    state = PolicyState(last_in_system=(0.0, 12.0))
    steady, _ = decide(config, state, 4, observe(0.9), 15.0)
    collapsed, _ = decide(config, state, 4, observe(0.1), 15.0)
    assert steady.inputs is not None and collapsed.inputs is not None
    assert collapsed.inputs.capacity_tokens_per_second_per_replica < (
        0.6 * steady.inputs.capacity_tokens_per_second_per_replica)
    assert steady.desired == 4 < collapsed.desired and "scale up" in collapsed.reason, (steady, collapsed)


def test_simulate_command_writes_json_and_plot(tmp_path: Path) -> None:
    from minedraft.cli import main

    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["autoscale", "simulate", "--trace", str(TRACES / "step.jsonl"), "--policy", "hpa-queue",
                 "--json", str(out), "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    assert set(data) >= {"replica_seconds", "slo_violation_fraction", "max_queue", "direction_changes", "decisions"}
    assert data["policy"] == "hpa-queue" and data["decisions"] and png.stat().st_size > 10_000


def test_the_fast_path_evaluates_at_an_operator_tick_when_the_queue_grows() -> None:
    """Policy minedraft: a load that jumps at t=17 (between the 15 s and 30 s evaluations) is evaluated at the next
    5 s operator tick, t=20, where the queue has grown since the last evaluation; without the fast path, at t=30."""
    jump = parse_trace("\n".join(json.dumps(r) for r in [
        {"config": {"duration_seconds": 120, "max_replicas": 20, "event_seconds": 17}},
        {"t": 0, "arrival_rps": 2, "prompt_tokens": 256, "output_tokens": 128, "acceptance_rate": 0.6},
        {"t": 17, "arrival_rps": 80, "prompt_tokens": 256, "output_tokens": 512, "acceptance_rate": 0.6}]), "jump")
    fast = simulate(jump, MODEL, SimConfig(initial_replicas=1))
    slow = simulate(jump, MODEL, SimConfig(initial_replicas=1, operator_tick_seconds=None))
    assert fast.first_reaction_seconds == 3.0 and slow.first_reaction_seconds == 13.0
    assert all(d["t"] % 15 == 0 for d in slow.decisions)
    # Never two scale-ups within an interval: the step limit stays one per interval.
    ups = [d["t"] for d in fast.decisions if d["to"] > d["from"]]
    assert ups[0] == 20.0 and all(b - a >= 15 for a, b in itertools.pairwise(ups))
