"""The twin: the engine's own planner, drafter link, wait policy and auto controller on simulated time, with step
and draft times from cost curves. Small synthetic curves for the mechanics; the H200 file for the arithmetic the
measured curves imply (psd/sd at equal concurrency)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from minedraft.engine.control.auto import AutoSettings
from minedraft.twin.costs import AcceptanceModel, Hardware, StepCosts
from minedraft.twin.curves import load_curves, parse_curves
from minedraft.twin.replica import ReplicaSettings, SimRequest, TwinReplica
from minedraft.twin.run import Phase, RunResult, Workload, run_arrivals, run_closed_loop, run_concurrency, run_phases
from minedraft.twin.sweep import SweepSettings, contenders, sweep

H200 = Path(__file__).resolve().parents[2] / "benchmarks" / "curves" / "h200-qwen3-32b.json"
SHORT = Workload(prompt_tokens=1000, output_tokens=48)
# Long outputs: few requests near their end (whose drafts the output budget cuts short) in any step.
LONG = Workload(prompt_tokens=1000, output_tokens=1000, output_spread=0.2)


def flat_curves(verify_ms: float = 20.0, per_token_ms: float = 0.2, draft_ms_per_k: float = 3.0) -> dict[str, Any]:
    """A memory-bound target (flat until batch x tokens reaches verify_ms / per_token_ms) and a cheap drafter."""
    forward = [{"batch": b, "context": 1024, "new_tokens": q, "ms": max(verify_ms, per_token_ms * b * q)}
               for b in (1, 4, 16, 64) for q in (1, 4, 6)]
    loops = [{"batch": b, "context": 1024, "k": k, "ms": k * draft_ms_per_k * (1 + b / 64)}
             for b in (1, 4, 16, 64) for k in (3, 5)]
    return {"format": "minedraft-cost-curves/v1", "models": {
        "t": {"role": "target", "config": {"layers": 10}, "forward_ms": forward},
        "d": {"role": "drafter", "draft_loop_ms": loops}}}


def costs_of(data: dict[str, Any], hardware: Hardware | None = None) -> StepCosts:
    return StepCosts.from_curves(parse_curves(data), "t", "d", hardware or Hardware())


def h200(drafter: str = "qwen3-1.7b") -> StepCosts:
    return StepCosts.from_curves(load_curves(H200), "qwen3-32b", drafter, Hardware())


def test_sd_is_draft_then_verify_and_psd_overlaps_them() -> None:
    costs = costs_of(flat_curves())
    acceptance = AcceptanceModel.constant(0.8)
    sd = run_concurrency(costs, acceptance, "sd", 3, 8, LONG)
    psd = run_concurrency(costs, acceptance, "psd", 3, 8, LONG)
    ar = run_concurrency(costs, acceptance, "ar", 0, 8, LONG)
    tokens = 8 * acceptance.expected_accepted_length(3)
    sd_cycle_s = (costs.draft_ms(8, 1024, 3) + costs.verify_ms(8, 1024, 4)) / 1000
    psd_cycle_s = 2 * max(costs.draft_ms(4, 1024, 3), costs.verify_ms(4, 1024, 4)) / 1000
    assert sd.tokens_per_s == pytest.approx(tokens / sd_cycle_s, rel=0.06)
    assert psd.tokens_per_s == pytest.approx(tokens / psd_cycle_s, rel=0.06)
    assert ar.tokens_per_s == pytest.approx(8 / (costs.verify_ms(8, 1024, 1) / 1000), rel=0.03)
    # Flat verification: psd verifies each half at a full step's cost, so it loses to sd here.
    assert psd.tokens_per_s < sd.tokens_per_s
    assert (sd.gpus, psd.gpus, ar.gpus) == (2, 2, 1)
    assert sd.deadline_misses == psd.deadline_misses == 0


def test_vllm_colocated_sd_costs_what_sd_costs_on_one_gpu_fewer() -> None:
    costs = costs_of(flat_curves())
    acceptance = AcceptanceModel.constant(0.7)
    sd = run_concurrency(costs, acceptance, "sd", 3, 8, SHORT)
    colocated = run_concurrency(costs, acceptance, "vllm-sd", 3, 8, SHORT)
    assert colocated.mode == "vllm-sd-k3"
    assert colocated.tokens_per_s == pytest.approx(sd.tokens_per_s, rel=0.05)
    assert colocated.tokens_per_s_per_gpu == pytest.approx(2 * sd.tokens_per_s_per_gpu, rel=0.05)


def test_a_drafter_sharing_the_targets_gpu_loses_the_overlap() -> None:
    data = flat_curves()
    acceptance = AcceptanceModel.constant(0.8)
    own = run_concurrency(costs_of(data), acceptance, "psd", 3, 16, SHORT)
    shared = run_concurrency(costs_of(data, Hardware(drafter_placement="shared")), acceptance, "psd", 3, 16, SHORT)
    free = run_concurrency(costs_of(data, Hardware(drafter_placement="shared", shared_contention=0.0)), acceptance,
                           "psd", 3, 16, SHORT)
    assert shared.tokens_per_s < 0.9 * own.tokens_per_s
    assert free.tokens_per_s == pytest.approx(own.tokens_per_s, rel=0.03)
    assert (own.gpus, shared.gpus) == (2, 1)


def test_tensor_parallel_model_divides_the_forward_and_adds_all_reduces_per_layer() -> None:
    single = costs_of(flat_curves())
    tp4 = costs_of(flat_curves(), Hardware(tensor_parallel_size=4, all_reduce_us_per_layer=30.0))
    assert tp4.verify_ms(8, 1024, 4) == pytest.approx(single.verify_ms(8, 1024, 4) / 4 + 10 * 0.030)
    assert tp4.draft_ms(8, 1024, 3) == single.draft_ms(8, 1024, 3)  # a drafter on its own GPU is not split
    assert tp4.gpus("psd-k3") == 5 and tp4.gpus("vllm-sd-k3") == 4 and tp4.gpus("ar") == 4


def test_the_engines_invariants_hold_through_switches_and_steps_record_only_their_own_draft_job() -> None:
    costs = costs_of(flat_curves())
    replica = TwinReplica(costs, AcceptanceModel.constant(0.8),
                          ReplicaSettings(mode="auto", k=3, check_invariants=True,
                                          auto=AutoSettings(k_candidates=(1, 3, 5))))
    for i in range(32):
        replica.add(SimRequest(f"r{i}", 64, 100 + 10 * i, 0.0))
    while replica.requests or replica.waiting:
        replica.step()
        if replica.step_number > 5000:
            raise AssertionError("the twin did not finish its requests")
    assert len({(d.mode, d.k) for d in replica.decisions}) >= 2, "auto never switched: the test proves nothing"
    # A step's draft_seconds is the job whose drafts it verified, never the other sub-batch's arriving beside it.
    longest_job_s = costs.draft_ms(32, 2048, 5) / 1000
    assert max(r.draft_seconds for r in replica.records) <= longest_job_s


def test_a_drafter_whose_job_times_spread_misses_budgets_and_costs_throughput_at_the_same_mean_time() -> None:
    # The engine's sd at 16 on a loaded CPU: its drafter's jobs of one shape took 0.5-3x their median. The twin draws
    # each job's time from such a spread (mean 1 here: the same drafting on average) and runs the engine's wait
    # policy and drafter link on it: jobs past the budget are abandoned and the next job queues behind the one the
    # drafter is still finishing, so steps go without drafts that the spread-free twin drafts, and throughput drops.
    data = flat_curves(draft_ms_per_k=5.0)
    data["models"]["d"]["catch_up_ms_per_token"] = 0.03
    workload = Workload(prompt_tokens=100, output_tokens=64, output_spread=0.0)
    acceptance = AcceptanceModel.constant(0.8)
    steady = run_closed_loop(costs_of(data), acceptance, "sd", 3, 16, 128, workload)
    spread = (0.6, 0.8, 1.0, 1.0, 1.6)
    jittery = run_closed_loop(costs_of(data, Hardware(drafter_time_spread=spread)), acceptance, "sd", 3, 16, 128,
                              workload)
    assert steady.deadline_misses <= 2
    assert jittery.deadline_misses >= 5 * max(1, steady.deadline_misses)
    assert jittery.tokens_per_s < 0.97 * steady.tokens_per_s
    # A drafter that stalls now and then: the policy tried in the twin (no job sent while the drafter finishes an
    # abandoned one) keeps steps from waiting whole budgets for jobs queued behind it.
    stalls = costs_of(data, Hardware(drafter_time_spread=(0.5, 0.8, 0.9, 1.0, 1.0, 1.0, 1.1, 1.3, 2.0, 30.0)))
    queued, held = (run_closed_loop(stalls, acceptance, "sd", 3, 16, 128, workload, hold_jobs_behind_abandoned=hold)
                    for hold in (False, True))
    assert held.deadline_misses < queued.deadline_misses and held.tokens_per_s > 1.1 * queued.tokens_per_s
    with pytest.raises(ValueError, match="drafter_time_spread"):
        Hardware(drafter_time_spread=(1.0, 0.0))


def test_an_abandoned_job_the_drafter_has_not_started_is_dropped_and_the_next_moves_up() -> None:
    # As the drafter process does on CancelJobs: a started job runs on (its reply goes nowhere), a queued one is
    # dropped, so a run of late jobs does not pile up behind the one the drafter is still finishing.
    from minedraft.engine.drafter import protocol
    from minedraft.twin.replica import SimClock, SimDrafter

    clock = SimClock()
    drafter = SimDrafter(clock, costs_of(flat_curves()), colocated=False)
    items = [protocol.DraftItem(f"r{i}", [1], 3) for i in range(4)]
    first, second, third = (drafter.submit(items, False) for _ in range(3))
    assert first is not None and second is not None and third is not None
    job_s = drafter.jobs[0].end - drafter.jobs[0].start
    clock.now = 0.5 * job_s  # the first job is running, the other two queued behind it
    drafter.cancel_jobs([first.job_id, second.job_id])
    assert [job.job_id for job in drafter.jobs] == [first.job_id, third.job_id]
    assert drafter.jobs[1].start == pytest.approx(job_s) and drafter.free_at == pytest.approx(2 * job_s)
    assert drafter.busy_seconds == pytest.approx(2 * job_s)


def test_arrivals_open_loop_and_phases_finish_with_latencies() -> None:
    costs = costs_of(flat_curves())
    acceptance = AcceptanceModel.constant(0.8)
    arrivals = [(0.05 * i, 100, 20) for i in range(30)]
    result = run_arrivals(costs, acceptance, "psd", 3, arrivals)
    assert result.tokens == 30 * 20 and len(result.ttft_s) == 30 and len(result.tpot_s) == 30
    summary = result.summary()
    assert summary["ttft_ms_p50"] is not None and summary["tpot_ms_p99"] >= summary["tpot_ms_p50"]
    phases = run_phases(costs, acceptance, "sd", 3, [Phase(2, 2.0), Phase(16, 2.0)], SHORT)
    assert phases.seconds >= 4.0 and phases.tokens > 0


def test_acceptance_model_parses_the_engines_per_position_rates() -> None:
    assert AcceptanceModel.parse("0.5").survival[:3] == (0.5, 0.25, 0.125)
    model = AcceptanceModel.parse("0.8,0.6")
    assert model.at(2) == pytest.approx(0.45)  # the last conditional rate (0.75) continues
    assert model.expected_accepted_length(2) == pytest.approx(2.4)
    with pytest.raises(ValueError, match="exceeds"):
        AcceptanceModel((0.5, 0.6))


# The README's arithmetic on the H200 curves: at equal total concurrency C, sd costs t(C) + V(C) per step and psd
# 2 max(t(C/2), V(C/2)) for the same tokens (equal acceptance). The twin, running the engine's own code, must land
# within 10% of what the curves imply (0.70 at C <= 8 ... 1.15 at 128 for k=3; 1.16 at 32 and 1.23 at 128 for k=5).
@pytest.mark.parametrize(("concurrency", "k"), [(8, 3), (16, 3), (32, 3), (64, 3), (128, 3), (32, 5), (128, 5)])
def test_psd_over_sd_on_the_h200_curves_matches_the_arithmetic(concurrency: int, k: int) -> None:
    costs = h200()
    acceptance = AcceptanceModel.constant(0.8)
    context = SHORT.prompt_tokens + SHORT.output_tokens / 2
    half = concurrency / 2
    expected = ((costs.draft_ms(concurrency, context, k) + costs.verify_ms(concurrency, context, k + 1))
                / (2 * max(costs.draft_ms(half, context, k), costs.verify_ms(half, context, k + 1))))
    sd = run_concurrency(costs, acceptance, "sd", k, concurrency, SHORT, min_measure_tokens=4000)
    psd = run_concurrency(costs, acceptance, "psd", k, concurrency, SHORT, min_measure_tokens=4000)
    assert psd.tokens_per_s / sd.tokens_per_s == pytest.approx(expected, rel=0.10)


def test_h200_file_is_the_measured_one() -> None:
    data = json.loads(H200.read_text())
    assert data["device"].startswith("NVIDIA H200") and data["execution"] == "CUDA graphs"


def test_an_oracle_schedule_runs_each_phase_in_its_setting_and_beats_each_fixed_one_on_a_two_load_trace() -> None:
    costs = costs_of(flat_curves())
    acceptance = AcceptanceModel.constant(0.8)
    phases = [Phase(2, 2.0), Phase(64, 2.0)]
    schedule = [("sd", 5), ("ar", 0)]
    oracle = run_phases(costs, acceptance, "ar", 0, phases, SHORT, schedule=schedule)
    assert oracle.mode == "oracle"
    assert set(oracle.steps_by_setting) == {"sd-k5", "ar"}
    sd = run_phases(costs, acceptance, "sd", 5, phases, SHORT)
    ar = run_phases(costs, acceptance, "ar", 0, phases, SHORT)
    assert oracle.tokens_per_s > max(sd.tokens_per_s, ar.tokens_per_s)
    with pytest.raises(ValueError, match="schedule"):
        run_phases(costs, acceptance, "ar", 0, phases, SHORT, schedule=schedule[:1])


def test_a_closed_loop_of_n_requests_counts_every_token_and_its_drain() -> None:
    costs = costs_of(flat_curves())
    acceptance = AcceptanceModel.constant(0.8)
    fixed = Workload(prompt_tokens=100, output_tokens=20, output_spread=0.0)
    result = run_closed_loop(costs, acceptance, "ar", 0, 4, 10, fixed)
    assert result.tokens == 10 * 20 and len(result.ttft_s) == 10
    # ar, flat verification: waves of 4, 4 and 2 requests, each a prefill step then 19 decode steps.
    step_s = costs.verify_ms(4, 100, 1) / 1000
    assert result.seconds == pytest.approx(3 * 20 * step_s, rel=0.01)
    with pytest.raises(ValueError, match="concurrency"):
        run_closed_loop(costs, acceptance, "ar", 0, 0, 10, fixed)


def test_host_work_per_step_follows_the_requests_in_the_step_when_measured_by_batch() -> None:
    hardware = Hardware(step_overhead_ms=100.0, step_overhead_ms_by_batch=((1, 1.0), (8, 8.0)),
                        drafting_step_overhead_ms_by_batch=((1, 2.0), (8, 16.0)))
    costs = costs_of(flat_curves(), hardware)
    assert costs.step_overhead_ms(4, drafting=False) == pytest.approx(4.0)
    assert costs.step_overhead_ms(4, drafting=True) == pytest.approx(8.0)
    assert costs.step_overhead_ms(64, drafting=False) == pytest.approx(8.0)  # flat beyond the measured batches
    ar = run_concurrency(costs, AcceptanceModel.constant(0.8), "ar", 0, 4, LONG)
    assert ar.tokens_per_s == pytest.approx(4 / ((costs.verify_ms(4, 1024, 1) + 4.0) / 1000), rel=0.03)


def test_the_twin_handles_a_drafters_errors_as_the_engine_does() -> None:
    """The twin drives the engine's core, so a failed draft job is handled there (it used to be ignored): a request
    named as the culprit is quarantined and decodes without drafts, the error is counted, the drafter is not
    restarted, and the rest keep their drafts."""
    from minedraft.engine.drafter import protocol
    from minedraft.twin.replica import SimClock, SimDrafter

    class FailingOnce(SimDrafter):
        def submit(self, items, want_logprobs):  # type: ignore[no-untyped-def]
            ticket = super().submit(items, want_logprobs)
            ids = [item.request_id for item in items if item.num_draft_tokens]
            if ticket is not None and ticket.job_id == 3 and ids:
                job = self.jobs[-1]
                job.reply = protocol.DrafterError(job.job_id, "bad context", [ids[0]])  # type: ignore[assignment]
                self.culprit = ids[0]
            return ticket

    drafters: list[FailingOnce] = []

    def make(clock: SimClock) -> SimDrafter:
        drafters.append(FailingOnce(clock, costs_of(flat_curves()), colocated=False))
        return drafters[0]

    replica = TwinReplica(costs_of(flat_curves()), AcceptanceModel.constant(0.7),
                          ReplicaSettings(mode="psd", k=3, check_invariants=True), drafter=make)
    for i in range(4):
        replica.add(SimRequest(f"r{i}", 100, 200, 0.0))
    for _ in range(30):
        replica.step()
    culprit = drafters[0].culprit
    assert replica.core.planner.quarantined == {culprit}
    assert replica.core.stats.totals().drafter_errors == 1
    later = replica.records[-10:]
    assert all(r.num_requests_with_drafts > 0 for r in later if r.num_decode_requests > 1), "the others lost drafts"


def _result(mode: str, k: int, tokens_per_s: float) -> RunResult:
    return RunResult(mode, k, gpus=1, tokens=int(tokens_per_s), seconds=1.0)


def test_contenders_are_each_familys_runs_within_the_share_of_its_best() -> None:
    runs = {"ar": _result("ar", 0, 50), "sd-k3": _result("sd", 3, 100), "sd-k5": _result("sd", 5, 98),
            "sd-k1": _result("sd", 1, 90), "lookahead-k2": _result("lookahead", 2, 120),
            "vllm-sd-k3": _result("vllm-sd", 3, 70), "vllm-sd-k5": _result("vllm-sd", 5, 66)}
    assert contenders(runs, 0.03) == ["ar", "sd-k3", "sd-k5", "lookahead-k2", "vllm-sd-k3"]
    assert contenders(runs, 0.0) == ["ar", "sd-k3", "lookahead-k2", "vllm-sd-k3"]


def test_a_confirming_sweep_measures_the_contenders_again_over_autos_window_and_only_them() -> None:
    costs = costs_of(flat_curves())
    acceptance = AcceptanceModel.constant(0.7)
    base = SweepSettings(concurrencies=(4,), ks=(1, 3, 5), families=("ar", "sd"), with_auto=False,
                         workload=SHORT, warmup_steps=5, measure_steps=20, auto_warmup_steps=5,
                         auto_measure_steps=4000)
    short, = sweep(costs, acceptance, base, progress=None)
    confirmed, = sweep(costs, acceptance, dataclasses.replace(base, confirm=True), progress=None)
    again = set(contenders(short.runs, base.confirm_within))
    assert "ar" in again and again != set(short.runs)
    for label, run in confirmed.runs.items():
        if label in again:  # 4,000 steps at 4 requests: at least twice the 8,000 tokens a short window runs to
            assert run.tokens >= 1.5 * short.runs[label].tokens, label
        else:
            assert run.tokens == short.runs[label].tokens, label
