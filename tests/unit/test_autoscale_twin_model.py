"""One model of a replica: `minedraft autoscale simulate --curves` builds the simulator's replica from the twin, and its
per-replica capacity agrees with `minedraft plan` on the same file (the H200 curves). Three small twin sweeps (two
loads each): ~20 s of CPU."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from minedraft.operator.autoscale.replica_model import TableReplicaModel, load_replica_model
from minedraft.operator.autoscale.simulate import SimConfig, load_trace, simulate
from minedraft.twin.autoscale_model import (
    TwinModelSettings,
    auto_tokens_per_second,
    plan_arguments,
    replica_model_from_curves,
)
from minedraft.twin.cli import run_plan

ROOT = Path(__file__).resolve().parents[2]
CURVES = str(ROOT / "benchmarks" / "curves" / "h200-qwen3-32b.json")
# Only the auto entry of plan's sweep makes the replica model: the fixed families are left to ar alone, the
# cheapest, so the sweeps stay small (every family at every k took ~170 s once lookahead joined them).
SETTINGS = TwinModelSettings(CURVES, "qwen3-32b", "qwen3-1.7b", loads=(16, 64), acceptances=(0.6, 0.8),
                             prompt_tokens=1024, output_tokens=256, plan_flags=("--modes", "ar"))


@pytest.fixture(scope="module")
def model() -> TableReplicaModel:
    return replica_model_from_curves(SETTINGS, progress=False)


def test_the_replica_model_is_plans_figures(model: TableReplicaModel) -> None:
    """At the grid's loads and acceptances the model's decode capacity is plan's auto entry (prefill left out, as the
    simulator prices it apart), its KV cache plan's pool, its prefill the twin's per-token price; the start-up is
    labelled an estimate."""
    assert model.loads == (16.0, 64.0) and model.acceptances == (0.6, 0.8) and model.max_batch == 256
    assert model.kv_capacity_tokens is not None and 200_000 < model.kv_capacity_tokens < 300_000  # H200, 32B
    assert 0.05e-3 < model.prefill_seconds_per_token < 0.3e-3
    # 60 s + 69.6 GB of weights at 1 GB/s.
    assert model.startup_seconds == pytest.approx(60 + 69.6, abs=1.0)
    assert any(a.startswith("startup_seconds") and "an estimate, not measured" in a for a in model.assumptions)
    assert model.slots(6144, 256) == 40  # ~259k tokens / 6,400: the KV cache, not --max-num-seqs, limits
    # A round trip through the file `--save-model` writes.
    assert TableReplicaModel.from_json(json.loads(json.dumps(model.to_json()))) == model


def test_capacity_agrees_with_plan_within_5_percent(model: TableReplicaModel, tmp_path: Path) -> None:
    """Against `minedraft plan` with its defaults (prefill priced) at an acceptance between the model's grid
    points: the model's decode capacity, interpolated, with each request's prefill time-shared as the simulator
    does, within 5% of plan's auto at each load."""
    plan = auto_tokens_per_second(run_plan(plan_arguments(SETTINGS, (16, 64), 0.7, prefill=True)))
    assert [load for load, _, _, _ in plan] == [16, 64]
    for load, tokens_per_s, _, _ in plan:
        ours = model.capacity_with_prefill(load, 0.7, 1024, 256)
        assert ours == pytest.approx(tokens_per_s, rel=0.05), (load, ours, tokens_per_s)
    # The saved model is the one the simulator loads (`--replica-model` after `--save-model`).
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(model.to_json()))
    assert load_replica_model(path) == model


def test_the_simulator_runs_on_the_twins_replica(model: TableReplicaModel) -> None:
    """The growing-prompt trace on the H200 replica (max_batch 256): the prompt signals keep the first-token
    target where output tokens/s alone does not (a quarter of the hour, to keep it short)."""
    trace = load_trace(ROOT / "benchmarks" / "autoscale" / "traces" / "growing-prompts.jsonl")
    trace = replace(trace, duration_seconds=900.0, rows=tuple(replace(r, arrival_rps=r.arrival_rps * 8,
                                                                      prompt_tokens=r.prompt_tokens * 4)
                                                            for r in trace.rows))
    ours = simulate(trace, model, SimConfig())
    assert ours.startup_seconds == model.startup_seconds and ours.requests > 0
    assert ours.removed_before_ready == 0 and ours.scale_downs_soon_after_scale_up == 0
