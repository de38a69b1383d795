"""`minedraft plan`: the machine interface other tools call, rate planning, and errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minedraft.cli import main
from minedraft.twin.plan import Band, parse_trace, plan_band
from minedraft.twin.run import RunResult
from minedraft.twin.sweep import LoadResult

H200 = str(Path(__file__).resolve().parents[2] / "benchmarks" / "curves" / "h200-qwen3-32b.json")


def test_plan_json_interface(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--curves", H200, "--target", "qwen3-32b", "--drafter", "qwen3-1.7b", "--concurrency", "1,16",
               "-k", "3", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["loads"]
    assert [load["concurrency"] for load in out["loads"]] == [1, 16]
    for load in out["loads"]:
        assert set(load) == {"concurrency", "modes"}
        assert set(load["modes"]) == {"ar", "sd-k3", "psd-k3", "vllm-sd-k3", "auto"}
        for label, entry in load["modes"].items():
            assert entry["tokens_per_s"] > 0
            if label == "auto":
                assert entry["mode"] in ("ar", "sd", "psd") and isinstance(entry["k"], int)
            else:
                assert entry["tokens_per_s_per_gpu"] == pytest.approx(entry["tokens_per_s"] / entry["gpus"], rel=0.01)
        # vLLM's colocated SD costs what sd costs, on the target's GPU alone.
        assert load["modes"]["vllm-sd-k3"]["gpus"] == 1 and load["modes"]["sd-k3"]["gpus"] == 2
    low = out["loads"][0]
    assert low["modes"]["sd-k3"]["tokens_per_s"] > low["modes"]["psd-k3"]["tokens_per_s"] * 0.99


@pytest.mark.parametrize(("argv", "field_name"), [
    (["--curves", "/nonexistent.json", "--concurrency", "1"], "curves"),
    (["--curves", H200, "--concurrency", "1"], "drafter"),  # two drafters in the file: name one
    (["--curves", H200, "--drafter", "qwen3-1.7b", "--concurrency", "0"], "concurrency"),
    (["--curves", H200, "--drafter", "qwen3-1.7b", "--concurrency", "4", "--rate", "2"], "load"),
    (["--curves", H200, "--drafter", "qwen3-9b", "--concurrency", "4"], "drafter"),
    (["--curves", H200, "--drafter", "qwen3-1.7b", "--concurrency", "4", "--acceptance", "0.5,0.7"], "acceptance"),
    (["--curves", H200, "--drafter", "qwen3-1.7b", "--concurrency", "4", "-tp", "0"], "tensor_parallel_size"),
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
