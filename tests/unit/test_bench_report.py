"""The benchmark report's derived figures: crossovers by load and auto's ratios."""

from __future__ import annotations

from typing import Any

import pytest

from minedraft.bench.report import composed_trace_rates, crossovers, markdown_table, switching_bound


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


CONFIG = {"modes": ["ar", "vllm-sd", "sd", "psd", "auto"], "target_model": "t", "draft_model": "d",
          "num_prompts": 8, "max_tokens": 16, "num_speculative_tokens": 3, "num_extra_draft_tokens": 0,
          "rounds": 2, "target_cpu_cores": [0], "drafter_cpu_cores": [1], "baseline_cpu_cores": [0, 1]}


def test_auto_is_compared_with_the_best_fixed_mode_and_the_best_it_can_choose() -> None:
    report = {
        "config": CONFIG,
        "runs": [{"concurrency": 4, "greedy_outputs_identical": True, "modes": {
            "ar": _mode(100.0), "vllm-sd": _mode(200.0, output_tokens_per_s_by_round=[180.0, 220.0]),
            "sd": _mode(160.0), "psd": _mode(120.0),
            "auto": _mode(150.0, output_token_share_by_mode={"sd": 0.9, "psd": 0.1}, mode_switches=2,
                          output_tokens_per_s_by_round=[162.0, 143.0])}}],
    }
    text = markdown_table(report)
    assert ("auto = **0.75x** the best fixed mode (vllm-sd) (by round: 0.90, 0.65), **0.94x** the best of the modes "
            "it chooses among (sd)") in text
    assert "sd 90%, psd 10%; switches: 2" in text


def test_table_rows_have_as_many_cells_as_the_header_without_ratio_columns() -> None:
    report = {"config": {**CONFIG, "modes": ["psd", "auto"]}, "runs": [
        {"concurrency": 1, "greedy_outputs_identical": True, "modes": {"psd": _mode(10.0), "auto": _mode(9.0)}}]}
    rows = [line for line in markdown_table(report).splitlines() if line.startswith("| ")]
    assert len(rows) == 3
    assert len({row.count("|") for row in rows}) == 1


def _levels_and_trace(trace_label: str) -> dict[str, Any]:
    levels = {1: {"ar": 50.0, "sd": 100.0, "psd": 80.0}, 32: {"ar": 400.0, "sd": 200.0, "psd": 300.0}}
    runs = [{"concurrency": c, "greedy_outputs_identical": True,
             "modes": {**{name: _mode(rate) for name, rate in rates.items()}, "auto": _mode(1.0)}}
            for c, rates in levels.items()]
    runs.append({"concurrency": f"trace {trace_label}", "greedy_outputs_identical": True,
                 "modes": {name: _mode(1.0) for name in ("ar", "sd", "psd", "auto")}})
    return {"config": {**CONFIG, "modes": ["ar", "sd", "psd", "auto"]}, "runs": runs}


def test_the_trace_is_composed_from_the_levels_with_the_best_mode_per_phase_as_the_bound() -> None:
    # 10 requests at 1 (sd best, 100 tok/s) and 40 at 32 (ar best, 400 tok/s), in request-units per second.
    composed = composed_trace_rates(_levels_and_trace("1:10,32:40"))
    assert composed is not None
    assert composed["sd"] == pytest.approx(50 / (10 / 100 + 40 / 200))
    assert composed["ar"] == pytest.approx(50 / (10 / 50 + 40 / 400))
    assert composed["psd"] == pytest.approx(50 / (10 / 80 + 40 / 300))  # the best single mode over the trace
    assert composed["oracle"] == pytest.approx(50 / (10 / 100 + 40 / 400))
    text = markdown_table(_levels_and_trace("1:10,32:40"))
    assert f"best single fixed mode psd {composed['psd']:.1f} tok/s" in text
    assert f"**{composed['oracle'] / composed['psd']:.2f}x**" in text
    # A phase at a concurrency the run did not measure as a level: no composition.
    assert composed_trace_rates(_levels_and_trace("1:10,8:40")) is None


def test_the_switching_bound_is_the_best_trace_against_the_best_single_mode() -> None:
    # sd wins at 1 (2x ar), ar wins at 32 (1.25x sd). Per token: sd = f/100 + (1-f)/400, ar = f/50 + (1-f)/500,
    # switching = f/100 + (1-f)/500. sd and ar tie at f = 1/21, where the best single mode is 1.2x slower.
    rates = {1: {"ar": 50.0, "sd": 100.0, "psd": 80.0}, 32: {"ar": 500.0, "sd": 400.0, "psd": 300.0}}
    bound = switching_bound(rates)
    assert bound is not None
    gain, mix = bound
    assert gain == pytest.approx(1.2)
    assert mix == pytest.approx({1: 1 / 21, 32: 20 / 21})
    # A third load where psd is best can only add to what switching gains.
    rates[8] = {"ar": 200.0, "sd": 200.0, "psd": 400.0}
    assert switching_bound(rates)[0] > 1.2
    # Where one mode is best at every load, switching gains nothing.
    assert switching_bound({1: {"ar": 1.0, "sd": 2.0, "psd": 3.0}, 8: {"ar": 2.0, "sd": 3.0, "psd": 4.0}})[0] == \
        pytest.approx(1.0)
