"""The replica model: calibration from a small synthetic benchmark JSON, with numbers computed by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from minedraft.operator.autoscale.replica_model import (
    ReplicaModel,
    acceptance_rate_metric,
    accepted_length,
    calibrate,
    evaluate,
    fit_curve,
)

# The curves the synthetic benchmark is made from (k = 3, accepted length 2.5 in sd and psd):
#   t_ar (ar step)      c=1: 0.011 s, c=4: 0.014 s, c=8: 0.018 s (so 0.012 s at c=2, by interpolation)
#   f (draft forward)   0.002 + 0.0005 c: sd drafts c requests (3 f per step), a psd half-step the other c / 2
#   e (per drafted pos) c=1: 0.001 s, c=4: 0.002 s, c=8: 0.004 s; W(c, k) = t_ar(c) + k e(c)
#   sd cycle = 3 f(c) + W(c, 3): c=1: 0.0075 + 0.014 = 0.0215 s, c=4: 0.012 + 0.020 = 0.032 s,
#                                c=8: 0.018 + 0.030 = 0.048 s
#   r (psd half-step / W): h=2: 1.5, h=4: 1.25; psd cycle = 2 r(h) W(h, 3), h = c / 2:
#       c=4: W(2, 3) = 0.012 + 3 x 0.0013333 = 0.016 -> 2 x 0.024 = 0.048 s (draft of 2: 0.009 s, hidden)
#       c=8: W(4, 3) = 0.020 -> 2 x 0.025 = 0.050 s (draft of 4: 0.012 s, hidden)
# tokens/s = c x accepted length / cycle.


def _mode(tps: float, length: float = 1.0, draft: float | None = None) -> dict[str, Any]:
    figures: dict[str, Any] = {"output_tokens_per_s": tps, "mean_accepted_length": length}
    if draft is not None:
        figures["draft_seconds_per_step"] = draft
    return figures


SYNTHETIC = {
    "config": {"num_speculative_tokens": 3},
    "runs": [
        {"concurrency": 1, "modes": {"ar": _mode(1 / 0.011), "sd": _mode(2.5 / 0.0215, 2.5, 0.0075),
                                     # one request: psd has one side empty; neither its draft nor its cycle is
                                     # psd's (left out of the fit, so this absurd figure changes nothing)
                                     "psd": _mode(1.0, 2.5, 1.0)}},
        {"concurrency": 4, "modes": {"ar": _mode(4 / 0.014), "sd": _mode(10 / 0.032, 2.5, 0.012),
                                     "psd": _mode(10 / 0.048, 2.5, 0.009)}},
        {"concurrency": 8, "modes": {"ar": _mode(8 / 0.018), "sd": _mode(20 / 0.048, 2.5, 0.018),
                                     "psd": _mode(20 / 0.050, 2.5, 0.012)}},
        {"concurrency": "trace 1:8", "modes": {"ar": _mode(1.0)}},  # a trace run: ignored
    ],
}


@pytest.fixture
def model(tmp_path: Path) -> ReplicaModel:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(SYNTHETIC))
    return calibrate([path], startup_seconds=30.0)


def _points(curve: tuple[tuple[float, float], ...]) -> list[tuple[float, float]]:
    return [(x, pytest.approx(y, abs=2e-7)) for x, y in curve]


def test_accepted_length_is_geometric_in_per_position_acceptance() -> None:
    assert accepted_length(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert accepted_length(0.5, 1) == pytest.approx(1.5)
    assert accepted_length(0.0, 5) == 1.0 and accepted_length(1.0, 4) == 5.0
    # The engines' metric (accepted / drafted) at per-position 0.8, k = 3: 1.952 / 3.
    assert acceptance_rate_metric(0.8, 3) == pytest.approx(0.650667, abs=1e-6)


def test_calibration_recovers_the_curves(model: ReplicaModel) -> None:
    assert _points(model.ar_step) == [(1.0, 0.011), (4.0, 0.014), (8.0, 0.018)]
    # sd at 4 requests and psd's half of 8 both drafted 4: averaged (equal here).
    assert _points(model.draft_forward) == [(1.0, 0.0025), (2.0, 0.003), (4.0, 0.004), (8.0, 0.006)]
    assert _points(model.sd_extra_per_draft) == [(1.0, 0.001), (4.0, 0.002), (8.0, 0.004)]
    assert [(x, pytest.approx(y, abs=1e-5)) for x, y in model.psd_ratio] == [(2.0, 1.5), (4.0, 1.25)]
    assert model.max_batch == 8 and model.modes == ("ar", "sd", "psd") and model.startup_seconds == 30.0
    assert model.calibrated_from == ("bench.json",)


def test_calibration_reproduces_the_measured_rates(model: ReplicaModel) -> None:
    # At the benchmark's own acceptance (accepted length 2.5 with k = 3), each mode's modelled rate is the measured.
    a = 0.5
    while accepted_length(a, 3) < 2.5:
        a += 1e-6
    assert model.tokens_per_second("ar", 4, a, 0) == pytest.approx(4 / 0.014, rel=1e-4)
    assert model.tokens_per_second("sd", 8, a, 3) == pytest.approx(20 / 0.048, rel=1e-4)
    assert model.tokens_per_second("psd", 8, a, 3) == pytest.approx(20 / 0.050, rel=1e-4)


def test_best_of_ar_sd_psd_by_hand(model: ReplicaModel) -> None:
    # Batch 4, per-position acceptance 0.5: ar 4 / 0.014 = 285.7 tok/s; sd(k): cycle k f(4) + t_ar(4) + k e(4) =
    # 0.014 + 0.006 k: k=1 0.020 s for 4 x 1.5 tokens = 300 tok/s, k=2 7 / 0.026 = 269.2; psd k=1: 2 x 1.5 x
    # W(2, 1) = 2 x 1.5 x (0.012 + 0.0013333) = 0.040 s for 6 tokens = 150 tok/s.
    tps, mode, k = model.best(4, 0.5)
    assert (mode, k) == ("sd", 1) and tps == pytest.approx(300, rel=1e-4)
    assert model.tokens_per_second("sd", 4, 0.5, 2) == pytest.approx(7 / 0.026, rel=1e-4)
    assert model.tokens_per_second("psd", 4, 0.5, 1) == pytest.approx(150, rel=1e-4)
    # Collapsed acceptance: every draft is wasted work, plain decoding wins (sd k=1: 4 / 0.020 = 200 tok/s).
    assert model.best(4, 0.0) == pytest.approx((4 / 0.014, "ar", 0))
    # Fewer than 2 requests: psd is sd (one side empty).
    assert model.cycle_seconds("psd", 1, 3) == model.cycle_seconds("sd", 1, 3)


def test_curves_are_nondecreasing_costs_and_extrapolate_along_the_ends() -> None:
    # Noise that has a cost fall with size is pooled (least squares): 3 and 2 at sizes 2 and 3 become 2.5.
    assert fit_curve([(1, 1.0), (2, 3.0), (3, 2.0), (4, 4.0)]) == ((1.0, 1.0), (2.5, 2.5), (4.0, 4.0))
    curve = ((1.0, 1.0), (2.0, 3.0), (4.0, 4.0))
    assert evaluate(curve, 1.5) == pytest.approx(2.0)
    assert evaluate(curve, 8.0) == pytest.approx(6.0)  # the last segment's slope, 0.5 per unit
    assert evaluate(curve, 0.9) == pytest.approx(0.8)  # the first segment's, floored at a quarter of its start
    assert evaluate(curve, 0.0) == pytest.approx(0.25)


def test_speedup_divides_step_seconds(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(SYNTHETIC))
    fast = calibrate([path], startup_seconds=30.0, speedup=10.0, max_batch=16)
    slow = calibrate([path], startup_seconds=30.0)
    assert fast.max_batch == 16
    assert fast.best(4, 0.5)[0] == pytest.approx(10 * slow.best(4, 0.5)[0])
    assert ReplicaModel.from_json(json.loads(json.dumps(fast.to_json()))) == fast


def test_modes_without_points_are_left_out(tmp_path: Path) -> None:
    ar_only = {"config": {"num_speculative_tokens": 3},
               "runs": [{"concurrency": c, "modes": {"ar": _mode(c / (0.01 + 0.001 * c))}} for c in (1, 4)]}
    path = tmp_path / "ar.json"
    path.write_text(json.dumps(ar_only))
    model = calibrate([path], startup_seconds=30.0)
    assert model.modes == ("ar",) and model.best(4, 0.9)[1] == "ar"


def test_lookahead_is_priced_as_psd_and_never_crashes(model: ReplicaModel) -> None:
    """The engines run lookahead (fixed, or chosen by auto); this model has no curves of it and prices it as psd
    (drafting overlapped with verification), rather than refusing a model or an observation that names it."""
    for c in (1, 4, 8):
        assert model.cycle_seconds("lookahead", c, 3) == model.cycle_seconds("psd", c, 3)
        assert model.tokens_per_second("lookahead", c, 0.7, 3) == model.tokens_per_second("psd", c, 0.7, 3)
    with_lookahead = ReplicaModel.from_json({**model.to_json(), "modes": [*model.modes, "lookahead"]})
    assert with_lookahead.best(8, 0.7)[0] == pytest.approx(model.best(8, 0.7)[0])
    with pytest.raises(ValueError, match="mode"):
        model.cycle_seconds("eagle", 4, 3)


def test_lookahead_bench_rows_are_not_fitted(tmp_path: Path) -> None:
    """A benchmark with lookahead rows (`minedraft bench --modes ar,sd,psd,lookahead`) calibrates the same model."""
    with_lookahead = json.loads(json.dumps(SYNTHETIC))
    for run in with_lookahead["runs"]:
        if isinstance(run["concurrency"], int):
            run["modes"]["lookahead"] = _mode(1e6, 3.0, 0.001)  # absurd on purpose: it must change nothing
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(with_lookahead))
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(SYNTHETIC))
    fitted = calibrate([path], startup_seconds=30.0)
    assert fitted.modes == calibrate([plain], startup_seconds=30.0).modes
    assert fitted.psd_ratio == calibrate([plain], startup_seconds=30.0).psd_ratio
