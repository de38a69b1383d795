"""The benchmark report's derived figures: crossovers by load and auto's ratios."""

from __future__ import annotations

from typing import Any

from minedraft.bench.report import crossovers, markdown_table


def test_crossovers_are_the_first_load_from_which_a_condition_holds_for_good() -> None:
    rates = {
        1: {"ar": 50.0, "sd": 120.0, "psd": 100.0},
        4: {"ar": 150.0, "sd": 260.0, "psd": 270.0},  # psd ahead here, behind again at 8: not the crossover
        8: {"ar": 300.0, "sd": 400.0, "psd": 390.0},
        16: {"ar": 600.0, "sd": 500.0, "psd": 560.0},
        32: {"ar": 900.0, "sd": 600.0, "psd": 700.0},
    }
    assert crossovers(rates) == {"psd_overtakes_sd": 16, "speculation_stops_paying": 16}
    assert crossovers({1: {"ar": 1.0, "sd": 2.0, "psd": 1.5}}) == {"psd_overtakes_sd": None,
                                                                   "speculation_stops_paying": None}


def _mode(rate: float, **extra: Any) -> dict[str, Any]:
    return {"output_tokens_per_s": rate, "ttft_p50_s": 0.01, "ttft_p99_s": 0.02, "tpot_p50_s": 0.01,
            "tpot_p99_s": 0.02, "e2e_p50_s": 0.1, "e2e_p99_s": 0.2, "acceptance_rate": 0.5,
            "mean_accepted_length": 2.0, "overlap_fraction": 0.0, **extra}


def test_auto_is_compared_with_the_best_fixed_mode_and_the_best_it_can_choose() -> None:
    report = {
        "config": {"modes": ["ar", "vllm-sd", "sd", "psd", "auto"], "target_model": "t", "draft_model": "d",
                   "num_prompts": 8, "max_tokens": 16, "num_speculative_tokens": 3, "num_extra_draft_tokens": 0,
                   "rounds": 1, "target_cpu_cores": [0], "drafter_cpu_cores": [1], "baseline_cpu_cores": [0, 1]},
        "runs": [{"concurrency": 4, "greedy_outputs_identical": True, "modes": {
            "ar": _mode(100.0), "vllm-sd": _mode(200.0), "sd": _mode(160.0), "psd": _mode(120.0),
            "auto": _mode(150.0, output_token_share_by_mode={"sd": 0.9, "psd": 0.1}, mode_switches=2)}}],
    }
    text = markdown_table(report)
    assert "auto = **0.75x** the best fixed mode (vllm-sd), **0.94x** the best of the modes it chooses among (sd)" \
        in text
    assert "sd 90%, psd 10%; switches: 2" in text
