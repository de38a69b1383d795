"""benchmarks/draftless_steps.py's reading of a draft-job log (pure functions; the engine run itself is a benchmark)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("draftless_steps", ROOT / "benchmarks" / "draftless_steps.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("draftless_steps", module)  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def job(draft_s: float | None, abandoned: bool = False, newcomer: bool = False, idle_s: float = 0.005,
        budget_s: float | None = 0.010, sent_at: float = 0.0, arrived_at: float | None = None) -> dict[str, Any]:
    return {"sent_at": sent_at, "catch_up": 0, "requests": 16, "newcomer": newcomer, "abandoned": abandoned,
            "draft_s": draft_s, "arrived_at": arrived_at, "budget_s": budget_s if abandoned else None,
            "idle_s": None if draft_s is None else idle_s}


def test_each_abandoned_job_gets_the_cause_the_drafters_own_timings_show() -> None:
    bench = _benchmark()
    jobs = [
        job(0.060, abandoned=True, newcomer=True),  # a load's first job: every prompt at once
        job(0.006, abandoned=True, idle_s=0.0001),  # the drafter went straight from the abandoned one to it
        job(None, abandoned=True),  # never started: dropped from the drafter's queue behind an abandoned job
        job(0.006),
        job(0.020, abandoned=True, newcomer=True),  # its own drafting past the 10 ms budget
        job(0.006),
        job(0.015, abandoned=True),
        job(0.006),
        job(0.004, abandoned=True, idle_s=0.003),  # drafted within the budget, the drafter idle first: late start
        job(0.006),
        job(None, abandoned=True),  # dropped unstarted, though nothing abandoned was ahead of it: late start too
    ]
    assert bench.abandoned_kinds(jobs) == {"load_start": 1, "queued_behind_abandoned": 2, "newcomer_job_slow": 1,
                                           "steady_job_slow": 1, "late_start": 2}


def test_the_drafting_time_spread_is_each_job_over_its_shapes_median() -> None:
    bench = _benchmark()
    steady = [job(0.005 * f) for f in (1.0, 1.0, 1.0, 2.0, 0.5)]
    newcomers = [job(0.010 * f, newcomer=True) for f in (1.0, 1.0, 1.0, 3.0, 1.0)]
    deciles = bench.draft_time_spread(steady + newcomers + [job(None, abandoned=True)])
    assert len(deciles) == 11 and deciles[0] == 0.5 and deciles[-1] == 3.0
    assert deciles[5] == 1.0
    assert bench.draft_time_spread([job(0.005)] * 3) == [], "too few jobs of a shape to tell its median"


def test_a_newcomers_catch_up_price_is_read_from_the_jobs_of_the_loads_usual_size() -> None:
    bench = _benchmark()
    steady = [dict(job(0.006), catch_up=30) for _ in range(6)]
    # Jobs carrying a newcomer's 88-token prompt: 8 ms more for 88 tokens more (0.0909 ms a token).
    newcomers = [dict(job(0.014, newcomer=True), catch_up=118) for _ in range(3)]
    first = dict(job(0.060, newcomer=True), catch_up=1268)  # a load's first job: left out
    smaller = [dict(job(0.001), catch_up=5, requests=4) for _ in range(2)]  # the drain: not the usual size
    assert bench.newcomer_catch_up_ms_per_token([first, *steady, *newcomers, *smaller]) == 0.0909
    assert bench.newcomer_catch_up_ms_per_token(steady) is None, "no newcomer's job: no price"
