"""`minedraft plan`: the machine interface other tools call, rate planning, and errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minedraft.cli import main
from minedraft.engine.settings import DEFAULT_LOOKAHEAD_FANOUT
from minedraft.twin.plan import Band, parse_trace, plan_band
from minedraft.twin.run import RunResult
from minedraft.twin.sweep import LoadResult

H200 = str(Path(__file__).resolve().parents[2] / "benchmarks" / "curves" / "h200-qwen3-32b.json")


def test_plan_json_interface(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--curves", H200, "--target", "qwen3-32b", "--drafter", "qwen3-1.7b", "--concurrency", "1,16",
               "-k", "3", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    # The first interface's `loads`, and additions only: what the figures assume about host work, KV capacity,
    # prefill, devices and prices.
    assert next(iter(out)) == "loads"
    assert set(out) == {"loads", "host_work", "capacity", "prefill", "devices", "prices"}
    assert out["host_work"]["step_overhead_ms"] == 2.5 and out["host_work"]["vllm_async_scheduling"] is True
    assert [load["concurrency"] for load in out["loads"]] == [1, 16]
    for load in out["loads"]:
        assert set(load) == {"concurrency", "modes"}
        # Plain decoding in vLLM itself (vllm-ar) beside the engine's own ar, at every load.
        # ... and lookahead, listed as lookahead-kK with the fan-out its branch jobs used and its hit rate.
        assert set(load["modes"]) == {"ar", "vllm-ar", "sd-k3", "psd-k3", "lookahead-k3", "vllm-sd-k3", "auto"}
        lookahead = load["modes"]["lookahead-k3"]
        assert 1 <= lookahead["fanout"] <= DEFAULT_LOOKAHEAD_FANOUT and 0.3 < lookahead["branch_hit_rate"] < 1
        assert "fanout" not in load["modes"]["sd-k3"]
        for label, entry in load["modes"].items():
            assert entry["tokens_per_s"] > 0 and entry["max_concurrency"] > 16
            if label == "auto":
                assert entry["mode"] in ("ar", "sd", "psd", "lookahead") and isinstance(entry["k"], int)
            else:
                assert entry["tokens_per_s_per_gpu"] == pytest.approx(entry["tokens_per_s"] / entry["gpus"], rel=0.01)
        # vLLM's colocated SD costs what sd costs, on the target's GPU alone.
        assert load["modes"]["vllm-sd-k3"]["gpus"] == 1 and load["modes"]["sd-k3"]["gpus"] == 2
        # The engine's ar pays its host work after each forward; plain vLLM overlaps it.
        assert load["modes"]["vllm-ar"]["gpus"] == 1
        assert load["modes"]["vllm-ar"]["tokens_per_s"] > load["modes"]["ar"]["tokens_per_s"] * 1.05
    low = out["loads"][0]
    assert low["modes"]["sd-k3"]["tokens_per_s"] > low["modes"]["psd-k3"]["tokens_per_s"] * 0.99


def _slow_drafter_curves(path: Path) -> str:
    """A flat 20 ms target and a drafter as slow as the target: speculation cannot pay, plain decoding does."""
    forward = [{"batch": b, "context": 1024, "new_tokens": q, "ms": 20.0} for b in (1, 4, 16) for q in (1, 4)]
    loops = [{"batch": b, "context": 1024, "k": 3, "ms": 60.0} for b in (1, 4, 16)]
    path.write_text(json.dumps({"format": "minedraft-cost-curves/v1", "device": "a GPU", "models": {
        "t": {"role": "target", "config": {"layers": 10}, "forward_ms": forward},
        "d": {"role": "drafter", "draft_loop_ms": loops}}}))
    return str(path)


def test_plan_recommends_plain_vllm_where_it_is_fastest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--curves", _slow_drafter_curves(tmp_path / "c.json"), "--concurrency", "4", "-k", "3",
            "--no-auto", "--step-overhead-ms", "5"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "| 4 | plain vLLM (vllm-ar) |" in text and "Host work per step: 5 ms" in text
    assert main([*argv, "--json"]) == 0
    modes = json.loads(capsys.readouterr().out)["loads"][0]["modes"]
    assert max(modes, key=lambda label: modes[label]["tokens_per_s"]) == "vllm-ar"
    assert modes["vllm-ar"]["tokens_per_s"] / modes["ar"]["tokens_per_s"] == pytest.approx(25.0 / 20.0, rel=0.01)
    # Rate planning names it too, among the families it compares.
    assert main([*argv[:3], "--rate", "20", "--max-concurrency", "16", "-k", "3", "--no-auto",
                 "--step-overhead-ms", "5", "--json"]) == 0
    band = json.loads(capsys.readouterr().out)["bands"][0]
    assert band["run"]["mode"] == "vllm-ar" and band["by_family"]["vllm-ar"]["mode"] == "vllm-ar"


@pytest.mark.parametrize(("argv", "field_name"), [
    (["--curves", "/nonexistent.json", "--concurrency", "1"], "curves"),
    (["--curves", H200, "--concurrency", "1"], "drafter"),  # two drafters in the file: name one
    (["--curves", H200, "--drafter", "qwen3-1.7b", "--concurrency", "0"], "concurrency"),
    (["--curves", H200, "--drafter", "qwen3-1.7b", "--concurrency", "4", "--rate", "2"], "load"),
    (["--curves", H200, "--drafter", "qwen3-9b", "--concurrency", "4"], "drafter"),
    (["--curves", H200, "--drafter", "qwen3-1.7b", "--concurrency", "4", "--acceptance", "0.5,0.7"], "acceptance"),
    (["--curves", H200, "--drafter", "qwen3-1.7b", "--concurrency", "4", "-tp", "0"], "tensor_parallel_size"),
    (["--curves", H200, "--drafter", "qwen3-1.7b", "--concurrency", "4", "--modes", "vllm-xx"], "modes"),
    (["--curves", H200, "--drafter", "qwen3-1.7b", "--concurrency", "4", "--step-overhead-ms", "-1"],
     "step_overhead_ms"),
])
def test_plan_errors_name_the_field(argv: list[str], field_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *argv]) == 2
    assert f"minedraft: error: {field_name}:" in capsys.readouterr().err


def _run(mode: str, gpus: int, rate: float) -> RunResult:
    return RunResult(mode, 3, gpus, tokens=int(rate * 10), seconds=10.0)


def test_rate_planning_takes_the_fewest_gpus_and_interpolates_the_load() -> None:
    loads = []
    for concurrency, sd_rate, psd_rate, ar_rate in ((8, 800.0, 600.0, 500.0), (64, 3000.0, 3200.0, 2400.0)):
        load = LoadResult(concurrency)
        load.runs = {"sd-k3": _run("sd-k3", 2, sd_rate), "psd-k3": _run("psd-k3", 2, psd_rate),
                     "ar": _run("ar", 1, ar_rate), "vllm-sd-k3": _run("vllm-sd-k3", 1, sd_rate)}
        loads.append(load)
    # 10 requests/s x 100 tokens = 1000 tokens/s: one replica of each suffices; vllm-sd and ar on one GPU each.
    band = plan_band(loads, Band(None, 10.0), output_tokens=100)
    assert band["run"]["gpus"] == 1 and band["run"]["mode"] == "vllm-sd-k3"
    sd = band["by_family"]["sd"]
    assert sd["replicas"] == 1 and sd["concurrency_per_replica"] == pytest.approx(8 + 56 * 200 / 2200, rel=0.01)
    # 100 requests/s: 10000 tokens/s; psd's 3200 per replica needs 4 replicas (8 GPUs), ar 5 replicas (5 GPUs),
    # vllm-sd 4 replicas of one GPU: the fewest.
    band = plan_band(loads, Band(None, 100.0), output_tokens=100)
    assert band["by_family"]["psd"]["replicas"] == 4 and band["by_family"]["psd"]["gpus"] == 8
    assert band["by_family"]["ar"]["gpus"] == 5
    assert band["run"]["mode"] == "vllm-sd-k3" and band["run"]["tokens_per_s_per_gpu"] == pytest.approx(2500.0)


def test_trace_bands_parse_and_refuse_nonsense() -> None:
    assert parse_trace("# day\n60,2\n\n30, 10.5  # burst\n") == [Band(60.0, 2.0), Band(30.0, 10.5)]
    with pytest.raises(ValueError, match="line 1"):
        parse_trace("60;2")


def test_plan_confirm_measures_each_familys_contenders_again_and_leaves_the_rest(
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--curves", H200, "--target", "qwen3-32b", "--drafter", "qwen3-1.7b", "--concurrency", "4",
            "-k", "1,3,5", "--modes", "sd,psd", "--no-auto", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)["loads"][0]["modes"]
    assert main([*argv, "--confirm"]) == 0
    confirmed = json.loads(capsys.readouterr().out)["loads"][0]["modes"]
    assert set(plain) == set(confirmed)
    best = {family: max(v["tokens_per_s"] for label, v in plain.items() if label.startswith(family + "-"))
            for family in ("sd", "psd")}
    again = {label for label, v in plain.items() if v["tokens_per_s"] >= 0.97 * best[label.split("-k")[0]]}
    assert again and again != set(plain)
    for label in plain:
        if label not in again:
            assert confirmed[label] == plain[label], label
    assert any(confirmed[label]["tokens_per_s"] != plain[label]["tokens_per_s"] for label in again)
