"""A KV cache too small for the load: vLLM preempts and recomputes requests; PSD must stay balanced and lossless."""

import pytest

from minedraft.engine.requests import SamplingSettings
from minedraft.engine.settings import Mode

from .conftest import engine_settings
from .device_checks import assert_greedy_matches
from .driver import Planned, drive, reference
from .patience import wait_for_drafts

pytestmark = pytest.mark.engine


# Session scope, like the shared engines: shutting a vLLM engine down tears down vLLM's process-wide parallel state,
# which breaks every engine still in use by later modules (ar_engine in test_server, for one).
@pytest.fixture(scope="session")
def cramped_engine(pair_dir):
    from minedraft.engine.core import Engine

    engine = Engine(engine_settings(pair_dir, Mode.PSD, extra_vllm_args={"num_gpu_blocks_override": 12}))
    assert engine.wait_for_drafter(300)
    yield wait_for_drafts(engine)
    engine.shutdown()


@pytest.mark.parametrize("async_steps", [False, True], ids=["sync", "async"])
def test_preempted_requests_rejoin_balanced_and_stay_lossless(cramped_engine, ar_engine, pair_dir, async_steps):
    """With async PSD steps too: vLLM may then preempt a request whose step is still in flight (its stale output is
    still delivered, and recomputed after it resumes)."""
    from minedraft.bench.workload import bench_prompts

    prompts = [ar_engine.encode_prompt(t) for t in bench_prompts(pair_dir, 16, chars=120)]
    sampling = SamplingSettings(max_tokens=120, ignore_eos=True)
    expected = reference(ar_engine, prompts, sampling)
    before = cramped_engine.totals()
    first = records[-1].step if (records := cramped_engine.step_records()) else 0
    was = cramped_engine.async_psd_steps
    cramped_engine.set_async_psd_steps(async_steps)
    try:
        run = drive(cramped_engine,
                    [Planned(f"pre-{i}", p, sampling, arrive_at_step=i) for i, p in enumerate(prompts)])
    finally:
        cramped_engine.set_async_psd_steps(was)
    totals = cramped_engine.totals() - before
    assert totals.preemptions > 0, "the load did not preempt anything: the test proves nothing"
    if async_steps:
        assert any(r.scheduled_ahead for r in cramped_engine.step_records(first)), "no step was scheduled ahead"
    assert_greedy_matches([run.completions[f"pre-{i}"].token_ids for i in range(16)], expected, "preemption")
    assert totals.accepted_tokens > 0
    # Preempted requests left their persistent batch (resident sub-batches are on by default) and rejoined.
    assert len(cramped_engine.resident_batch_sizes()[0]) == 2
    scheduler = cramped_engine.psd_scheduler
    assert scheduler.core.subbatches.sizes() == (0, 0) and scheduler.core.planner.drafts == {}
