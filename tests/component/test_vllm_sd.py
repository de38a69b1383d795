"""The anchor mode: vLLM's own draft-model speculative decoding on the same pair."""

import pytest

from minedraft.engine.requests import SamplingSettings

from .driver import Planned, drive, reference

pytestmark = pytest.mark.engine


def test_vllm_sd_greedy_matches_target_alone(vllm_sd_engine, ar_engine, pair_dir):
    from minedraft.bench.workload import bench_prompts

    prompts = [ar_engine.encode_prompt(t) for t in bench_prompts(pair_dir, 7, chars=160)]
    sampling = SamplingSettings(max_tokens=32)
    expected = reference(ar_engine, prompts, sampling)
    run = drive(vllm_sd_engine, [Planned(f"v-{i}", p, sampling) for i, p in enumerate(prompts)])
    assert [run.completions[f"v-{i}"].token_ids for i in range(7)] == expected
    assert sum(c.num_draft_tokens for c in run.completions.values()) > 0, "vLLM drafted"
