"""Reading and interpolating `minedraft-cost-curves/v1` files: errors name the field; interpolation reproduces the
grid and says when it extrapolates."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from minedraft.twin.curves import CurveError, interpolate, load_curves, parse_curves

H200 = Path(__file__).resolve().parents[2] / "benchmarks" / "curves" / "h200-qwen3-32b.json"


def small() -> dict[str, Any]:
    forward = [{"batch": b, "context": c, "new_tokens": q, "ms": 10.0 + 0.1 * b * q + c / 1024}
               for b in (1, 4, 16) for c in (1024, 2048) for q in (1, 4)]
    loops = [{"batch": b, "context": 1024, "k": k, "ms": 1.0 + k * (1 + 0.05 * b)} for b in (1, 4, 16) for k in (2, 4)]
    return {"format": "minedraft-cost-curves/v1", "device": "test", "models": {
        "t": {"role": "target", "params": 1000, "config": {"layers": 2}, "forward_ms": forward},
        "d": {"role": "drafter", "forward_ms": [], "draft_loop_ms": loops}}}


@pytest.mark.parametrize(("mutate", "field_name"), [
    (lambda d: d.update(format="other"), "format"),
    (lambda d: d.pop("models"), "models"),
    (lambda d: d["models"]["t"].update(role="verifier"), "models.t.role"),
    (lambda d: d["models"]["t"].pop("forward_ms"), "models.t.forward_ms"),
    (lambda d: d["models"]["d"].pop("draft_loop_ms"), "models.d.draft_loop_ms"),
    (lambda d: d["models"]["t"]["forward_ms"][3].update(ms=-1), "models.t.forward_ms[3].ms"),
    (lambda d: d["models"]["t"]["forward_ms"][0].pop("batch"), "models.t.forward_ms[0].batch"),
    (lambda d: d["models"]["t"]["forward_ms"][0].update(batch="8"), "models.t.forward_ms[0].batch"),
    (lambda d: d["models"]["d"]["draft_loop_ms"].append(dict(d["models"]["d"]["draft_loop_ms"][0])),
     "models.d.draft_loop_ms[6]"),
    (lambda d: d["models"]["t"].update(params=-5), "models.t.params"),
    (lambda d: d["models"].pop("t"), "models"),
])
def test_invalid_files_are_refused_naming_the_field(mutate: Any, field_name: str) -> None:
    data = copy.deepcopy(small())
    mutate(data)
    with pytest.raises(CurveError) as caught:
        parse_curves(data)
    assert caught.value.field_name == field_name, str(caught.value)


def test_unknown_model_names_what_the_file_has(tmp_path: Path) -> None:
    curves = parse_curves(small(), "f.json")
    with pytest.raises(CurveError, match=r"no model 'x' in f.json; it has t \(target\), d \(drafter\)"):
        curves.model("x", "target")
    with pytest.raises(CurveError, match="is a target"):
        curves.model("t", "drafter")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CurveError, match="not JSON"):
        load_curves(tmp_path / "bad.json")


def test_interpolation_reproduces_the_grid_and_is_linear_between() -> None:
    target = parse_curves(small()).model("t", "target")
    for b in (1, 4, 16):
        for c in (1024, 2048):
            for q in (1, 4):
                lookup = target.forward_ms(b, c, q)
                assert lookup.ms == pytest.approx(10.0 + 0.1 * b * q + c / 1024)
                assert not lookup.extrapolated
    # Linear in batch, context and new tokens between grid points (the test surface is linear in each).
    assert target.forward_ms(10, 1536, 2).ms == pytest.approx(10.0 + 0.1 * 10 * 2 + 1.5)


def test_extrapolation_is_flagged_continues_the_last_slope_and_never_falls() -> None:
    target = parse_curves(small()).model("t", "target")
    beyond = target.forward_ms(32, 1024, 4)
    assert beyond.extrapolated == {"batch"}
    assert beyond.ms == pytest.approx(10.0 + 0.1 * 32 * 4 + 1.0)
    assert target.forward_ms(4, 8192, 1).extrapolated == {"context"}
    drafter = parse_curves(small()).model("d", "drafter")
    # Below the shortest measured draft: linear, floored at the shortest draft's per-token share.
    one = drafter.draft_loop_ms(4, 1024, 1)
    assert one.extrapolated == {"k"}
    assert one.ms >= drafter.draft_loop_ms(4, 1024, 2).ms / 2
    assert interpolate([(1.0, 5.0), (2.0, 4.0)], 10.0) == (4.0, True)  # a falling tail does not keep falling


def test_a_sparse_context_level_adds_its_measured_difference_to_the_dense_level() -> None:
    curves = load_curves(H200)
    target = curves.model("qwen3-32b", "target")
    # 4096 is measured at batch 1, 8, 32 only; at 16 it is the 1024 value plus the difference interpolated between
    # batch 8 and 32 (2.438 and 5.681 ms at one new token).
    diff_16 = 2.438 + (5.681 - 2.438) * (16 - 8) / (32 - 8)
    assert target.forward_ms(16, 4096, 1).ms == pytest.approx(20.539 + diff_16, abs=0.01)
    assert target.forward_ms(128, 1024, 4).ms == pytest.approx(72.974)
    assert curves.model("qwen3-0.6b", "drafter").draft_loop_ms(32, 4096, 3).ms == pytest.approx(16.191)
    assert curves.names("drafter") == ["qwen3-1.7b", "qwen3-0.6b"]
