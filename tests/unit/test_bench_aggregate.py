"""Pooling one mode's rounds into its headline figures (pure: no engines)."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from minedraft.bench.runner import Run, aggregate
from minedraft.engine.control.stats import EngineTotals
from minedraft.engine.settings import Mode


def _request(num_tokens: int, tpot: float) -> dict[str, object]:
    return {"token_ids": list(range(num_tokens)), "ttft_seconds": 0.05, "tpot_seconds": tpot, "e2e_seconds": 1.0,
            "num_draft_tokens": 0, "num_accepted_tokens": 0}


def test_auto_rounds_pool_tokens_by_mode_and_keep_each_rounds_decisions() -> None:
    totals = asdict(EngineTotals(steps=10, draft_tokens=30, accepted_tokens=15, drafted_per_position=[10, 10, 10],
                                 accepted_per_position=[8, 5, 2], mode_switches=1))
    decision = {"step": 7, "kind": "switch", "to": "sd k=3"}
    runs = [
        Run([_request(32, 0.01)] * 4, 2.0, totals, {"psd k=3": 96, "sd k=3": 32}, [decision]),
        Run([_request(32, 0.02)] * 4, 2.0, totals, {"sd k=3": 128}, []),
    ]
    figures = aggregate(Mode.AUTO, runs, config_k=3)
    assert figures["output_tokens_per_s"] == pytest.approx(256 / 4.0)
    assert figures["output_tokens_per_s_by_round"] == pytest.approx([128 / 2.0, 128 / 2.0])
    assert figures["output_token_share_by_mode"] == {"psd k=3": 0.375, "sd k=3": 0.625}
    assert figures["mode_switches"] == 2
    assert figures["decisions_by_round"] == [[decision], []]
    assert figures["acceptance_rate"] == pytest.approx(0.5)
    assert figures["mean_accepted_length"] == pytest.approx(2.5)
