"""Host work per step in the twin: the engine's synchronous steps pay it in series with the forward pass (and with
sd's drafting); plain vLLM (vllm-ar) and vLLM's colocated SD hide it behind the device with async scheduling, and so
does psd with async steps where the engine runs them. Small synthetic curves: every number is arithmetic."""

from __future__ import annotations

import pytest

from minedraft.twin.costs import AcceptanceModel, Hardware, StepCosts
from minedraft.twin.curves import parse_curves
from minedraft.twin.run import RunResult, Workload, run_concurrency

# Long outputs, so that few requests finish (and arrive as prompts) in any step.
LONG = Workload(prompt_tokens=1000, output_tokens=1000, output_spread=0.2)
FORWARD_MS = 20.0
ACCEPTANCE = AcceptanceModel.constant(0.8)


def flat_costs(host_ms: float, **hardware: object) -> StepCosts:
    """A target whose forward costs FORWARD_MS at every shape measured here, and a drafter of 3 ms per token."""
    forward = [{"batch": b, "context": 1024, "new_tokens": q, "ms": FORWARD_MS} for b in (1, 4, 16, 64)
               for q in (1, 4)]
    loops = [{"batch": b, "context": 1024, "k": k, "ms": 3.0 * k} for b in (1, 4, 16, 64) for k in (3, 5)]
    data = {"format": "minedraft-cost-curves/v1", "models": {
        "t": {"role": "target", "config": {"layers": 10}, "forward_ms": forward},
        "d": {"role": "drafter", "draft_loop_ms": loops}}}
    return StepCosts.from_curves(parse_curves(data), "t", "d", Hardware(step_overhead_ms=host_ms, **hardware))


def run(costs: StepCosts, mode: str, concurrency: int = 8, k: int = 3) -> RunResult:
    return run_concurrency(costs, ACCEPTANCE, mode, k, concurrency, LONG)


def measured_steps(result: RunResult) -> int:
    return sum(result.steps_by_mode.values()) - 40  # run_concurrency's warm-up steps


def test_vllm_ar_beats_the_engines_ar_by_exactly_the_host_share() -> None:
    costs = flat_costs(host_ms=4.0)
    ar, vllm_ar = run(costs, "ar"), run(costs, "vllm-ar")
    # The same steps and tokens (plain decoding draws nothing at random); only each step's length differs.
    assert ar.tokens == vllm_ar.tokens
    assert vllm_ar.tokens_per_s / ar.tokens_per_s == pytest.approx((FORWARD_MS + 4.0) / FORWARD_MS, rel=1e-9)
    # Hidden entirely: plain vLLM with host work runs as the engine's ar would with none.
    assert vllm_ar.tokens_per_s == pytest.approx(run(flat_costs(host_ms=0.0), "ar").tokens_per_s, rel=1e-9)
    assert (ar.mode, ar.gpus, vllm_ar.mode, vllm_ar.gpus, vllm_ar.k) == ("ar", 1, "vllm-ar", 1, 0)


def test_host_work_longer_than_the_forward_sets_vllm_ars_pace() -> None:
    # Overlapped, a step costs max(host, forward), not the sum: 30 ms here, against 50 ms in the engine's ar.
    costs = flat_costs(host_ms=30.0)
    ar, vllm_ar = run(costs, "ar"), run(costs, "vllm-ar")
    assert vllm_ar.tokens_per_s / ar.tokens_per_s == pytest.approx(50.0 / 30.0, rel=1e-9)
    assert vllm_ar.tokens_per_s == pytest.approx(8 / 0.030, rel=0.02)  # 8 requests, one token each per step


def test_without_async_scheduling_vllm_ar_is_the_engines_ar() -> None:
    # vLLM turns async scheduling off on CPUs: there plain vLLM pays host work in series too.
    costs = flat_costs(host_ms=4.0, vllm_async_scheduling=False)
    assert run(costs, "vllm-ar").tokens_per_s == pytest.approx(run(costs, "ar").tokens_per_s, rel=1e-9)


def test_sd_pays_host_work_in_series_with_the_forward_and_the_drafting() -> None:
    # The next draft job goes out only after the step's host work, and the next verification waits for it: the
    # drafter's device is idle during host work too, so each sd step grows by the whole host cost.
    free, costly = run(flat_costs(host_ms=0.0), "sd"), run(flat_costs(host_ms=4.0), "sd")
    assert costly.tokens == free.tokens and measured_steps(costly) == measured_steps(free)
    assert (costly.seconds - free.seconds) / measured_steps(costly) == pytest.approx(0.004, rel=1e-6)


def test_psd_with_async_steps_hides_host_work_where_the_engine_runs_them() -> None:
    free = run(flat_costs(host_ms=0.0), "psd")
    costs = flat_costs(host_ms=4.0)
    sync, overlapped = run(costs, "psd"), run(costs, "psd-async")
    assert overlapped.mode == "psd-async-k3" and overlapped.gpus == 2
    assert overlapped.tokens_per_s == pytest.approx(free.tokens_per_s, rel=1e-9)
    assert sync.tokens_per_s < 0.9 * overlapped.tokens_per_s
    # The engine schedules psd steps ahead only at TP = 1: beyond, psd-async is psd.
    tp2 = flat_costs(host_ms=4.0, tensor_parallel_size=2)
    assert run(tp2, "psd-async").tokens_per_s == pytest.approx(run(tp2, "psd").tokens_per_s, rel=1e-9)


def test_vllms_colocated_sd_hides_host_work_behind_its_draft_and_verify() -> None:
    hidden = run(flat_costs(host_ms=4.0), "vllm-sd")
    assert hidden.tokens_per_s == pytest.approx(run(flat_costs(host_ms=0.0), "vllm-sd").tokens_per_s, rel=1e-9)
    serial = run(flat_costs(host_ms=4.0, vllm_async_scheduling=False), "vllm-sd")
    assert serial.tokens_per_s < 0.95 * hidden.tokens_per_s


def test_auto_runs_the_engines_synchronous_steps() -> None:
    # Auto's decisions read each step's timings as its own, so the engine never schedules its steps ahead: with
    # host work it cannot reach plain vLLM where plain decoding is what pays (a drafter too slow to help).
    slow = flat_costs(host_ms=4.0)
    auto = run_concurrency(slow, AcceptanceModel.constant(0.05), "auto", 0, 8, LONG, warmup_steps=300,
                           measure_steps=600)
    vllm_ar = run_concurrency(slow, AcceptanceModel.constant(0.05), "vllm-ar", 0, 8, LONG)
    assert auto.main_setting == ("ar", 0)
    assert auto.tokens_per_s < 0.9 * vllm_ar.tokens_per_s


def compute_bound_costs(host_ms: float) -> StepCosts:
    """A target whose forward grows with the batch (2.5 ms a request) and a drafter of 6 ms a token: at 16 requests
    psd (2 x max(20 + host, 18) ms a cycle) beats sd (18 + 40 + host)."""
    forward = [{"batch": b, "context": 1024, "new_tokens": q, "ms": 2.5 * b} for b in (1, 4, 16, 64) for q in (1, 4)]
    loops = [{"batch": b, "context": 1024, "k": k, "ms": 6.0 * k} for b in (1, 4, 16, 64) for k in (3, 5)]
    data = {"format": "minedraft-cost-curves/v1", "models": {
        "t": {"role": "target", "config": {"layers": 10}, "forward_ms": forward},
        "d": {"role": "drafter", "draft_loop_ms": loops}}}
    return StepCosts.from_curves(parse_curves(data), "t", "d", Hardware(step_overhead_ms=host_ms))


def test_auto_with_async_steps_runs_psd_as_psd_async_does() -> None:
    """With the engine's async PSD steps on, auto's psd steps are scheduled ahead once it runs psd: it reaches
    psd-async's pace, where auto in synchronous steps pays the host work after every forward."""
    from minedraft.engine.control.auto import AutoSettings

    costs = compute_bound_costs(host_ms=4.0)
    settings = AutoSettings(k_candidates=(3,))
    psd_async = run_concurrency(costs, ACCEPTANCE, "psd-async", 3, 16, LONG)
    auto = run_concurrency(costs, ACCEPTANCE, "auto", 0, 16, LONG, 300, 600, auto=settings)
    auto_async = run_concurrency(costs, ACCEPTANCE, "auto-async", 0, 16, LONG, 300, 600, auto=settings)
    assert auto.main_setting == auto_async.main_setting == ("psd", 3)
    assert auto.tokens_per_s < 0.92 * psd_async.tokens_per_s  # 4 of 24 ms a step in series
    assert auto_async.tokens_per_s >= 0.97 * psd_async.tokens_per_s
    assert auto_async.mode == "auto-async" and auto_async.gpus == 2


def test_a_decision_under_async_steps_waits_for_the_step_in_flight() -> None:
    """A switch decided while a step scheduled ahead is in flight applies after that step (which still runs the
    setting it was planned for), and the first step after it runs synchronously, as the scheduler drains its queue."""
    from dataclasses import replace

    from minedraft.engine.control.auto import AutoSettings, Decision
    from minedraft.twin.replica import ReplicaSettings, SimRequest, TwinReplica

    replica = TwinReplica(compute_bound_costs(host_ms=4.0), ACCEPTANCE,
                          ReplicaSettings(mode="auto", k=3, async_psd_steps=True, check_invariants=True,
                                          auto=AutoSettings(k_candidates=(3,), decision_interval_steps=10_000,
                                                            load_shift_factor=None)))
    for i in range(16):
        replica.add(SimRequest(f"r{i}", 1000, 1000, 0.0))
    assert replica.core.auto is not None
    on_step = replica.core.auto.on_step
    switch_at: list[int] = []

    def decide_once(record, num_running):  # type: ignore[no-untyped-def]
        decision = on_step(record, num_running)
        if record.scheduled_ahead and not switch_at and record.step > 20:
            switch_at.append(record.step)
            return Decision(record.step, "sd", 3, "psd", 3, "test", "switch", num_running, 0.0, 0.0, 0.0)
        return decision

    replica.core.auto.on_step = decide_once  # type: ignore[method-assign]
    for _ in range(40):
        replica.step()
    by_step = {r.step: r for r in replica.records}
    step = switch_at[0]
    # The step in flight at the decision: still psd, scheduled ahead; then sd, synchronous, from the next one on.
    assert by_step[step + 1].mode == "psd" and by_step[step + 1].scheduled_ahead
    assert by_step[step + 2].mode == "sd" and not by_step[step + 2].scheduled_ahead
    assert not any(r.scheduled_ahead for r in replica.records if r.step > step + 1)
    assert replace(by_step[step + 2], step=0).auto
