"""The generated family, the oracle, the policy's properties over a subsample of the family, and scale to zero and
back in the simulator (the simulator only: seconds, no engines)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from minedraft.operator.autoscale.bench import at_equal_violations, bench, markdown
from minedraft.operator.autoscale.family import (
    FAMILY_SIZE,
    MAX_RPS,
    MAX_TOKENS,
    MIN_RPS,
    MIN_TOKENS,
    SHAPES,
    check_properties,
    full_capacity,
    make_family,
    make_member,
    oracle,
    requirement,
    subsample,
)
from minedraft.operator.autoscale.hpa import SCALE_UP_PERCENT
from minedraft.operator.autoscale.replica_model import ReplicaModel
from minedraft.operator.autoscale.simulate import SimConfig, SimResult, Trace, parse_trace, simulate

ROOT = Path(__file__).resolve().parents[3]
MODEL = ReplicaModel.load(ROOT / "benchmarks" / "autoscale" / "replica-model.json")
# Three members of each shape, drawn by a seeded generator without looking at any result (the bench command,
# `minedraft autoscale bench`, checks the properties on all of the family and reports every failure).
SUBSAMPLE_PER_SHAPE = 3
SUBSAMPLE = subsample(FAMILY_SIZE, SUBSAMPLE_PER_SHAPE, seed=0)
# Members of the seed-0 family on which a property fails in the bench (all 210, before prompts were priced), with
# why. Each is tested here as an expected failure (strict: a fix shows as an unexpected pass), whether or not the
# draw above chose it; every other member tested must pass. Member 101 (a one-minute burst of 6125-token requests)
# passes since prompts cost prefill and KV: its replicas are now needed, and tested as a regular member.
ONCE_PER_WINDOW = ("scale-down happens at most once per stabilisation window: the first step down went to the need "
                   "the window still remembered, the next waited a whole window, and the replicas stayed above the "
                   "oracle's bound ")
KNOWN_PROPERTY_FAILURES: dict[int, str] = {
    166: "load stopped for a quiet period after running 52 replicas; " + ONCE_PER_WINDOW + "5 s past the window",
}
PROPERTY_MEMBERS = sorted({*SUBSAMPLE, 101, *KNOWN_PROPERTY_FAILURES})


def test_the_family_spans_the_ranges_of_the_issue() -> None:
    family = make_family(MODEL)
    assert len(family) >= 200
    rates = [r.arrival_rps for t in family for r in t.rows]
    outputs = [t.rows[0].output_tokens for t in family]
    prompts = [t.rows[0].prompt_tokens for t in family]
    acceptances = [r.acceptance_rate for t in family for r in t.rows]
    assert min(rates) >= 0 and max(rates) <= MAX_RPS
    # Peaks from near the lowest to near the highest rate; lengths and acceptance over their whole ranges.
    peaks = [max(r.arrival_rps for r in t.rows) for t in family]
    assert min(peaks) < 2 * MIN_RPS and max(peaks) > MAX_RPS / 2
    assert min(prompts) < 2 * MIN_TOKENS and max(prompts) > MAX_TOKENS / 2
    assert min(outputs) < 2 * MIN_TOKENS and max(outputs) > MAX_TOKENS / 4
    assert 0.2 <= min(acceptances) < 0.25 and 0.85 < max(acceptances) <= 0.9
    # Every shape; collapses (acceptance changing within a trace) and quiet periods (no arrivals) occur.
    assert {t.name.rsplit("-", 1)[1] for t in family} == set(SHAPES)
    assert sum(1 for t in family if len({r.acceptance_rate for r in t.rows}) > 1) > len(family) // 3
    assert any(r.arrival_rps == 0 for t in family for r in t.rows)


def test_the_family_is_seeded_and_a_member_does_not_depend_on_the_others() -> None:
    assert make_member(37, 0, MODEL) == make_family(MODEL, indices=[37])[0] == make_family(MODEL)[37]
    assert make_member(37, 1, MODEL) != make_member(37, 0, MODEL)


def _brute_force(need: list[int], startup: int) -> float:
    """Least cost over every count sequence m >= need (m at -1 = need[0], free): sum of m + startup per increase."""
    top = max(need)
    best: dict[int, float] = {need[0]: 0.0}
    for n in need:
        step: dict[int, float] = {}
        for m in range(n, top + 1):
            step[m] = m + min(cost + startup * max(0, m - prev) for prev, cost in best.items())
        best = step
    return min(best.values())


def test_the_oracle_is_the_least_cost_schedule() -> None:
    """Exact against a brute-force search over every schedule, on small random requirements."""
    rng = random.Random(5)
    for _ in range(40):
        need = [rng.choice((0, 1, 1, 2, 3)) for _ in range(rng.randint(5, 30))]
        startup = rng.randint(1, 6)
        assert oracle(need, startup).replica_seconds == pytest.approx(_brute_force(need, startup)), (need, startup)
    # A dip shorter than a startup is bridged; a longer one is not.
    assert oracle([2, 2, 1, 2, 2], 3).ready == (2, 2, 2, 2, 2)
    assert oracle([2, 1, 1, 1, 1, 2], 3).ready == (2, 1, 1, 1, 1, 2)
    assert oracle([2, 1, 1, 1, 1, 2], 3).existing == (2, 1, 2, 2, 2, 2)  # started 3 s ahead, costing from then
    # Level 1: 6 s; level 2: its first second (there at the start) and its last plus a startup.
    schedule = oracle([2, 1, 1, 1, 1, 2], 3)
    assert schedule.replica_seconds == 6 + 1 + (1 + 3) == sum(schedule.existing)


def test_the_oracle_requirement_follows_load_and_acceptance() -> None:
    trace = parse_trace("\n".join(json.dumps(r) for r in [
        {"config": {"duration_seconds": 30, "max_replicas": 50}},
        {"t": 0, "arrival_rps": 10, "prompt_tokens": 64, "output_tokens": 1000, "acceptance_rate": 0.9},
        {"t": 10, "arrival_rps": 10, "prompt_tokens": 64, "output_tokens": 1000, "acceptance_rate": 0.2},
        {"t": 20, "arrival_rps": 0, "prompt_tokens": 64, "output_tokens": 1000, "acceptance_rate": 0.2}]), "t")
    need = requirement(trace, MODEL)
    capacity = {a: max(MODEL.best(c, a)[0] for c in range(1, MODEL.max_batch + 1)) for a in (0.9, 0.2)}
    assert need[0] == math.ceil(10_000 / capacity[0.9]) and need[10] == math.ceil(10_000 / capacity[0.2])
    assert need[10] >= need[0] and need[25] == trace.min_replicas


Run = tuple[Trace, list[int], SimConfig, SimResult]


def _run(index: int) -> Run:
    trace = make_member(index, 0, MODEL)
    config = SimConfig(policy="minedraft")
    return trace, requirement(trace, MODEL), config, simulate(trace, MODEL, config)


@pytest.fixture(scope="module")
def member_runs() -> dict[int, Run]:
    return {i: _run(i) for i in PROPERTY_MEMBERS}


@pytest.fixture(scope="module")
def subsample_runs(member_runs: dict[int, Run]) -> list[Run]:
    return [member_runs[i] for i in SUBSAMPLE]


@pytest.mark.parametrize("index", [
    pytest.param(i, id=f"member-{i:03d}", marks=[pytest.mark.xfail(reason=KNOWN_PROPERTY_FAILURES[i], strict=True)]
                 if i in KNOWN_PROPERTY_FAILURES else [])
    for i in PROPERTY_MEMBERS])
def test_properties_hold_on_the_family_subsample(member_runs: dict[int, Run], index: int) -> None:
    """Within bounds always; never above the oracle (at the target utilisation) by more than one decision's step for
    longer than the stabilisation window; no scale-up with clearly spare capacity and no queue; no scale-down while
    a queue grows (definitions in family.check_properties)."""
    trace, need, config, result = member_runs[index]
    report = check_properties(result, trace, MODEL, need, target_utilization=config.target_utilization,
                              step=config.max_scale_up_step, interval_seconds=config.interval_seconds,
                              stabilization_seconds=config.scale_down_stabilization_seconds,
                              step_percent=SCALE_UP_PERCENT)
    assert report.ok, (trace.name, trace.description, report.to_json())


def test_a_light_load_that_is_often_idle_is_not_scaled_up(subsample_runs: list[Run]) -> None:
    """Issue 19's light loads: at most half of one replica's full-batch capacity all along (the properties' "clearly
    spare"), minedraft stays at its minimum. (A load needing one replica at full batch can need two at the target
    utilisation: family-0-140, at 80% of a replica, is not light.)"""
    def light_load(trace: Trace) -> bool:
        return all(r.arrival_rps * r.output_tokens <= 0.5 * full_capacity(MODEL, r.acceptance_rate)
                   for r in trace.rows)

    light = [(trace, result) for trace, _, _, result in subsample_runs if light_load(trace)]
    assert len(light) >= 3
    for trace, result in light:
        assert max(result.timeline["replicas"]) == trace.min_replicas, (trace.name, result.decisions[:3])


def test_bench_reports_the_three_policies_side_by_side(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "steady.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"config": {"duration_seconds": 600, "max_replicas": 10}},
        {"t": 0, "arrival_rps": 20, "prompt_tokens": 64, "output_tokens": 128, "acceptance_rate": 0.6}]) + "\n")
    summary = bench(ROOT / "benchmarks" / "autoscale" / "replica-model.json", traces, indices=[1],
                    hpa_targets=(8.0, 16.0), workers=1)
    assert summary["variants"][:3] == ["oracle", "minedraft", "hpa-queue"]
    for group, size in (("family", 1), ("committed", 1)):
        overall = summary["groups"][group]["overall"]
        assert len(summary["groups"][group]["traces"]) == size
        assert overall["oracle"]["ratio_to_oracle"] == pytest.approx(1.0, abs=0.02)
        assert overall["minedraft"]["ratio_to_oracle"] >= 1.0
    text = markdown(summary, "minedraft autoscale bench --out x")
    assert "## family" in text and "## committed" in text and "hpa-queue" in text
    # minedraft's utilisation is swept like the HPA's target: the default's row is the default run's figures.
    sweep = {m["target_utilization"]: m for m in summary["minedraft_sweep"]}
    assert set(sweep) == {0.8, 0.7, 0.6, 0.5, 0.4}
    assert sweep[0.8]["replica_seconds"] == summary["groups"]["family"]["overall"]["minedraft"]["replica_seconds"]
    assert sweep[0.4]["replica_seconds"] >= sweep[0.8]["replica_seconds"], "more headroom costs replicas"
    assert "target-utilisation sweep" in text and "At equal SLO violations" in text


def test_at_equal_violations_picks_the_cheapest_utilisation_no_worse_than_the_hpa() -> None:
    sweep = [{"target_utilization": 0.8, "replica_seconds": 100.0, "slo_violation_fraction": 0.03},
             {"target_utilization": 0.6, "replica_seconds": 130.0, "slo_violation_fraction": 0.015},
             {"target_utilization": 0.4, "replica_seconds": 170.0, "slo_violation_fraction": 0.01}]
    hpa = {"target": 2.0, "replica_seconds": 200.0, "slo_violation_fraction": 0.015}
    eq = at_equal_violations(sweep, hpa)
    assert eq is not None and eq["target_utilization"] == 0.6
    assert eq["fewer_replica_seconds_fraction"] == pytest.approx(0.35)
    assert at_equal_violations(sweep, {**hpa, "slo_violation_fraction": 0.005}) is None


# -- scale to zero and back, in the simulator --------------------------------------------------------------------

ZERO = parse_trace("\n".join(json.dumps(r) for r in [
    {"config": {"duration_seconds": 1800, "min_replicas": 0, "max_replicas": 10}},
    {"t": 0, "arrival_rps": 10, "prompt_tokens": 64, "output_tokens": 128, "acceptance_rate": 0.6},
    {"t": 300, "arrival_rps": 0, "prompt_tokens": 64, "output_tokens": 128, "acceptance_rate": 0.6},
    {"t": 1200, "arrival_rps": 10, "prompt_tokens": 64, "output_tokens": 128, "acceptance_rate": 0.6}]), "zero")


def test_scale_to_zero_after_an_idle_window_and_back_on_the_first_waiting_request() -> None:
    result = simulate(ZERO, MODEL, SimConfig(policy="minedraft"))
    replicas, ready, queue = result.timeline["replicas"], result.timeline["ready"], result.timeline["queue"]
    # Idle from 300 s: zero replicas once a whole stabilisation window has seen no load, well before 1200 s.
    went_to_zero = next(i for i, r in enumerate(replicas) if r == 0)
    assert 300 + 300 <= went_to_zero < 1200
    assert all(r == 0 for r in replicas[went_to_zero:1200])
    # Load again at 1200 s: the first arrival waits; the scale-up from zero follows in the same second (not at the
    # next 15 s evaluation), and the replica serves a startup later.
    first_wait = next(i for i in range(1200, 1800) if queue[i] > 0)
    woke = next(d for d in result.decisions if d["from"] == 0)
    assert woke["t"] == first_wait and woke["to"] == 1 and "waiting" in woke["reason"]
    assert ready[first_wait + int(MODEL.startup_seconds)] >= 1
    # Every request is served by the end (nothing left queued). The violations are the cold start's: requests that
    # arrived while the first replica started, and the backlog they left; within a stabilisation window after the
    # wake every admitted request meets the SLO again, and before the idle period none missed it.
    assert queue[-1] == 0 and result.slo_violation_fraction > 0
    worst = result.timeline["ttft_p_max"]
    assert max(worst[:300]) <= ZERO.slo_ttft_seconds
    assert max(worst[first_wait + 300:]) <= ZERO.slo_ttft_seconds


def test_min_replicas_one_never_goes_to_zero() -> None:
    result = simulate(replace(ZERO, min_replicas=1), MODEL, SimConfig(policy="minedraft"))
    assert min(result.timeline["replicas"]) == 1 and not any(d["from"] == 0 for d in result.decisions)


def test_subsample_is_seeded_and_stratified_by_shape() -> None:
    shapes = [make_member(i, 0, MODEL).name.rsplit("-", 1)[1] for i in SUBSAMPLE]
    assert {shape: shapes.count(shape) for shape in SHAPES} == dict.fromkeys(SHAPES, SUBSAMPLE_PER_SHAPE)
    assert len(SUBSAMPLE) == len(set(SUBSAMPLE)) and all(0 <= i < FAMILY_SIZE for i in SUBSAMPLE)
    # The same draw every time (the seed, not the results, chooses it); another seed draws other members.
    assert subsample(FAMILY_SIZE, SUBSAMPLE_PER_SHAPE, seed=0) == SUBSAMPLE
    assert subsample(FAMILY_SIZE, SUBSAMPLE_PER_SHAPE, seed=1) != SUBSAMPLE


def test_known_property_failures_are_members_with_a_reason() -> None:
    assert all(0 <= i < FAMILY_SIZE and len(why) > 20 for i, why in KNOWN_PROPERTY_FAILURES.items())
