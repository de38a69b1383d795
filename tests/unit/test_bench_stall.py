"""The stall benchmark's analysis: per-stream gaps around a drafter stop against the target (pure: no engines)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from minedraft.bench import stall, steps
from minedraft.engine.control.stats import StepRecord


def record(started_at: float, step_seconds: float = 0.05, wait: float = 0.0, draft: float = 0.04,
           with_drafts: int = 4, prefill: int = 0, step: int | None = None, group: int = 0,
           first_token: float = 0.0) -> StepRecord:
    return StepRecord(
        step=int(started_at * 1000) if step is None else step, started_at=started_at, mode="psd",
        verified_group=group, group_sizes=(4, 4),
        num_decode_requests=4, num_prefill_requests=prefill, num_requests_with_drafts=with_drafts,
        num_draft_tokens=3 * with_drafts, num_accepted_tokens=with_drafts, drafted_per_position=(),
        accepted_per_position=(), num_output_tokens=8, num_scheduled_tokens=16, verify_seconds=0.04,
        wait_seconds=wait, draft_seconds=draft, drafter_idle_seconds=0.0, schedule_seconds=0.001,
        step_seconds=step_seconds, drafter_up=True, k=3, draft_first_token_seconds=first_token,
    )


WINDOW = stall.Window(baseline_from=0.0, stopped_at=1.0, continued_at=2.0, ended_at=3.0)


def every(start: float, end: float, period: float) -> list[float]:
    return [round(start + i * period, 6) for i in range(round((end - start) / period) + 1)]


def test_gaps_are_measured_per_stream_and_judged_against_twice_the_step_plus_100ms() -> None:
    deliveries = {
        # Waited through the first half of the stop: one 0.6 s gap overlapping it.
        "slow": [*every(0.0, 0.9, 0.1), 1.5, *every(1.6, 3.0, 0.1)],
        # Served on through the stop at its usual pace.
        "fine": every(0.0, 3.0, 0.1),
        # A long gap before the stop (prefill, say) is not the stop's doing.
        "late": [0.0, 0.7, *every(0.8, 3.0, 0.1)],
    }
    # Baseline steps of 50 ms (one prefill step of 400 ms is not a decode step); slow steps during the stop.
    records = [record(0.05 * i) for i in range(20)] + [record(0.5, step_seconds=0.4, prefill=2)]
    records += [record(1.0 + 0.2 * i, step_seconds=0.2, wait=0.12, draft=0.0, with_drafts=0) for i in range(5)]
    records += [record(2.05, with_drafts=0, draft=0.0), record(2.3)]
    result = stall.analyse(deliveries, records, WINDOW, restarts=0, hangs=0, deadline_misses=5)
    assert result["median_step_before_seconds"] == pytest.approx(0.05)
    assert result["target_gap_seconds"] == pytest.approx(2 * 0.05 + 0.1)
    by = {s["stream"]: s for s in result["streams"]}
    assert by["slow"]["max_gap_during_stop_seconds"] == pytest.approx(0.6)
    assert by["slow"]["ratio_to_target"] == pytest.approx(0.6 / 0.2)
    assert by["fine"]["ratio_to_target"] == pytest.approx(0.1 / 0.2)
    assert by["late"]["max_gap_during_stop_seconds"] == pytest.approx(0.1)
    assert by["late"]["max_gap_before_seconds"] == pytest.approx(0.7)
    assert by["fine"]["tokens_during_stop"] == 10 and by["slow"]["tokens_during_stop"] == 6
    assert result["streams_over_target"] == 1 and result["streams_measured"] == 3
    assert result["max_ratio_to_target"] == pytest.approx(3.0)
    assert result["median_step_during_stop_seconds"] == pytest.approx(0.2)
    assert result["max_wait_during_stop_seconds"] == pytest.approx(0.12)
    # Drafting resumed with the first step after SIGCONT that verified drafts (not the one without).
    assert result["drafting_resumed"] and result["drafts_resumed_after_seconds"] == pytest.approx(0.3)
    # Baseline overlap: no waits while drafting 40 ms per 40 ms verification.
    assert result["baseline_overlap_fraction"] == pytest.approx(1.0)
    assert result["baseline_draft_per_verify"] == pytest.approx(1.0)
    assert result["deadline_misses"] == 5


def test_drafting_that_never_resumes_is_reported() -> None:
    records = [record(0.1 * i) for i in range(10)] + [record(2.0 + 0.1 * i, with_drafts=0, draft=0.0)
                                                      for i in range(10)]
    result = stall.analyse({"a": every(0.0, 3.0, 0.1)}, records, WINDOW, restarts=1, hangs=1, deadline_misses=2)
    assert not result["drafting_resumed"] and result["drafts_resumed_after_seconds"] is None
    assert (result["drafter_restarts"], result["drafter_hangs_detected"]) == (1, 1)


def test_overlap_in_the_step_breakdown_counts_waits_that_ended_without_drafts() -> None:
    # Two steps drafted 40 ms each and waited 10 ms; one waited its whole 30 ms budget and got nothing.
    records = [record(0.0, wait=0.01), record(0.1, wait=0.01), record(0.2, wait=0.03, draft=0.0, with_drafts=0)]
    figures = steps.overlap(records)
    assert figures["overlap_fraction"] == pytest.approx(1 - 0.05 / 0.08)
    assert figures["draft_per_verify"] == pytest.approx(0.08 / 0.08)
    assert figures["steps_with_drafts_share"] == pytest.approx(2 / 3)
    assert figures["catch_up_steps"] == 0 and figures["steady_overlap_fraction"] == figures["overlap_fraction"]


def test_steady_overlap_leaves_out_jobs_that_caught_up_on_prompts() -> None:
    # A short run's first job reads whole prompts (400 of its 500 ms before the first drafted token) and is waited
    # for; the steady steps behind it draft 40 ms each and never wait.
    records = [record(0.0, wait=0.45, draft=0.5, first_token=0.4), *(record(0.1 * i) for i in range(1, 5))]
    figures = steps.overlap(records)
    assert figures["overlap_fraction"] == pytest.approx(1 - 0.45 / 0.66)
    assert figures["steady_overlap_fraction"] == pytest.approx(1.0) and figures["catch_up_steps"] == 1


def test_step_breakdown_tells_waits_drafting_explains_from_time_lost_elsewhere() -> None:
    records = [
        record(0.00, step=1, group=0), record(0.05, step=2, group=1),
        # Its job was sent when step 1 ended (0.05) and drafted 80 ms: 30 ms past step 3's start, all of its wait.
        record(0.10, step=3, group=0, draft=0.08, wait=0.03, step_seconds=0.08),
        # Sent at 0.10, drafted 20 ms, had 80 ms: its 20 ms wait is not drafting's doing.
        record(0.18, step=4, group=1, draft=0.02, wait=0.02),
    ]
    assert steps.overlap(records)["wait_explained_share"] == pytest.approx(0.03 / 0.05)
    # Step 4's job was sent at 0.10 but queued behind step 3's, which the drafter finished at 0.13 (step 3 waited
    # until then): had the job drafted 70 ms, 20 ms of step 4's wait would be drafting's.
    queued = [*records[:3], record(0.18, step=4, group=1, draft=0.07, wait=0.02)]
    assert steps.overlap(queued)["wait_explained_share"] == pytest.approx(1.0)


def _results() -> dict[str, Any]:
    records = [record(0.05 * i) for i in range(20)]
    deliveries = {"s-0": every(0.0, 3.0, 0.1), "s-1": [*every(0.0, 0.9, 0.1), 2.5, 2.6]}
    summary = stall.analyse(deliveries, records, WINDOW, restarts=1, hangs=1, deadline_misses=3)
    timeline = {"deliveries": deliveries, "steps": [[r.started_at, r.step_seconds, r.wait_seconds,
                                                     r.num_requests_with_drafts, 0] for r in records],
                "window": {"baseline_from": 0.0, "stopped_at": 1.0, "continued_at": 2.0, "ended_at": 3.0}}
    return {"config": {"command": "minedraft bench stall"},
            "scenarios": [{"scenario": "hang", "stop_seconds": 1.0, "hang_seconds": 0.5, **summary,
                           "timeline": timeline}]}


def test_report_and_plot(tmp_path: Path) -> None:
    results = _results()
    text = stall.markdown(results)
    assert "| hang | 1 | 0.5 | 50 | 200 | 1600 | 8.00 | 1/2 | 1 | 1 | 3 | never |" in text
    assert "| s-1 | 100 | 100 | 1600 | 0 | 100 | 8.00 |" in text
    assert json.loads(stall.to_json(results)) == results
    stall.plot(results, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
