"""What a deployment holds and pays in `minedraft plan` and the twin: KV capacity queues loads beyond it, prefill
priced from the curves, drafter devices carried by a labelled roofline, and dollars per million tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from minedraft.cli import main
from minedraft.twin.costs import AcceptanceModel, Hardware, StepCosts
from minedraft.twin.curves import CurveError, load_curves
from minedraft.twin.deploy import deployment_model
from minedraft.twin.devices import DEVICES, curves_device, device_spec, move_model
from minedraft.twin.pricing import (
    EXAMPLE_PRICES,
    Layout,
    PriceTable,
    cheapest,
    parse_prices,
    price_deployment,
)
from minedraft.twin.run import Workload, run_concurrency

H200 = str(Path(__file__).resolve().parents[2] / "benchmarks" / "curves" / "h200-qwen3-32b.json")


def _plan(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, Any]:
    assert main(["plan", "--curves", H200, "--target", "qwen3-32b", "--drafter", "qwen3-1.7b", "-k", "3",
                 "--no-auto", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_plan_rate_reports_capacity_cost_and_the_recommended_deployment(capsys: pytest.CaptureFixture[str]) -> None:
    out = _plan(capsys, "--rate", "1", "--max-concurrency", "8", "--modes", "vllm-ar,psd,vllm-sd")
    band = out["bands"][0]
    deployments = band["deployments"]
    assert set(deployments) == {"vllm-ar", "psd", "vllm-sd"}
    for d in deployments.values():
        assert d["max_concurrency"] > 0 and d["tokens_per_s_per_gpu"] > 0 and d["usd_per_million_tokens"] > 0
        hours = d["usd_per_hour"]
        assert d["usd_per_million_tokens"] == pytest.approx(hours / (d["tokens_per_s"] * 3600) * 1e6, rel=1e-3)
    # 1k-prompt requests on the H200: the engine's off-GPU drafter leaves the target's whole pool to the target.
    assert deployments["psd"]["max_concurrency"] > 1.4 * deployments["vllm-sd"]["max_concurrency"]
    assert deployments["psd"]["gpus_by_kind"] == {"H200": 2.0} and deployments["vllm-sd"]["gpus_by_kind"] == {
        "H200": 1.0}
    assert band["recommended"]["usd_per_million_tokens"] == min(d["usd_per_million_tokens"]
                                                                for d in deployments.values())
    assert out["prices"]["source"].startswith("example prices")
    assert out["prefill"]["source"].startswith("estimate: roofline") and out["prefill"]["ms_per_token"] > 0.05


def test_kv_capacity_queues_the_load_beyond_it_in_the_twin() -> None:
    curves = load_curves(H200)
    costs = StepCosts.from_curves(curves, "qwen3-32b", "qwen3-1.7b", Hardware())
    acceptance = AcceptanceModel.constant(0.8)

    def run(concurrency: int, limit: int | None) -> Any:
        return run_concurrency(costs, acceptance, "sd", 3, concurrency, Workload(128, 16), warmup_steps=20,
                               measure_steps=150, min_measure_tokens=500, max_num_seqs=limit)

    free, capped, at_cap = run(16, None), run(16, 4), run(4, None)
    # Held to 4 requests, 16 in the system run at 4's pace; the other 12 wait, and their wait is in their TTFT.
    assert capped.tokens_per_s == pytest.approx(at_cap.tokens_per_s, rel=0.15)
    assert free.tokens_per_s > 1.5 * capped.tokens_per_s
    assert sorted(capped.ttft_s)[len(capped.ttft_s) // 2] > 3 * sorted(at_cap.ttft_s)[len(at_cap.ttft_s) // 2]


def test_plan_holds_each_mode_to_its_kv_capacity(capsys: pytest.CaptureFixture[str]) -> None:
    # A small GPU: an H200's speed with 76 GiB, where Qwen3-32B leaves room for a handful of 1k requests.
    args = ("--concurrency", "32", "--modes", "psd,vllm-sd", "--device-memory-gib", "76")
    out = _plan(capsys, *args)
    capacity = out["capacity"]["by_family"]
    assert 0 < capacity["vllm-sd"]["max_concurrency"] < capacity["psd"]["max_concurrency"] < 32
    unlimited = _plan(capsys, *args, "--no-kv-limit")
    modes, free = out["loads"][0]["modes"], unlimited["loads"][0]["modes"]
    assert modes["vllm-sd-k3"]["tokens_per_s"] < 0.8 * free["vllm-sd-k3"]["tokens_per_s"]
    assert modes["vllm-sd-k3"]["ttft_ms_p50"] > 2 * free["vllm-sd-k3"]["ttft_ms_p50"]


def test_prefill_is_priced_unless_left_out(capsys: pytest.CaptureFixture[str]) -> None:
    priced = _plan(capsys, "--concurrency", "8", "--modes", "vllm-ar", "--no-kv-limit")
    free = _plan(capsys, "--concurrency", "8", "--modes", "vllm-ar", "--no-kv-limit", "--prefill-ms-per-token", "0")
    assert free["prefill"] is None
    assert priced["loads"][0]["modes"]["vllm-ar"]["tokens_per_s"] < 0.95 * free["loads"][0]["modes"]["vllm-ar"][
        "tokens_per_s"]


def test_a_drafter_device_is_a_labelled_roofline_for_the_engine_modes_only() -> None:
    curves = load_curves(H200)
    model = deployment_model(curves, "qwen3-32b", "qwen3-1.7b", Hardware(), prompt_tokens=1024, output_tokens=256,
                             drafter_device="L4")
    assert model.estimated == ("drafter",)
    # vLLM's colocated drafter stays on the target's H200; the engine's drafts on the L4, slower.
    assert model.costs.drafter is curves.models["qwen3-1.7b"]
    assert model.engine_costs.draft_ms(16, 1024, 3) > 3 * model.costs.draft_ms(16, 1024, 3)
    assert model.layout("psd-k3") == Layout("H200", 1, "L4", 1.0)
    assert model.layout("vllm-sd-k3") == Layout("H200", 1)
    assert model.placement("lookahead-k3") == "off-gpu"  # a mode added later follows the engine's drafter
    with pytest.raises(CurveError, match="drafter_device"):
        deployment_model(curves, "qwen3-32b", "qwen3-1.7b", Hardware(drafter_placement="shared"),
                         prompt_tokens=1024, output_tokens=256, drafter_device="L4")
    with pytest.raises(CurveError, match="drafter_device"):
        device_spec("TPU v9")


def test_roofline_move_keeps_the_reference_and_orders_devices_by_bandwidth() -> None:
    curves = load_curves(H200)
    drafter = curves.models["qwen3-1.7b"]
    reference = curves_device(curves)
    assert reference.name == "H200" and move_model(drafter, 2, reference, reference) is drafter
    times = {name: move_model(drafter, 2, reference, DEVICES[name]).draft_loop_ms(8, 1024, 3).ms
             for name in ("H100", "RTX 4090", "L40S", "L4")}
    assert drafter.draft_loop_ms(8, 1024, 3).ms < times["H100"] < times["RTX 4090"] < times["L40S"] < times["L4"]


def test_prices_parse_with_errors_naming_the_field_and_price_whole_devices() -> None:
    table = parse_prices({"format": "minedraft-prices/v1", "usd_per_hour": {"H200": 4.0, "L4": 0.5}})
    assert table.price("NVIDIA H200 (141 GB HBM3e, one GPU)") == 4.0
    with pytest.raises(CurveError, match="prices"):
        table.price("A10")
    for bad, field_name in (({"format": "x"}, "prices.format"),
                            ({"format": "minedraft-prices/v1", "usd_per_hour": {"L4": -1}}, "prices.usd_per_hour.L4")):
        with pytest.raises(CurveError) as caught:
            parse_prices(bad)
        assert caught.value.field_name == field_name
    # Four replicas sharing one drafter device hold a quarter each: one L4 in all, priced once.
    shared = Layout("H200", 1, "L4", 0.25)
    deployment = price_deployment("psd-k3", "off-gpu", shared, 4, 200, 64.0, 4000.0, 30.0, table)
    assert deployment.devices_by_kind == {"H200": 4.0, "L4": 1.0}
    assert deployment.usd_per_hour == pytest.approx(16.5)
    assert deployment.usd_per_million_tokens == pytest.approx(16.5 / (4000 * 3600) * 1e6)
    dearer = price_deployment("vllm-sd-k3", "colocated", Layout("H200", 1), 5, 130, 64.0, 4000.0, 25.0, table)
    assert cheapest([dearer, deployment]) is deployment
    assert isinstance(EXAMPLE_PRICES, PriceTable) and "example" in EXAMPLE_PRICES.source


def test_tp_host_work_adds_the_code_paths_worker_round_trips(capsys: pytest.CaptureFixture[str]) -> None:
    from minedraft.twin.deploy import TP_ROUND_TRIPS_PER_STEP, with_tp_host_work

    assert with_tp_host_work(Hardware(step_overhead_ms=2.5), 0.2) == Hardware(step_overhead_ms=2.5)
    tp4 = with_tp_host_work(Hardware(tensor_parallel_size=4, step_overhead_ms=2.5,
                                     step_overhead_ms_by_batch=((1, 0.4), (16, 2.0))), 0.2)
    assert TP_ROUND_TRIPS_PER_STEP == 3  # execute_model, sample_tokens, the discarded take_draft_token_ids
    assert tp4.step_overhead_ms == pytest.approx(3.1)
    assert [ms for _, ms in tp4.step_overhead_ms_by_batch] == pytest.approx([1.0, 2.6])
    out = _plan(capsys, "--concurrency", "4", "--modes", "vllm-ar", "-tp", "2", "--rpc-round-trip-ms", "0.5")
    assert out["host_work"]["step_overhead_ms"] == pytest.approx(4.0)
    assert out["host_work"]["tp_round_trips_per_step"] == 3
