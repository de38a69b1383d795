"""The drafter-stall benchmark's measuring loop on the shared psd engine: a real SIGSTOP of the real drafter process.

What the unit tests of the analysis cannot show: that the benchmark stops and continues the engine's actual drafter,
that every stream keeps receiving tokens while it is stopped (the engine never freezes on a silent drafter), that a
stop shorter than the hang threshold restarts nothing, and that drafting resumes by itself after SIGCONT.
"""

from __future__ import annotations

import pytest

from .patience import measured_waits

pytestmark = pytest.mark.engine


def test_a_stopped_drafter_freezes_no_stream_and_drafting_resumes_after_it(psd, pair_dir, tmp_path):
    from minedraft.bench import stall
    from minedraft.bench.workload import bench_prompts

    prompts = [psd.encode_prompt(p) for p in bench_prompts(pair_dir, 4, chars=120)]
    # The production wait policy (the shared engine waits for its drafts otherwise): lateness is what this measures.
    with measured_waits(psd):
        hang_seconds = psd.psd_scheduler.link.hang_seconds
        # Two seconds stopped: a stream goes without a token that long only if the engine held it through the stop.
        row = stall.run_scenario(psd, prompts, stall.Scenario("stop", 2.0, None), baseline_seconds=1.0,
                                 after_seconds=0.2, tag="stall-test", resume_timeout_seconds=120.0)
    assert hang_seconds > 2.0, "the stop must be shorter than the hang threshold for this scenario"
    assert (row["drafter_restarts"], row["drafter_hangs_detected"]) == (0, 0)
    assert row["deadline_misses"] > 0, "steps during the stop went on without the late drafts"
    measured = [s for s in row["streams"] if s["max_gap_during_stop_seconds"] is not None]
    # Every prompt's stream was measured through the stop (a stream that reached its length meanwhile was replaced on
    # the same prompt, "-rN", and its replacement is measured too).
    assert {s["stream"].split("-r")[0] for s in measured} == {f"stall-test-{i}" for i in range(len(prompts))}, measured
    assert all(s["tokens_during_stop"] > 0 for s in measured), row["streams"]
    assert row["drafting_resumed"], "drafts came back after SIGCONT without a restart"
    assert not psd.has_unfinished_requests()
    results = {"config": {"command": "test"}, "scenarios": [row]}
    assert "| stop | 2 |" in stall.markdown(results)
