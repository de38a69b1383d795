"""The PSD engine against the target alone, on the real local pair with real vLLM engines.

Every test here runs with `check_invariants=True`: the scheduler asserts sub-batch balance, membership, draft
provenance and that no drafts leak after finishes and aborts on every step, so an invariant broken mid-run fails
the test that broke it.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from itertools import pairwise
from typing import Any

import pytest

from minedraft.engine.requests import EngineDeadError, RequestError, SamplingSettings
from minedraft.engine.settings import Mode

from .device_checks import assert_greedy_matches
from .driver import Planned, drive, reference
from .patience import drafts_missing, measured_waits

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
    assert scheduler.core.subbatches.sizes() == (0, 0)
    assert scheduler.core.planner.drafts == {}, "drafts leaked after every request finished"


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


@pytest.mark.parametrize("mode", [Mode.SD, Mode.PSD])
def test_adaptive_draft_lengths_keep_greedy_output_identical(psd, prompts, references, mode):
    """--draft-length adaptive: each request's own draft length and a step budget that cuts drafts (a steep verify
    price here, so that cutting happens on this CPU) change which proposals are verified, never the output."""
    core = psd.psd_scheduler.core
    psd.set_mode(mode, 3, 0)
    core.set_draft_length("adaptive")
    policy = core.planner.draft_lengths
    policy.verify_seconds = lambda requests, tokens: 0.01 + 0.0005 * tokens
    thresholds: list[float] = []
    budget = policy.budget

    def watched(*args, **kwargs):
        lengths = budget(*args, **kwargs)
        thresholds.append(policy.threshold)
        return lengths

    policy.budget = watched
    try:
        first = last_step(psd)
        plan = [Planned(f"adaptive-{mode.value}-{i}", prompts[i], GREEDY) for i in range(7)]
        run = drive(psd, plan)
        assert_greedy_matches([run.completions[f"adaptive-{mode.value}-{i}"].token_ids for i in range(7)],
                              references[:7], f"{mode.value} with adaptive draft lengths")
        records = [r for r in psd.step_records() if r.step > first and r.num_requests_with_drafts]
        assert records, "nothing was drafted"
        assert max(thresholds) > 0, "the verify budget never cut a draft position: this test would prove little"
        assert all(r.num_pad_tokens == 0 for r in records), "adaptive steps are not padded to k"
    finally:
        core.set_draft_length("fixed")
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
    # Balance measured from the requests each step actually verified (not the sizes recorded after rebalancing).
    assert all(r.num_verified_members in (3, 4, 5) for r in full), [r.num_verified_members for r in full]
    # Drafts made during the previous step reach the step that verifies them: most verified requests carry one.
    # (Stale or mis-keyed drafts fail this: they are never used.)
    carried = sum(r.num_requests_with_drafts for r in full)
    verified = sum(r.num_verified_members for r in full)
    assert carried >= 0.7 * verified, (carried, verified)
    # The other side was drafting meanwhile in most steps: the overlap happened.
    in_flight = [r.draft_jobs_in_flight for r in full]
    assert sum(n > 0 for n in in_flight) > len(in_flight) // 2, in_flight


def test_psd_acceptance_matches_sd_on_the_same_prompts(psd, prompts, references):
    """Both verify the same drafter's greedy drafts of the same committed contexts, so their acceptance agrees; a
    draft verified against a context other than the one it was made from (shifted, stale) is accepted far less."""
    rates = {}
    for mode in (Mode.SD, Mode.PSD):
        psd.set_mode(mode, 3, 0)
        before = psd.totals()
        run = drive(psd, [Planned(f"acc-{mode.value}-{i}", prompts[i], GREEDY) for i in range(8)])
        for i in range(8):
            assert run.completions[f"acc-{mode.value}-{i}"].token_ids == references[i]
        delta = psd.totals() - before
        assert delta.draft_tokens > 100, delta.draft_tokens
        rates[mode] = delta.acceptance_rate
    assert abs(rates[Mode.PSD] - rates[Mode.SD]) <= 0.05, rates


def test_sd_mode_matches_and_runs_draft_then_verify(psd, prompts, references):
    psd.set_mode(Mode.SD)
    first_step = last_step(psd)
    run = drive(psd, [Planned(f"sd-{i}", prompts[i], GREEDY) for i in range(7)])
    assert_greedy_matches([run.completions[f"sd-{i}"].token_ids for i in range(7)], references[:7], "sd")
    records = [r for r in psd.step_records(first_step) if r.num_draft_tokens]
    assert records and all(r.group_sizes[1] == 0 for r in records)
    # Sequential by construction: the verifier waits for every job it sent the step before, so no draft job is in
    # flight while sd verifies. (Counted, not timed: how long the wait lasts depends on what else runs on the cores -
    # the engine's own host work after sending a job can take longer than the drafting it overlaps.)
    assert all(r.draft_jobs_in_flight == 0 for r in records), [r.draft_jobs_in_flight for r in records]
    assert sum(r.draft_seconds for r in records) > 0
    # Nothing drafts while sd verifies: the target computed on the drafter's cores too (where there are any).
    assert all(r.widened == psd.psd_scheduler.placement.can_widen for r in records)
    assert_clean(psd)


@pytest.mark.parametrize("batch_size", [1, 7])
def test_lookahead_greedy_matches_target_alone_and_verifies_pre_drafted_branches(psd, prompts, references,
                                                                                  batch_size):
    psd.set_mode(Mode.LOOKAHEAD, 3, 0)
    first_step = last_step(psd)
    before = psd.totals()
    tag = f"la{batch_size}"
    core = psd.psd_scheduler.core
    early: list[bool] = []
    send_early = core.send_branches_early

    def counted(decision: Any) -> bool:
        early.append(send_early(decision))
        return early[-1]

    core.send_branches_early = counted  # type: ignore[method-assign]
    try:
        run = drive(psd, [Planned(f"{tag}-{i}", prompts[i], GREEDY) for i in range(batch_size)])
    finally:
        del core.send_branches_early
    # Once no prompt is left to complete, branch jobs go out as each step is planned, before vLLM schedules it.
    assert early and all(early), early
    assert_greedy_matches([run.completions[f"{tag}-{i}"].token_ids for i in range(batch_size)],
                          references[:batch_size], f"lookahead at batch {batch_size}")
    after = psd.totals()
    assert after.accepted_tokens > before.accepted_tokens, drafts_missing(psd, before, after)
    assert after.branch_hits > before.branch_hits, "no pre-drafted branch matched a real outcome"
    assert after.branches_drafted > before.branches_drafted
    records = [r for r in psd.step_records(first_step) if r.num_decode_requests]
    assert records and all(r.mode == "lookahead" and r.group_sizes[1] == 0 and not r.num_held_out for r in records)
    # The drafter drafts the next round during every verification: the target never computes on its cores then.
    assert not any(r.widened for r in records if r.num_branches_drafted)
    assert_clean(psd)
    assert not psd.psd_scheduler.core.planner.records, "branches leaked after every request finished"


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
        for i in range(4):
            psd.add_request(f"narrow-{i}", prompts[i], SamplingSettings(max_tokens=8))
        # The step thread's real CPU affinity (what the OS enforces, not what the record says) after each step.
        narrow_steps = 0
        while psd.has_unfinished_requests():
            psd.step()
            record = psd.step_records()[-1]
            if record.draft_jobs_in_flight:
                narrow_steps += 1
                assert os.sched_getaffinity(0) == set(placement.target_cores), "target computed beside the drafter"
        assert narrow_steps, "no step verified while the other side was drafting"


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


SEEDED = [SamplingSettings(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)
          for seed in (1234, 77, 2**40 + 5)]


def _seeded_plan(tag, prompts):
    return [Planned(f"{tag}-{i}-{j}", prompts[3 + i], sampling) for i in range(2) for j, sampling in enumerate(SEEDED)]


def _tokens(run, tag):
    return {key.removeprefix(tag): c.token_ids for key, c in run.completions.items() if key.startswith(tag + "-")}


def test_seeded_sampling_is_reproducible_in_every_mode_and_equal_to_the_target_alone(psd, ar_engine, prompts):
    """Seeded requests at temperature 1 give the target alone's tokens in psd (together, and among other requests
    arriving at other steps, so their drafts are verified in other groupings) and in sd. With vLLM's per-request
    generators this fails: how many drafts are verified beside a token shifts which draws it gets."""
    reference = _tokens(drive(ar_engine, _seeded_plan("ar", prompts)), "ar")
    before = psd.totals()
    together = _tokens(drive(psd, _seeded_plan("psd", prompts)), "psd")
    assert psd.totals().accepted_tokens > before.accepted_tokens, drafts_missing(psd, before, psd.totals())
    crowd = [Planned(f"crowd-{i}", prompts[8 + i], GREEDY, arrive_at_step=2 * i) for i in range(8)]
    mixed_plan = [Planned(p.request_id.replace("psd", "mixed"), p.prompt_token_ids, p.sampling, arrive_at_step=3 * i)
                  for i, p in enumerate(_seeded_plan("psd", prompts))]
    mixed = _tokens(drive(psd, crowd + mixed_plan), "mixed")
    psd.set_mode(Mode.SD, 3, 0)
    sequential = _tokens(drive(psd, _seeded_plan("sd", prompts)), "sd")
    psd.set_mode(Mode.LOOKAHEAD, 3, 0)
    before = psd.totals()
    lookahead = _tokens(drive(psd, crowd + [Planned(p.request_id.replace("psd", "la"), p.prompt_token_ids,
                                                    p.sampling, arrive_at_step=2 * i)
                                            for i, p in enumerate(_seeded_plan("psd", prompts))]), "la")
    assert psd.totals().branch_hits > before.branch_hits, drafts_missing(psd, before, psd.totals())
    assert lookahead == reference, "lookahead: seeded output differs from the target alone's"
    assert together == reference, "psd: seeded output differs from the target alone's"
    assert mixed == reference, "psd among other requests: seeded output differs from the target alone's"
    assert sequential == reference, "sd: seeded output differs from the target alone's"
    # Different seeds give different outputs (the keys are not ignored).
    assert len({tuple(tokens) for tokens in reference.values()}) == len(reference)


def _token_histograms(engine, prompt, n, position_count, tag):
    sampling = [SamplingSettings(max_tokens=position_count + 1, temperature=1.0, seed=10_000 + i,
                                 ignore_eos=True) for i in range(n)]
    run = drive(engine, [Planned(f"{tag}-{i}", prompt, s) for i, s in enumerate(sampling)])
    return [Counter(run.completions[f"{tag}-{i}"].token_ids[pos] for i in range(n))
            for pos in range(1, position_count + 1)]


def test_temperature_one_matches_the_target_distribution(psd, ar_engine, prompts):
    """Chi-square on the tokens after the first (those verified against drafts): PSD vs the target alone, both
    sampling as vLLM does (per-request generators: vLLM's rejection sampler, which unseeded requests always use),
    then PSD's keyed races for seeded requests against the same target-alone sample.

    A wrong acceptance rule (accepting drafts too often) would pull these tokens towards the draft's greedy
    choices and fail this test; the target alone and a correct PSD draw from the same distribution.
    """
    n = 400
    prompt = prompts[5]
    psd.set_reproducible_seeds(False)
    ar_engine.set_reproducible_seeds(False)
    try:
        before = psd.totals()
        psd_hist = _token_histograms(psd, prompt, n, 2, "t-psd")
        after = psd.totals()
        assert after.accepted_tokens > before.accepted_tokens, drafts_missing(psd, before, after)
        # Lookahead: the draft verified is the branch pre-drafted for the outcome that happened (a function of the
        # committed prefix alone), so vLLM's rejection sampler keeps the target's distribution as for any draft.
        psd.set_mode(Mode.LOOKAHEAD, 3, 0)
        before = psd.totals()
        lookahead_hist = _token_histograms(psd, prompt, n, 2, "t-la")
        after = psd.totals()
        assert after.branch_hits > before.branch_hits, drafts_missing(psd, before, after)
        psd.set_mode(Mode.PSD, 3, 0)
        ar_hist = _token_histograms(ar_engine, prompt, n, 2, "t-ar")
    finally:
        psd.set_reproducible_seeds(True)
        ar_engine.set_reproducible_seeds(True)
    for position, p_value in enumerate(_chi_square_p_values(psd_hist, ar_hist, n), start=1):
        assert p_value > 0.001, f"token {position}: PSD and target-alone distributions differ (p={p_value:.2g})"
    for position, p_value in enumerate(_chi_square_p_values(lookahead_hist, ar_hist, n), start=1):
        assert p_value > 0.001, f"token {position}: lookahead and target-alone distributions differ (p={p_value:.2g})"
    before = psd.totals()
    keyed_hist = _token_histograms(psd, prompt, n, 2, "t-keyed")
    after = psd.totals()
    assert after.accepted_tokens > before.accepted_tokens, drafts_missing(psd, before, after)
    for position, p_value in enumerate(_chi_square_p_values(keyed_hist, ar_hist, n), start=1):
        assert p_value > 0.001, f"token {position}: keyed PSD and target-alone distributions differ (p={p_value:.2g})"


def _chi_square_p_values(first, second, n):
    from scipy.stats import chi2_contingency

    p_values = []
    for a, b in zip(first, second, strict=True):
        common = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
        rows = [[a[t] for t in common] + [n - sum(a[t] for t in common)],
                [b[t] for t in common] + [n - sum(b[t] for t in common)]]
        rows = [list(col) for col in zip(*[c for c in zip(*rows, strict=True) if sum(c) > 0], strict=True)]
        p_values.append(chi2_contingency(rows)[1])
    return p_values


def test_the_distribution_test_rejects_a_wrong_sampler(ar_engine, prompts):
    """Power check: the chi-square test above, at the same n, tells the target at temperature 0.5 from the target at
    temperature 1. A sampler pulled towards the draft's greedy choices differs from the target in the same way."""
    n = 400
    prompt = prompts[5]

    def histograms(temperature, tag):
        sampling = [SamplingSettings(max_tokens=3, temperature=temperature, seed=20_000 + i, ignore_eos=True)
                    for i in range(n)]
        run = drive(ar_engine, [Planned(f"{tag}-{i}", prompt, s) for i, s in enumerate(sampling)])
        return [Counter(run.completions[f"{tag}-{i}"].token_ids[pos] for i in range(n)) for pos in (1, 2)]

    # As in the test above: vLLM's sampling (keyed races would draw both runs from one noise and blunt the check).
    ar_engine.set_reproducible_seeds(False)
    try:
        p_values = _chi_square_p_values(histograms(1.0, "pw-right"), histograms(0.5, "pw-wrong"), n)
    finally:
        ar_engine.set_reproducible_seeds(True)
    assert min(p_values) < 0.001, p_values


def test_mixed_greedy_top_k_top_p_and_random_requests_in_one_batch(psd, prompts, references):
    """Greedy requests match the target alone beside sampled ones; top_k=1 at temperature 1 is greedy too (the
    verifier applies top-k to the target's distribution, drafts or not); top-p and random requests run to length."""
    plan = []
    for i in range(8):
        if i % 4 == 0:
            sampling = GREEDY
        elif i % 4 == 1:
            sampling = SamplingSettings(max_tokens=40, temperature=1.0, top_k=1, seed=i)
        elif i % 4 == 2:
            sampling = SamplingSettings(max_tokens=40, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
        else:
            sampling = SamplingSettings(max_tokens=40, temperature=1.0, top_k=20, seed=i, ignore_eos=True)
        plan.append(Planned(f"mixed-{i}", prompts[i], sampling))
    before = psd.totals()
    run = drive(psd, plan)
    for i in range(8):
        tokens = run.completions[f"mixed-{i}"].token_ids
        if i % 4 in (0, 1):
            assert tokens == references[i], f"request {i} ({plan[i].sampling}) diverged from greedy"
        else:
            assert len(tokens) == 40
    assert psd.totals().accepted_tokens > before.accepted_tokens
    assert_clean(psd)


def test_stop_strings_end_where_the_target_alone_ends(psd, ar_engine, prompts):
    texts = [ar_engine.tokenizer.decode(r) for r in reference(ar_engine, prompts[:4], GREEDY)]
    # A stop string from the middle of each reference output: it ends the output inside a verified run of tokens.
    stops = [t[len(t) // 2: len(t) // 2 + 3] for t in texts]
    plans = [Planned(f"stop-{i}", prompts[i], SamplingSettings(max_tokens=40, stop=(stops[i],))) for i in range(4)]
    expected = drive(ar_engine, [Planned(f"ar-{p.request_id}", p.prompt_token_ids, p.sampling) for p in plans])
    got = drive(psd, plans)
    for i in range(4):
        want = expected.completions[f"ar-stop-{i}"]
        have = got.completions[f"stop-{i}"]
        assert (have.token_ids, have.text, have.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        assert want.finish_reason == "stop"
    assert_clean(psd)


def test_chunked_prefill_of_long_prompts_beside_decoding_requests(psd, ar_engine, pair_dir, prompts):
    """Long prompts arrive while others decode and are prefilled in chunks over several steps (a small token
    budget per step): requests mid-prefill are in neither sub-batch, and everything stays lossless."""
    from minedraft.bench.workload import bench_prompts

    scheduler = psd.psd_scheduler
    if not scheduler.scheduler_config.enable_chunked_prefill:
        pytest.skip("chunked prefill is off in this vLLM build")
    long_prompts = [(ar_engine.encode_prompt(t) * 20)[:300] for t in bench_prompts(pair_dir, 2, chars=400)]
    assert all(len(p) == 300 for p in long_prompts)
    plan = [Planned(f"chunk-short-{i}", prompts[i], GREEDY) for i in range(6)]
    plan += [Planned(f"chunk-long-{i}", p, GREEDY, arrive_at_step=3 + i) for i, p in enumerate(long_prompts)]
    budgets = {}
    for engine in (ar_engine, psd):
        budgets[engine] = engine.scheduler.max_num_scheduled_tokens
        engine.scheduler.max_num_scheduled_tokens = 64
    try:
        expected = drive(ar_engine, [Planned(f"ar-{p.request_id}", p.prompt_token_ids, p.sampling, p.arrive_at_step)
                                     for p in plan])
        first_step = last_step(psd)
        run = drive(psd, plan)
    finally:
        for engine, budget in budgets.items():
            engine.scheduler.max_num_scheduled_tokens = budget
    for p in plan:
        assert run.completions[p.request_id].token_ids == expected.completions[f"ar-{p.request_id}"].token_ids, \
            p.request_id
    records = psd.step_records(first_step)
    assert max(r.num_scheduled_tokens for r in records) <= 64, "a 300-token prompt was prefilled in chunks"
    assert any(r.num_draft_tokens for r in records)
    assert_clean(psd)


def test_an_abort_storm_leaves_nothing_behind(psd, prompts, references):
    ids = [f"storm-{i}" for i in range(300)]
    for i, rid in enumerate(ids):
        psd.add_request(rid, prompts[i % len(prompts)], SamplingSettings(max_tokens=64, ignore_eos=True))
    for _ in range(6):
        psd.step()
    psd.abort(ids)
    while psd.has_unfinished_requests():
        psd.step()
    assert_clean(psd)
    assert psd.psd_scheduler.core.planner.drafter_holds == {}, "aborted requests were not forgotten for the drafter"
    run = drive(psd, [Planned("after-storm", prompts[0], GREEDY)])
    assert run.completions["after-storm"].token_ids == references[0]


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


def test_hung_drafter_costs_a_fraction_of_a_step_then_is_replaced_in_the_background(psd, prompts, references):
    import signal

    scheduler = psd.psd_scheduler
    restarts_before = scheduler.drafter.num_restarts
    misses_before = psd.totals().deadline_misses
    hangs_before = scheduler.link.num_hangs
    # Warm the measured step times, then stop the drafter: alive but silent, only the clock can tell.
    drive(psd, [Planned(f"warm-{i}", prompts[i], SamplingSettings(max_tokens=8)) for i in range(6)])
    # The production policy for this test (the shared engine waits for drafts otherwise: patience.py). Silence well
    # past a step's wait budget is a hang: a few steps first give up waiting (deadline misses), then the restart.
    # (On a contended machine the budget, a multiple of the measured step, can itself exceed a second.)
    with measured_waits(psd):
        # (Steps before this one ran under the test engines' patient policy, whose budget is the cap by design: a
        # warm-up step that waited for a job and then verified no drafts counted here once and failed the bound.)
        hung_from = last_step(psd)
        scheduler.link.hang_seconds = max(1.0, 3 * scheduler.core.wait_policy.budget_seconds())
        os.kill(scheduler.drafter.pid(), signal.SIGSTOP)
        # Serve batches until the silence is taken for a hang (about a second of outstanding work).
        for batch in range(10):
            run = drive(psd, [Planned(f"hung-{batch}-{i}", prompts[i], GREEDY) for i in range(6)])
            for i in range(6):
                assert run.completions[f"hung-{batch}-{i}"].token_ids == references[i]
            if scheduler.link.num_hangs > hangs_before:
                break
    assert psd.totals().deadline_misses > misses_before
    missed = [r for r in psd.step_records(hung_from) if r.wait_budget_seconds and not r.num_draft_tokens]
    # A step waits for late drafts at most its budget, which comes from measured step times, not the configured
    # 10 s deadline that used to hold every request of the replica.
    assert missed and max(r.wait_budget_seconds for r in missed) < 0.5 * scheduler.core.deadline_seconds
    assert scheduler.link.num_hangs > hangs_before, "silence with work outstanding was taken for a hang"
    assert psd.wait_for_drafter(300)
    assert scheduler.drafter.num_restarts > restarts_before, "the hung drafter was replaced"
    before = psd.totals().draft_tokens
    drive(psd, [Planned("after-hang", prompts[0], GREEDY)])
    assert psd.totals().draft_tokens > before, "speculation resumed"


def test_auto_mode_switches_in_every_direction_and_stays_lossless(psd, prompts, references):
    from minedraft.engine.control.auto import AutoSettings

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
    controller = psd.psd_scheduler.core.auto
    psd.set_mode(Mode.PSD, 3, 0)
    assert psd.configured_mode is Mode.PSD
    # Turned back on, auto carries on with the controller it had (its choice and all it learned).
    psd.set_mode(Mode.AUTO)
    assert psd.psd_scheduler.core.auto is controller
    expected_mode = Mode(controller.mode)
    assert psd.current_mode == (expected_mode, 0 if expected_mode is Mode.AR else controller.k)
    # A benchmark's auto learns only from its own steps; the engine's shared cost model still sees every step.
    psd.set_mode(Mode.AUTO, auto_settings=AutoSettings(k_candidates=(1, 2, 3), learn_from_fixed_modes=False))
    private = psd.psd_scheduler.core.auto.cost_model
    assert private is not psd.psd_scheduler.core.cost_model and private.last_verify_step < 0
    shared_before = psd.psd_scheduler.core.cost_model.last_verify_step
    run = drive(psd, [Planned("auto-private", prompts[0], GREEDY)])
    assert run.completions["auto-private"].token_ids == references[0]
    assert private.last_verify_step > shared_before
    assert psd.psd_scheduler.core.cost_model.last_verify_step == private.last_verify_step
    psd.set_mode(Mode.PSD, 3, 0)
    assert psd.configured_mode is Mode.PSD


@pytest.fixture
def async_psd(psd):
    """The shared psd engine with async PSD steps on (off again afterwards, whatever the default)."""
    was = psd.async_psd_steps
    psd.set_async_psd_steps(True)
    yield psd
    for _ in range(5000):
        if not psd.has_unfinished_requests():
            break
        psd.step()
    psd.set_async_psd_steps(was)


def test_async_psd_steps_overlap_and_match_the_target_alone(async_psd, prompts, references):
    """Steps scheduled before the previous step's output is processed, with arrivals mid-run, aborts and finishes while
    a step is in flight: token-identical to the target alone, and the overlap counted from the step records."""
    engine = async_psd
    plan = [
        Planned(f"async-{i}", prompts[i], GREEDY, arrive_at_step=(i % 4) * 5,
                abort_after_tokens=(6 + i) if i in (3, 10) else None)
        for i in range(16)
    ]
    first_step = last_step(engine)
    before = engine.totals()
    run = drive(engine, plan)
    assert run.aborted == {"async-3", "async-10"}
    for i in range(16):
        tokens = run.completions[f"async-{i}"].token_ids
        expected = references[i][: len(tokens)] if f"async-{i}" in run.aborted else references[i]
        assert tokens == expected, f"request {i} diverged under async steps"
    after = engine.totals()
    assert after.accepted_tokens > before.accepted_tokens, drafts_missing(engine, before, after)
    records = engine.step_records(first_step)
    ahead = [r for r in records if r.scheduled_ahead]
    # Steady psd with both sides decoding is most of this run: most decode steps were scheduled ahead.
    decode = [r for r in records if r.num_decode_requests and not r.num_prefill_requests]
    assert len(ahead) > len(decode) // 2, (len(ahead), len(decode))
    by_step = {r.step: r for r in records}
    for r in ahead:
        previous = by_step.get(r.step - 1)
        # A step scheduled ahead verifies the other sub-batch than the step in flight (never the same requests).
        assert r.mode == "psd" and previous is not None and r.verified_group == 1 - previous.verified_group, r
    assert_clean(engine)


def test_auto_with_async_psd_steps_schedules_ahead_on_psd_drains_before_switching_and_stays_lossless(
        async_psd, prompts, references):
    """With async PSD steps on, auto schedules psd's steps ahead once it runs psd (its cost model reads those steps
    apart: their unhidden host work on its own), applies a switch only after the step in flight is processed, and
    stays token-identical to the target alone while switching between psd and sd mid-stream."""
    from minedraft.engine.control.auto import AutoSettings

    engine = async_psd
    first_step = last_step(engine)
    decisions_before = len(engine.auto_decisions())
    twitchy = AutoSettings(allowed_modes=("psd", "sd"), k_candidates=(2, 3), decision_interval_steps=3,
                           min_dwell_steps=3, switch_margin=0.0, stale_after_steps=10, probe_steps=4)
    engine.set_mode(Mode.AUTO, auto_settings=twitchy)
    try:
        run = drive(engine, [Planned(f"auto-async-{i}", prompts[i], GREEDY, arrive_at_step=i) for i in range(12)])
        for i in range(12):
            assert run.completions[f"auto-async-{i}"].token_ids == references[i], f"request {i} diverged"
        records = [r for r in engine.step_records(first_step) if r.auto]
        by_step = {r.step: r for r in records}
        ahead = [r for r in records if r.scheduled_ahead]
        assert ahead, "auto never scheduled a step ahead"
        for r in ahead:
            previous = by_step.get(r.step - 1)
            assert r.mode == "psd" and previous is not None and r.verified_group == 1 - previous.verified_group, r
        assert engine.psd_scheduler.core.auto.cost_model.overhead_ahead.num_observations > 0
        # Records carry each verified job's catch-up as the job carried it: newcomers' prompts (one arrives every
        # step here) ride in jobs beyond anything steady decoding (at most k accepted tokens a request) could carry.
        jobs = [r for r in records if r.draft_job_requests]
        assert any(r.draft_job_catch_up_tokens > r.draft_job_requests * r.draft_job_length for r in jobs), jobs
        assert all(r.draft_job_catch_up_tokens >= 0 for r in jobs)
        decisions = engine.auto_decisions()[decisions_before:]
        assert {(d.previous_mode, d.mode) for d in decisions} & {("psd", "sd"), ("sd", "psd")}, decisions
        decided_at = {d.step for d in decisions}
        for d in decisions:
            after = by_step.get(d.step + 2)
            if d.previous_mode == "psd" and d.mode == "sd" and after is not None and d.step + 1 not in decided_at:
                # Applied at the latest once the step in flight at the decision was processed; nothing ahead in sd.
                assert after.mode == "sd" and not after.scheduled_ahead, (d, after)
        assert_clean(engine)
    finally:
        engine.set_mode(Mode.PSD, 3, 0)


def test_async_psd_steps_fall_back_to_synchronous_in_sd_ar_and_one_sided_psd(async_psd, prompts, references):
    engine = async_psd
    for mode in (Mode.SD, Mode.AR):
        engine.set_mode(mode, 3, 0)
        first_step = last_step(engine)
        run = drive(engine, [Planned(f"async-{mode.value}-{i}", prompts[i], GREEDY) for i in range(6)])
        for i in range(6):
            assert run.completions[f"async-{mode.value}-{i}"].token_ids == references[i]
        assert not any(r.scheduled_ahead for r in engine.step_records(first_step)), mode
    # psd with a single request: one sub-batch stays empty, so psd runs sequential sd steps.
    engine.set_mode(Mode.PSD, 3, 0)
    first_step = last_step(engine)
    run = drive(engine, [Planned("async-alone", prompts[0], GREEDY)])
    assert run.completions["async-alone"].token_ids == references[0]
    assert not any(r.scheduled_ahead for r in engine.step_records(first_step))
    assert_clean(engine)
