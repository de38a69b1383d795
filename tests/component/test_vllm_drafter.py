"""The vLLM drafter backend: same job protocol, the draft model served by vLLM in the drafter process."""

import pytest

from minedraft.engine.requests import SamplingSettings
from minedraft.engine.settings import Mode

from .device_checks import assert_greedy_matches
from .driver import Planned, drafter_keeps_up, drive, reference

pytestmark = pytest.mark.engine


def test_psd_with_the_vllm_drafter_matches_target_alone(psd_vllm_drafter_engine, ar_engine, pair_dir):
    from minedraft.bench.workload import bench_prompts

    engine = psd_vllm_drafter_engine
    scheduler = engine.psd_scheduler
    prompts = [ar_engine.encode_prompt(t) for t in bench_prompts(pair_dir, 9, chars=160)]
    sampling = SamplingSettings(max_tokens=32)
    expected = reference(ar_engine, prompts, sampling)
    # At the k the engine was built for: what vLLM scheduled in each step, as the invariant check sees it.
    assert (scheduler.core.k, scheduler.num_spec_tokens) == (4, 4)
    scheduled_lengths: list[list[int]] = []
    check_step = scheduler.core.planner.check_step

    def spy(plan, states, scheduled):
        if plan.proposals:
            scheduled_lengths.append([len(tokens) for tokens in scheduled.values()])
        return check_step(plan, states, scheduled)

    scheduler.core.planner.check_step = spy
    try:
        run = drive(engine, [Planned(f"vd-{i}", p, sampling) for i, p in enumerate(prompts)])
    finally:
        del scheduler.core.planner.check_step
    assert_greedy_matches([run.completions[f"vd-{i}"].token_ids for i in range(9)], expected, "vllm drafter")
    totals = engine.totals()
    assert totals.accepted_tokens > 0 and totals.acceptance_rate > 0.3
    # Every request verified in a step with drafts carries exactly num_speculative_tokens proposals (drafts, then
    # padding): the uniform 1 + 4 decode batch of vLLM's full CUDA graphs, not the piecewise fallback of a 1 + 3.
    assert scheduled_lengths and all(lengths == [4] * len(lengths) for lengths in scheduled_lengths), \
        scheduled_lengths

    # Extra drafts need the drafter's log-probabilities: vLLM's logprobs path.
    engine.set_mode(Mode.PSD, k=2, num_extra_draft_tokens=2)
    run = drive(engine, [Planned(f"vde-{i}", p, sampling) for i, p in enumerate(prompts)])
    assert_greedy_matches([run.completions[f"vde-{i}"].token_ids for i in range(9)], expected,
                          "vllm drafter, extra drafts")
    assert any(len(r.drafted_per_position) > 2 for r in engine.step_records())
    engine.set_mode(Mode.PSD, k=4, num_extra_draft_tokens=0)


def test_the_vllm_drafter_takes_in_catch_up_chunks_without_drafting_them(psd_vllm_drafter_engine, ar_engine,
                                                                         pair_dir):
    """Long catch-ups go in chunks that draft nothing (vLLM prefills each into its prefix cache and the sampled token
    is dropped); output stays the target's and the requests get drafts once caught up."""
    from minedraft.bench.workload import bench_prompts

    engine = psd_vllm_drafter_engine
    planner = engine.psd_scheduler.core.planner
    prompts = [ar_engine.encode_prompt(t) for t in bench_prompts(pair_dir, 4, chars=400)]
    assert min(len(p) for p in prompts) > 32
    sampling = SamplingSettings(max_tokens=24)
    expected = reference(ar_engine, prompts, sampling)
    saved, planner.catch_up_tokens_per_job = planner.catch_up_tokens_per_job, 32
    chunks = []
    draft_job = planner.draft_job

    def spy(requests, group):
        items = draft_job(requests, group)
        chunks.extend(i for i in items if i.num_draft_tokens == 0)
        return items

    planner.draft_job = spy
    before = engine.totals()
    try:
        # Steps do not wait for jobs that only catch up: the drafter is let to keep up between steps, so the requests
        # reach the end of their catch-up within 24 tokens whatever this machine's timing.
        run = drive(engine, [Planned(f"vcu-{i}", p, sampling, arrive_at_step=2 * i) for i, p in enumerate(prompts)],
                    between_steps=drafter_keeps_up(engine))
    finally:
        del planner.draft_job
        planner.catch_up_tokens_per_job = saved
    assert_greedy_matches([run.completions[f"vcu-{i}"].token_ids for i in range(len(prompts))], expected,
                          "vllm drafter, catch-up chunks")
    assert chunks, "no catch-up was chunked"
    assert engine.totals().accepted_tokens > before.accepted_tokens, "drafts took part"


def test_lookahead_with_the_vllm_drafter_drafts_branches_with_candidates_and_matches_target_alone(
        psd_vllm_drafter_engine, ar_engine, pair_dir):
    """Each branch a vLLM request over the prefix-cached committed context plus its tail; candidates from top-F
    logprobs. The output stays the target's and pre-drafted branches match real outcomes."""
    from minedraft.bench.workload import bench_prompts

    engine = psd_vllm_drafter_engine
    prompts = [ar_engine.encode_prompt(t) for t in bench_prompts(pair_dir, 4, chars=160)]
    sampling = SamplingSettings(max_tokens=24)
    expected = reference(ar_engine, prompts, sampling)
    engine.set_mode(Mode.LOOKAHEAD, k=4)
    arrived = []
    core = engine.psd_scheduler.core
    store = core.planner.store_branches

    def spy(drafts, is_live):
        drafts = list(drafts)
        arrived.extend(draft for _, draft in drafts)
        return store(drafts, is_live)

    core.planner.store_branches = spy
    before = engine.totals()
    try:
        run = drive(engine, [Planned(f"vla-{i}", p, sampling) for i, p in enumerate(prompts)])
    finally:
        del core.planner.store_branches
        engine.set_mode(Mode.PSD, k=4)
    assert_greedy_matches([run.completions[f"vla-{i}"].token_ids for i in range(4)], expected, "vllm lookahead")
    after = engine.totals()
    assert after.branch_hits > before.branch_hits and after.branches_drafted > before.branches_drafted
    tailed = [d for d in arrived if d.tail]
    assert tailed and all(len(d.candidates) == len(d.token_ids) + 1 for d in tailed if d.token_ids)
    assert all(c and c[0] == t for d in tailed for c, t in zip(d.candidates, d.token_ids, strict=False)), \
        "greedy: the top candidate is the drafted token"
