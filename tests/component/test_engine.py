"""The PSD engine against the target alone, on the real local pair with real vLLM engines.

Every test here runs with `check_invariants=True`: the scheduler asserts sub-batch balance, membership, draft
provenance and that no drafts leak after finishes and aborts on every step, so an invariant broken mid-run fails
the test that broke it.
"""

from __future__ import annotations

import time
from collections import Counter
from itertools import pairwise

import pytest

from minedraft.engine.requests import EngineDeadError, RequestError, SamplingSettings
from minedraft.engine.settings import Mode

from .device_checks import assert_greedy_matches
from .driver import Planned, drive, reference

pytestmark = pytest.mark.engine

GREEDY = SamplingSettings(max_tokens=40)


@pytest.fixture(scope="module")
def prompts(pair_dir, ar_engine) -> list[list[int]]:
    from minedraft.bench.workload import bench_prompts

    texts = bench_prompts(pair_dir, 24, chars=160)
    return [ar_engine.encode_prompt(t) for t in texts]


@pytest.fixture(scope="module")
def references(ar_engine, prompts) -> list[list[int]]:
    return reference(ar_engine, prompts, GREEDY)


def last_step(engine) -> int:
    records = engine.step_records()
    return records[-1].step if records else 0


def assert_clean(engine) -> None:
    scheduler = engine.psd_scheduler
    assert not engine.has_unfinished_requests()
    assert scheduler.subbatches.sizes() == (0, 0)
    assert scheduler.drafts == {}, "drafts leaked after every request finished"


@pytest.mark.parametrize("batch_size", [1, 2, 7, 16])
def test_psd_greedy_matches_target_alone(psd, prompts, references, batch_size):
    before = psd.totals()
    plan = [Planned(f"b{batch_size}-{i}", prompts[i], GREEDY) for i in range(batch_size)]
    run = drive(psd, plan)
    assert_greedy_matches([run.completions[f"b{batch_size}-{i}"].token_ids for i in range(batch_size)],
                          references[:batch_size], f"psd at batch {batch_size}")
    after = psd.totals()
    assert after.draft_tokens > before.draft_tokens, "no drafts were verified"
    assert after.accepted_tokens > before.accepted_tokens
    assert_clean(psd)


def test_psd_with_arrivals_mid_run_and_aborts(psd, prompts, references):
    plan = [
        Planned(f"mix-{i}", prompts[i], GREEDY, arrive_at_step=(i % 6) * 3,
                abort_after_tokens=(5 + i) if i in (2, 9, 13) else None)
        for i in range(16)
    ]
    first_step = last_step(psd)
    run = drive(psd, plan)
    assert run.aborted == {"mix-2", "mix-9", "mix-13"}
    for i in range(16):
        tokens = run.completions[f"mix-{i}"].token_ids
        if f"mix-{i}" in run.aborted:
            assert tokens == references[i][: len(tokens)], "aborted request's partial output diverged"
            assert len(tokens) < len(references[i])
        else:
            assert tokens == references[i], f"request {i} diverged"
    records = psd.step_records(first_step)
    decode_steps = [r for r in records if r.verified_group is not None and r.num_decode_requests]
    assert {r.verified_group for r in decode_steps} == {0, 1}, "both sub-batches were verified"
    assert all(abs(r.group_sizes[0] - r.group_sizes[1]) <= 1 for r in records)
    assert_clean(psd)


def test_psd_alternates_sub_batches_under_load(psd, prompts, references):
    first_step = last_step(psd)
    drive(psd, [Planned(f"alt-{i}", prompts[i], SamplingSettings(max_tokens=24)) for i in range(8)])
    records = [r for r in psd.step_records(first_step) if r.num_decode_requests and r.num_prefill_requests == 0]
    full = [r for r in records if r.group_sizes == (4, 4)]
    assert full, "sub-batches of 4 and 4 were formed"
    assert all(r.num_decode_requests <= 4 for r in full), "each step verifies one sub-batch, not both"
    groups = [r.verified_group for r in full]
    assert sum(a != b for a, b in pairwise(groups)) >= len(groups) // 2
    # While the other side is being drafted the target keeps to its own cores; it widens exactly when no draft job
    # is in flight as a step verifies. Under load that is rare but not impossible: a drafter that finishes the
    # other side's job in the gap between two steps leaves nothing drafting beside the next one.
    can_widen = psd.psd_scheduler.placement.can_widen
    assert all(r.widened == (can_widen and r.draft_jobs_in_flight == 0) for r in full), \
        [(r.step, r.widened, r.draft_jobs_in_flight) for r in full]
    in_flight = [r.draft_jobs_in_flight for r in full]
    assert sum(n > 0 for n in in_flight) > len(in_flight) // 2, in_flight


def test_sd_mode_matches_and_runs_draft_then_verify(psd, prompts, references):
    psd.set_mode(Mode.SD)
    first_step = last_step(psd)
    run = drive(psd, [Planned(f"sd-{i}", prompts[i], GREEDY) for i in range(7)])
    assert_greedy_matches([run.completions[f"sd-{i}"].token_ids for i in range(7)], references[:7], "sd")
    records = [r for r in psd.step_records(first_step) if r.num_draft_tokens]
    assert records and all(r.group_sizes[1] == 0 for r in records)
    draft = sum(r.draft_seconds for r in records)
    wait = sum(r.wait_seconds for r in records)
    # Sequential by construction: the verifier waits for every job it sent the step before.
    assert wait > 0.5 * draft
    # Nothing drafts while sd verifies: the target computed on the drafter's cores too (where there are any).
    assert all(r.widened == psd.psd_scheduler.placement.can_widen for r in records)
    assert_clean(psd)


def test_ar_mode_on_the_psd_engine_drafts_nothing(psd, prompts, references):
    psd.set_mode(Mode.AR)
    before = psd.totals()
    run = drive(psd, [Planned(f"ar-{i}", prompts[i], GREEDY) for i in range(4)])
    for i in range(4):
        assert run.completions[f"ar-{i}"].token_ids == references[i]
    assert psd.totals().draft_tokens == before.draft_tokens
    placement = psd.psd_scheduler.placement
    if placement.can_widen:
        # Nothing drafted: the target computed on the drafter's cores too, and narrows back for psd.
        assert placement.wide is True and placement.num_threads == len(placement.wide_cores)
        psd.set_mode(Mode.PSD)
        first_step = last_step(psd)
        drive(psd, [Planned(f"narrow-{i}", prompts[i], SamplingSettings(max_tokens=8)) for i in range(4)])
        both_sides = [r for r in psd.step_records(first_step) if r.num_draft_tokens and min(r.group_sizes) >= 2]
        # Steady psd: while the other side's job is in flight the target keeps to its cores, and widens only when
        # none is (a drafter that finished it between two steps; seen in one fresh-clone CI run).
        assert both_sides and any(r.draft_jobs_in_flight for r in both_sides)
        assert all(r.widened == (r.draft_jobs_in_flight == 0) for r in both_sides), \
            [(r.step, r.widened, r.draft_jobs_in_flight) for r in both_sides]


def test_extra_drafts_with_top_c_selection_stay_lossless(psd, prompts, references):
    psd.set_mode(Mode.PSD, k=2, num_extra_draft_tokens=2)
    first_step = last_step(psd)
    run = drive(psd, [Planned(f"e-{i}", prompts[i], GREEDY) for i in range(8)])
    assert_greedy_matches([run.completions[f"e-{i}"].token_ids for i in range(8)], references[:8], "extra drafts")
    records = [r for r in psd.step_records(first_step) if r.num_requests_with_drafts]
    # Budget C = k * |sub-batch|: verified draft tokens per step never exceed it, some drafts run past k.
    assert all(0 < r.draft_token_budget <= 2 * 8 for r in records)
    assert all(r.num_draft_tokens <= r.draft_token_budget for r in records)
    assert any(len(r.drafted_per_position) > 2 for r in records), "no request kept more than k tokens"
    psd.set_mode(Mode.PSD, k=3, num_extra_draft_tokens=0)


def test_per_request_speculation_counts(psd, prompts):
    run = drive(psd, [Planned("counts", prompts[0], GREEDY)])
    completion = run.completions["counts"]
    assert completion.num_draft_tokens > 0
    assert 0 < completion.num_accepted_tokens <= completion.num_draft_tokens
    assert completion.finish_reason in ("length", "stop")


def test_drafter_killed_mid_run_loses_nothing_and_recovers(psd, prompts, references):
    scheduler = psd.psd_scheduler
    restarts_before = scheduler.drafter.num_restarts
    first_step = last_step(psd)
    plan = [Planned(f"kill-{i}", prompts[i], GREEDY) for i in range(8)]
    for p in plan:
        psd.add_request(p.request_id, p.prompt_token_ids, p.sampling)
    outputs: dict[str, list[int]] = {p.request_id: [] for p in plan}
    steps = 0
    while psd.has_unfinished_requests():
        if steps == 6:
            scheduler.drafter.kill()
        for delta in psd.step():
            outputs[delta.request_id].extend(delta.token_ids)
        steps += 1
    assert_greedy_matches([outputs[f"kill-{i}"] for i in range(8)], references[:8], "drafter killed mid-run")
    records = psd.step_records(first_step)
    assert any(not r.drafter_up for r in records), "drafter-down is visible in the step statistics"
    assert any(r.mode == "ar" for r in records), "served without drafts while the drafter was down"
    # It comes back (after a short back-off) and speculation resumes.
    assert psd.wait_for_drafter(300)
    assert scheduler.drafter.num_restarts > restarts_before
    assert psd.totals().drafter_restarts == scheduler.drafter.num_restarts
    before = psd.totals().draft_tokens
    run = drive(psd, [Planned("after-restart", prompts[0], GREEDY)])
    assert run.completions["after-restart"].token_ids == references[0]
    assert psd.totals().draft_tokens > before


def test_seeded_sampling_is_reproducible(psd, prompts):
    sampling = SamplingSettings(max_tokens=24, temperature=1.0, seed=1234)
    first = drive(psd, [Planned("seed-a", prompts[3], sampling)]).completions["seed-a"].token_ids
    second = drive(psd, [Planned("seed-b", prompts[3], sampling)]).completions["seed-b"].token_ids
    assert first == second


def _token_histograms(engine, prompt, n, position_count, tag):
    sampling = [SamplingSettings(max_tokens=position_count + 1, temperature=1.0, seed=10_000 + i,
                                 ignore_eos=True) for i in range(n)]
    run = drive(engine, [Planned(f"{tag}-{i}", prompt, s) for i, s in enumerate(sampling)])
    return [Counter(run.completions[f"{tag}-{i}"].token_ids[pos] for i in range(n))
            for pos in range(1, position_count + 1)]


def test_temperature_one_matches_the_target_distribution(psd, ar_engine, prompts):
    """Chi-square on the tokens after the first (those verified against drafts): PSD vs the target alone.

    A wrong acceptance rule (accepting drafts too often) would pull these tokens towards the draft's greedy
    choices and fail this test; the target alone and a correct PSD draw from the same distribution.
    """
    from scipy.stats import chi2_contingency

    n = 400
    prompt = prompts[5]
    before = psd.totals()
    psd_hist = _token_histograms(psd, prompt, n, 2, "t-psd")
    assert psd.totals().accepted_tokens > before.accepted_tokens, "drafts took part"
    ar_hist = _token_histograms(ar_engine, prompt, n, 2, "t-ar")
    for position, (a, b) in enumerate(zip(psd_hist, ar_hist, strict=True), start=1):
        common = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
        rows = [[a[t] for t in common] + [n - sum(a[t] for t in common)],
                [b[t] for t in common] + [n - sum(b[t] for t in common)]]
        rows = [list(col) for col in zip(*[c for c in zip(*rows, strict=True) if sum(c) > 0], strict=True)]
        _, p_value, _, _ = chi2_contingency(rows)
        assert p_value > 0.001, f"token {position}: PSD and target-alone distributions differ (p={p_value:.2g})"


def test_bad_requests_get_field_named_errors_and_the_engine_keeps_serving(psd, prompts, references):
    with pytest.raises(RequestError) as info:
        psd.encode_prompt("")
    assert info.value.field_name == "prompt"
    with pytest.raises(RequestError) as info:
        psd.encode_prompt(list(range(5)) * 200)
    assert info.value.field_name == "prompt" and "context" in str(info.value)
    with pytest.raises(RequestError) as info:
        psd.encode_prompt([1, 2, 999_999])
    assert info.value.field_name == "prompt_token_ids"
    with pytest.raises(RequestError) as info:
        psd.add_request("bad", prompts[0], SamplingSettings(max_tokens=0))
    assert info.value.field_name == "max_tokens"
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        psd.set_mode(Mode.PSD, k=99)
    with pytest.raises(ValueError, match="mode"):
        psd.set_mode(Mode.VLLM_SD)
    run = drive(psd, [Planned("still-serving", prompts[1], GREEDY)])
    assert run.completions["still-serving"].token_ids == references[1]


async def test_async_generate_streams_and_cancel_aborts(psd, prompts, references):
    from minedraft.engine.async_engine import AsyncEngine

    engine = AsyncEngine(psd)
    try:
        streamed: list[int] = []
        chunks = 0
        async for delta in engine.generate(prompts[0], GREEDY, request_id="stream-1"):
            streamed.extend(delta.token_ids)
            chunks += 1
        assert streamed == references[0]
        assert chunks > 1, "output arrives as a stream of deltas"

        stream = engine.generate(prompts[1], SamplingSettings(max_tokens=200, ignore_eos=True),
                                 request_id="cancel-me")
        got = 0
        async for delta in stream:
            got += len(delta.token_ids)
            if got >= 5:
                break
        await stream.aclose()
        deadline = time.monotonic() + 30
        while await engine.call(lambda e: e.has_unfinished_requests()) and time.monotonic() < deadline:
            pass
        assert not await engine.call(lambda e: e.has_unfinished_requests()), "the cancelled request was aborted"
        with pytest.raises(RequestError):
            async for _ in engine.generate("", GREEDY):
                pass

        # An abort from elsewhere (the server on a client disconnect, say) ends the stream with reason "abort".
        stream = engine.generate(prompts[2], SamplingSettings(max_tokens=200, ignore_eos=True), request_id="ab-1")
        last = None
        async for delta in stream:
            if last is None:
                await engine.abort("ab-1")
            last = delta
        assert last is not None and last.finish_reason == "abort"
        assert engine.num_in_flight == 0
    finally:
        await engine.shutdown(shutdown_engine=False)
    assert_clean(psd)
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate(prompts[0], GREEDY):
            pass
    with pytest.raises(EngineDeadError):
        await engine.call(lambda e: e.load())


def test_hung_drafter_misses_deadlines_then_is_replaced(psd, prompts, references):
    import os
    import signal

    scheduler = psd.psd_scheduler
    restarts_before = scheduler.drafter.num_restarts
    misses_before = psd.totals().deadline_misses
    scheduler.deadline_seconds = 0.3
    try:
        os.kill(scheduler.drafter.pid(), signal.SIGSTOP)  # alive but silent: only the deadline can tell
        run = drive(psd, [Planned(f"hung-{i}", prompts[i], GREEDY) for i in range(6)])
    finally:
        scheduler.deadline_seconds = 10.0
    for i in range(6):
        assert run.completions[f"hung-{i}"].token_ids == references[i]
    assert psd.totals().deadline_misses - misses_before >= scheduler.max_missed_deadlines
    assert psd.wait_for_drafter(300)
    assert scheduler.drafter.num_restarts > restarts_before, "the hung drafter was replaced"
    before = psd.totals().draft_tokens
    drive(psd, [Planned("after-hang", prompts[0], GREEDY)])
    assert psd.totals().draft_tokens > before, "speculation resumed"


def test_auto_mode_switches_in_every_direction_and_stays_lossless(psd, prompts, references):
    from minedraft.engine.auto import AutoSettings

    # A hair-trigger policy: decide every 3 steps, probe any mode unseen for 10 steps. Switches happen between
    # psd, sd and ar (and k) while requests are mid-stream, arriving and finishing. Which switches the policy
    # picks depends on measured costs, so a first phase allows only psd and sd (switching between them is then
    # certain), a second all three.
    before = psd.totals()
    decisions_before = len(psd.auto_decisions())
    for phase, modes in enumerate([("psd", "sd"), ("ar", "sd", "psd")]):
        twitchy = AutoSettings(allowed_modes=modes, k_candidates=(1, 2, 3, 4), decision_interval_steps=3,
                               min_dwell_steps=3, switch_margin=0.0, stale_after_steps=10, probe_steps=4)
        psd.set_mode(Mode.AUTO, auto_settings=twitchy)
        assert psd.configured_mode is Mode.AUTO
        indices = range(6 * phase, 6 * phase + 6)
        run = drive(psd, [Planned(f"auto-{i}", prompts[i], GREEDY, arrive_at_step=2 * (i - 6 * phase))
                          for i in indices])
        assert_greedy_matches([run.completions[f"auto-{i}"].token_ids for i in indices],
                              [references[i] for i in indices], f"auto phase {phase}")
    decisions = psd.auto_decisions()[decisions_before:]
    transitions = {(d.previous_mode, d.mode) for d in decisions}
    assert {("psd", "sd"), ("sd", "psd")} & transitions, transitions
    assert {m for d in decisions for m in (d.previous_mode, d.mode)} == {"psd", "sd", "ar"}, transitions
    # Every decision that changed the setting is counted; keeping what a probe ran (ar -> ar) is a decision, not a
    # switch.
    changes = [d for d in decisions if (d.mode, d.k) != (d.previous_mode, d.previous_k)]
    assert psd.totals().mode_switches - before.mode_switches == len(changes)
    assert any(r.auto for r in psd.step_records()), "step records say auto chose the mode"
    assert psd.predictions(8), "the cost model predicts after measuring"
    assert_clean(psd)
    controller = psd.psd_scheduler.auto
    psd.set_mode(Mode.PSD, 3, 0)
    assert psd.configured_mode is Mode.PSD
    # Turned back on, auto carries on with the controller it had (its choice and all it learned).
    psd.set_mode(Mode.AUTO)
    assert psd.psd_scheduler.auto is controller
    expected_mode = Mode(controller.mode)
    assert psd.current_mode == (expected_mode, 0 if expected_mode is Mode.AR else controller.k)
    # A benchmark's auto learns only from its own steps; the engine's shared cost model still sees every step.
    psd.set_mode(Mode.AUTO, auto_settings=AutoSettings(k_candidates=(1, 2, 3), learn_from_fixed_modes=False))
    private = psd.psd_scheduler.auto.cost_model
    assert private is not psd.psd_scheduler.cost_model and private.last_verify_step < 0
    shared_before = psd.psd_scheduler.cost_model.last_verify_step
    run = drive(psd, [Planned("auto-private", prompts[0], GREEDY)])
    assert run.completions["auto-private"].token_ids == references[0]
    assert private.last_verify_step > shared_before
    assert psd.psd_scheduler.cost_model.last_verify_step == private.last_verify_step
    psd.set_mode(Mode.PSD, 3, 0)
    assert psd.configured_mode is Mode.PSD
