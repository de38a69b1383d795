"""The vLLM drafter backend: same job protocol, the draft model served by vLLM in the drafter process."""

import pytest

from minedraft.engine.requests import SamplingSettings
from minedraft.engine.settings import Mode

from .device_checks import assert_greedy_matches
from .driver import Planned, drive, reference

pytestmark = pytest.mark.engine


def test_psd_with_the_vllm_drafter_matches_target_alone(psd_vllm_drafter_engine, ar_engine, pair_dir):
    from minedraft.bench.workload import bench_prompts

    engine = psd_vllm_drafter_engine
    prompts = [ar_engine.encode_prompt(t) for t in bench_prompts(pair_dir, 9, chars=160)]
    sampling = SamplingSettings(max_tokens=32)
    expected = reference(ar_engine, prompts, sampling)
    run = drive(engine, [Planned(f"vd-{i}", p, sampling) for i, p in enumerate(prompts)])
    assert_greedy_matches([run.completions[f"vd-{i}"].token_ids for i in range(9)], expected, "vllm drafter")
    totals = engine.totals()
    assert totals.accepted_tokens > 0 and totals.acceptance_rate > 0.3

    # Extra drafts need the drafter's log-probabilities: vLLM's logprobs path.
    engine.set_mode(Mode.PSD, k=2, num_extra_draft_tokens=2)
    run = drive(engine, [Planned(f"vde-{i}", p, sampling) for i, p in enumerate(prompts)])
    assert_greedy_matches([run.completions[f"vde-{i}"].token_ids for i in range(9)], expected,
                          "vllm drafter, extra drafts")
    assert any(len(r.drafted_per_position) > 2 for r in engine.step_records())
    engine.set_mode(Mode.PSD, k=3, num_extra_draft_tokens=0)
