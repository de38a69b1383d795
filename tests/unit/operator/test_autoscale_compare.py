"""The comparison pools both policies over traces and seeds: figures match the simulations run one by one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minedraft.operator.autoscale.compare import compare, hpa_targets, markdown
from minedraft.operator.autoscale.replica_model import ReplicaModel
from minedraft.operator.autoscale.simulate import SimConfig, load_trace, simulate

ROOT = Path(__file__).resolve().parents[3]
MODEL_PATH = ROOT / "benchmarks" / "autoscale" / "replica-model.json"
SEEDS = (0, 1)


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two four-minute traces: a step from 10 to 40 requests/s and an acceptance drop."""
    folder = tmp_path_factory.mktemp("traces")
    rows = {
        "step": [{"config": {"duration_seconds": 240, "max_replicas": 10, "event_seconds": 60}},
                 {"t": 0, "arrival_rps": 10, "prompt_tokens": 64, "output_tokens": 64, "acceptance_rate": 0.6},
                 {"t": 60, "arrival_rps": 40, "prompt_tokens": 64, "output_tokens": 64, "acceptance_rate": 0.6}],
        "drop": [{"config": {"duration_seconds": 240, "max_replicas": 10}},
                 {"t": 0, "arrival_rps": 20, "prompt_tokens": 64, "output_tokens": 64, "acceptance_rate": 0.9},
                 {"t": 90, "arrival_rps": 20, "prompt_tokens": 64, "output_tokens": 64, "acceptance_rate": 0.2}],
    }
    for name, lines in rows.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


@pytest.fixture(scope="module")
def summary(traces: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("out")
    return compare(traces, MODEL_PATH, out, SEEDS, 0.8, plots=False, sweep_utilization=False, workers=1)


def _one_by_one(traces: Path, config: dict) -> tuple[float, float]:
    """(mean replica-seconds per seed, request-weighted violation fraction) from simulate() itself."""
    model = ReplicaModel.load(MODEL_PATH)
    results = [simulate(load_trace(p), model, SimConfig(seed=seed, **config))
               for p in sorted(traces.glob("*.jsonl")) for seed in SEEDS]
    requests = sum(r.requests for r in results)
    violations = sum(r.slo_violation_fraction * r.requests for r in results)
    return sum(r.replica_seconds for r in results) / len(SEEDS), violations / requests


def test_overall_figures_pool_every_trace_and_seed(traces: Path, summary: dict) -> None:
    replica_seconds, violations = _one_by_one(traces, {"policy": "minedraft", "target_utilization": 0.8})
    assert summary["overall"]["minedraft"]["replica_seconds"] == pytest.approx(replica_seconds, abs=0.1)
    assert summary["overall"]["minedraft"]["slo_violation_fraction"] == pytest.approx(violations, abs=1e-6)
    target = summary["hpa_target_per_pod"]
    replica_seconds, violations = _one_by_one(traces, {"policy": "hpa-queue", "hpa_target_per_pod": target})
    assert summary["overall"]["hpa-queue"]["replica_seconds"] == pytest.approx(replica_seconds, abs=0.1)
    by_seed = summary["overall_by_seed"]["minedraft"]
    assert sorted(by_seed) == ["0", "1"]
    assert sum(v["replica_seconds"] for v in by_seed.values()) / 2 == pytest.approx(
        summary["overall"]["minedraft"]["replica_seconds"], abs=0.1)


def test_the_hpa_target_is_the_cheapest_meeting_the_slo(summary: dict) -> None:
    sweep = summary["hpa_sweep"]
    assert [s["target"] for s in sweep] == list(hpa_targets(32))
    meeting = [s for s in sweep if s["slo_violation_fraction"] <= 0.01]
    assert meeting and summary["hpa_target_per_pod"] == min(meeting, key=lambda s: s["replica_seconds"])["target"]


def test_per_trace_rows_and_markdown_name_the_seeds(summary: dict) -> None:
    row = next(r for r in summary["traces"] if r["trace"] == "step")
    assert len(row["minedraft"]["slo_violation_fraction_by_seed"]) == len(SEEDS)
    assert row["minedraft"]["first_reaction_seconds"] is not None
    text = markdown(summary, "minedraft autoscale compare")
    assert "seeds of the Poisson arrivals: 0, 1" in text and "| step | minedraft |" in text


def test_a_process_pool_gives_the_same_figures(traces: Path, summary: dict, tmp_path: Path) -> None:
    pooled = compare(traces, MODEL_PATH, tmp_path, SEEDS, 0.8, plots=False, sweep_utilization=False, workers=2)
    assert pooled["overall"] == summary["overall"] and pooled["hpa_sweep"] == summary["hpa_sweep"]


def test_minedraft_tuned_by_the_hpas_rule_is_reported_beside_the_default(traces: Path, tmp_path: Path) -> None:
    """On the acceptance drop alone some utilisations meet the SLO: the cheapest of them is reported as tuned. With
    the step as well, none does (its first minute overloads whatever the utilisation): no tuned variant."""
    drop_only = tmp_path / "drop"
    drop_only.mkdir()
    (drop_only / "drop.jsonl").write_text((traces / "drop.jsonl").read_text())
    summary = compare(drop_only, MODEL_PATH, tmp_path / "out", SEEDS, 0.8, plots=False, workers=1)
    meeting = [u for u in summary["utilization_sweep"] if u["slo_violation_fraction"] <= 0.01]
    cheapest = min(meeting, key=lambda u: u["replica_seconds"])
    assert cheapest["target_utilization"] != 0.8
    assert summary["minedraft_tuned_target_utilization"] == cheapest["target_utilization"]
    assert summary["variants"][:2] == ["minedraft", "minedraft (tuned)"]
    assert summary["overall"]["minedraft (tuned)"] == {k: cheapest[k] for k in summary["overall"]["minedraft"]}
    assert "minedraft (tuned) uses" in markdown(summary, "minedraft autoscale compare")
    both = compare(traces, MODEL_PATH, tmp_path / "both", SEEDS, 0.8, plots=False, workers=1)
    assert all(u["slo_violation_fraction"] > 0.01 for u in both["utilization_sweep"])
    assert both["minedraft_tuned_target_utilization"] is None and "minedraft (tuned)" not in both["variants"]
