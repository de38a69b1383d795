"""Recalibrating the replica model from what a user has: `minedraft doctor --json` runs, or Prometheus history."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minedraft.operator.autoscale.history import HISTORY_QUERIES, Point, points_from_matrices, runs_from_points
from minedraft.operator.autoscale.replica_model import bench_datasets, calibrate

# Doctor-shaped runs of a made-up replica: ar steps of 20 ms + 1 ms per request; sd/psd at k=3 with accepted length
# 2.5 are dearer per cycle but yield more tokens.
LOADS = (1, 8, 32)


def ar_tps(c: int) -> float:
    return c / (0.020 + 0.001 * c)


def doctor_runs() -> list[dict]:
    runs = []
    for c in LOADS:
        runs.append({"mode": "ar", "k": 0, "concurrency": c, "tokens_per_second": ar_tps(c),
                     "mean_accepted_length": 1.0})
        for mode, factor in (("sd", 1.5), ("psd", 1.8)):
            runs.append({"mode": mode, "k": 3, "concurrency": c, "tokens_per_second": factor * ar_tps(c),
                         "mean_accepted_length": 2.5, "acceptance_rate": 0.5})
    return runs


def test_doctor_runs_become_benchmark_datasets_per_k() -> None:
    (data,) = bench_datasets({"checks": {}, "runs": doctor_runs()})
    assert data["config"]["num_speculative_tokens"] == 3
    by_load = {r["concurrency"]: r["modes"] for r in data["runs"]}
    assert set(by_load) == set(LOADS) and set(by_load[8]) == {"ar", "sd", "psd"}
    assert by_load[8]["sd"]["output_tokens_per_s"] == pytest.approx(1.5 * ar_tps(8))
    # A benchmark file passes through unchanged.
    bench = {"config": {"num_speculative_tokens": 3}, "runs": [{"concurrency": 1, "modes": {}}]}
    assert bench_datasets(bench) == [bench]


def test_a_model_calibrated_from_doctor_gives_back_the_measured_speeds(tmp_path: Path) -> None:
    path = tmp_path / "doctor.json"
    path.write_text(json.dumps({"runs": doctor_runs()}))
    model = calibrate([path], startup_seconds=90.0, max_batch=32)
    assert model.modes == ("ar", "sd", "psd") and model.startup_seconds == 90 and model.max_batch == 32
    for c in LOADS:
        assert model.tokens_per_second("ar", c, 0.0, 0) == pytest.approx(ar_tps(c), rel=1e-3)
    # Without draft seconds the draft is folded into verification: at the per-position acceptance whose L(3) is the
    # measured accepted length (2.5), the model gives back the measured sd and psd speeds.
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 1 + mid + mid**2 + mid**3 < 2.5 else (lo, mid)
    for c in LOADS:
        assert model.tokens_per_second("sd", c, lo, 3) == pytest.approx(1.5 * ar_tps(c), rel=1e-3)
        if c >= 2:  # one request leaves a sub-batch empty: the model runs it as sd
            assert model.tokens_per_second("psd", c, lo, 3) == pytest.approx(1.8 * ar_tps(c), rel=1e-3)


def test_history_points_are_binned_by_mode_k_and_load() -> None:
    points = [Point("psd", 3, 7.8 + 0.1 * i, 800 + i, 2.4, 0.004) for i in range(5)]
    points += [Point("ar", 0, 8.2, 400.0)] * 5
    points += [Point("sd", 3, 16, 900.0, 2.2)] * 2  # too few to count
    points += [Point("psd", 3, 0.0, 0.0)] * 10  # idle: no speed to learn
    runs = runs_from_points(points, min_points=5)
    assert [(r["mode"], r["k"], r["concurrency"]) for r in runs] == [("ar", 0, 8), ("psd", 3, 8)]
    psd = runs[1]
    assert psd["tokens_per_second"] == 802 and psd["mean_accepted_length"] == 2.4
    assert psd["draft_seconds_per_step"] == 0.004 and psd["points"] == 5
    assert runs[0]["mean_accepted_length"] == 1.0 and "draft_seconds_per_step" not in runs[0]


def test_history_leaves_lookahead_points_out_of_the_fit() -> None:
    """A replica running lookahead reports mode lookahead: its points are not the replica model's (which prices
    lookahead as psd) and must not bend psd's fit; they are left out, not mislabelled, and nothing fails."""
    points = [Point("lookahead", 3, 8.0, 2000.0, 3.0, 0.002)] * 6 + [Point("psd", 3, 8.0, 800.0, 2.4, 0.004)] * 5
    runs = runs_from_points(points, min_points=5)
    assert [(r["mode"], r["tokens_per_second"]) for r in runs] == [("psd", 800.0)]


def test_range_answers_are_joined_by_instance_and_time() -> None:
    def series(values: list[float], **labels: str) -> dict:
        return {"metric": {"instance": "a", **labels}, "values": [[100 + 30 * i, str(v)] for i, v in enumerate(values)]}

    results = {"running": [series([8, 8])], "tokens_per_second": [series([800, 810])],
               "mean_accepted_length": [series([2.4, 2.5])], "draft_seconds_per_step": [series([0.004, 0.004])],
               "k": [series([3, 3])], "mode": [series([1, 1], mode="psd")]}
    assert set(results) == set(HISTORY_QUERIES)
    points = sorted(points_from_matrices(results), key=lambda p: p.tokens_per_second)
    assert points == [Point("psd", 3, 8.0, 800.0, 2.4, 0.004), Point("psd", 3, 8.0, 810.0, 2.5, 0.004)]


def test_calibrate_prints_the_capacity_prior_for_the_crd(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`minedraft autoscale calibrate` ends with spec.autoscaling.replicaCapacityTokensPerSecond: the model's full
    batch at a few acceptances (the figure the autoscaler uses until it has measured a speed)."""
    from minedraft.cli import main

    path = tmp_path / "doctor.json"
    path.write_text(json.dumps({"runs": doctor_runs()}))
    out = tmp_path / "model.json"
    assert main(["autoscale", "calibrate", "--bench", str(path), "--startup-seconds", "90", "--max-batch", "32",
                 "--out", str(out)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "replicaCapacityTokensPerSecond" in line]
    assert len(lines) == 3
    from minedraft.operator.autoscale.replica_model import ReplicaModel

    model = ReplicaModel.load(out)
    assert f"at acceptance 0.6: {model.best(32, 0.6)[0]:.0f} (full batch of 32)" in lines[1]
