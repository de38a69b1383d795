"""KV capacity and prefill pricing (minedraft.twin.capacity): the block pool vLLM's accounting leaves, what a
colocated drafter takes from it, and prefill from a measured shape or a labelled roofline."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from minedraft.twin.capacity import (
    GIB,
    MIB,
    MemorySettings,
    ModelFootprint,
    RequestShape,
    capacity_from_curves,
    drafter_device_concurrency,
    estimated_params,
    footprint,
    known_device_memory,
    kv_capacity,
    mode_max_concurrency,
    placement_of,
    prefill_ms,
)
from minedraft.twin.curves import CurveError, load_curves, parse_curves

H200 = Path(__file__).resolve().parents[2] / "benchmarks" / "curves" / "h200-qwen3-32b.json"
TARGET = ModelFootprint("t", weight_bytes=60 * GIB, kv_bytes_per_token=256 * 1024)
DRAFTER = ModelFootprint("d", weight_bytes=4 * GIB, kv_bytes_per_token=112 * 1024)


def test_pool_is_utilisation_minus_weights_and_reserve_in_whole_requests() -> None:
    settings = MemorySettings(gpu_memory_utilization=0.5, runtime_reserve_bytes=2 * GIB)
    cap = kv_capacity(160 * GIB, TARGET, DRAFTER, "off-gpu", RequestShape(1000, 24), settings)
    assert cap.kv_pool_bytes == 80 * GIB - 60 * GIB - 2 * GIB
    assert cap.kv_tokens == 18 * GIB // (256 * 1024)
    assert cap.request_tokens == 1024  # 1000 + 24, whole 16-token blocks
    assert cap.max_concurrency == cap.kv_tokens // 1024 == 72


def test_a_colocated_drafter_takes_its_weights_and_adds_its_kv_to_every_token() -> None:
    request = RequestShape(1024, 256)
    off = kv_capacity(141 * GIB, TARGET, DRAFTER, "off-gpu", request)
    none = kv_capacity(141 * GIB, TARGET, None, "none", request)
    colocated = kv_capacity(141 * GIB, TARGET, DRAFTER, "colocated", request)
    assert off == dataclasses.replace(none, placement="off-gpu")  # an off-GPU drafter takes nothing here
    assert colocated.kv_pool_bytes == off.kv_pool_bytes - DRAFTER.weight_bytes
    assert colocated.kv_bytes_per_token == TARGET.kv_bytes_per_token + DRAFTER.kv_bytes_per_token
    assert colocated.max_concurrency < off.max_concurrency


def test_tensor_parallelism_pools_every_gpu_and_a_target_that_does_not_fit_holds_nothing() -> None:
    request = RequestShape(1024, 256)
    one = kv_capacity(80 * GIB, TARGET, None, "none", request)
    two = kv_capacity(80 * GIB, TARGET, None, "none", request, MemorySettings(tensor_parallel_size=2))
    assert two.kv_pool_bytes == 2 * int(80 * GIB * 0.9) - TARGET.weight_bytes - 2 * 2 * GIB
    assert two.max_concurrency > 2 * one.max_concurrency  # the weights are paid once
    assert kv_capacity(40 * GIB, TARGET, None, "none", request).max_concurrency == 0


def test_lookahead_slots_and_longer_requests_cost_capacity() -> None:
    base = kv_capacity(141 * GIB, TARGET, None, "none", RequestShape(1024, 256)).max_concurrency
    assert kv_capacity(141 * GIB, TARGET, None, "none", RequestShape(1024, 256, lookahead_tokens=5)
                       ).max_concurrency < base
    assert kv_capacity(141 * GIB, TARGET, None, "none", RequestShape(4096, 256)).max_concurrency < base / 3


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"placement": "elsewhere"}, "placement"),
    ({"placement": "colocated", "drafter": None}, "drafter"),
    ({"device_memory_bytes": 0}, "device_memory_bytes"),
])
def test_bad_arguments_name_the_field(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"device_memory_bytes": GIB, "target": TARGET, "drafter": DRAFTER,
                            "placement": "none", "request": RequestShape(1, 1), **kwargs}
    with pytest.raises(ValueError, match=message):
        kv_capacity(**args)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        MemorySettings(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="output_tokens"):
        RequestShape(10, 0)


def test_placement_follows_the_family_and_new_engine_modes_follow_the_engine() -> None:
    assert placement_of("ar", "own") == placement_of("vllm-ar", "shared") == "none"
    assert placement_of("vllm-sd", "own") == "colocated"
    assert placement_of("psd", "own") == placement_of("lookahead", "own") == "off-gpu"
    assert placement_of("psd", "shared") == "colocated"


def test_the_shared_h200_file_off_gpu_holds_more_than_colocated_at_1k_prompts() -> None:
    curves = load_curves(H200)
    request = RequestShape(1024, 256)
    for drafter in ("qwen3-1.7b", "qwen3-0.6b"):
        off = capacity_from_curves(curves, "qwen3-32b", drafter, "off-gpu", request)
        colocated = capacity_from_curves(curves, "qwen3-32b", drafter, "colocated", request)
        # About 1.5x: the drafter's KV rides on every token of the colocated pool.
        assert 1.4 < off.max_concurrency / colocated.max_concurrency < 1.6
        assert off.device_memory_bytes == 143771 * MIB  # the H200, from the device text
    # On an H100, Qwen3-32B in bf16 leaves room for ~35k tokens: under 30 such requests.
    h100 = capacity_from_curves(curves, "qwen3-32b", None, "none", request, memory_bytes=81559 * MIB)
    assert 30_000 < h100.kv_tokens < 40_000 and h100.max_concurrency < 30


def test_footprint_estimates_missing_params_from_the_config_and_needs_kv_bytes() -> None:
    curves = load_curves(H200)
    measured = curves.models["qwen3-1.7b"]
    assert estimated_params(measured.config) == pytest.approx(measured.params, rel=1e-5)
    small = footprint(curves.models["qwen3-0.6b"], curves.dtype)  # params null in the file
    assert small.weight_bytes == 2 * estimated_params(curves.models["qwen3-0.6b"].config)
    assert "estimated" in small.weight_source
    with pytest.raises(CurveError, match="kv_bytes_per_token"):
        footprint(parse_curves(_small_file()).models["t"], "bfloat16")


def test_device_memory_from_the_file_or_the_table_or_a_clear_error() -> None:
    assert known_device_memory("NVIDIA L40S") == 46068 * MIB
    assert known_device_memory("nvidia l4") == 23034 * MIB
    with pytest.raises(CurveError, match="device_memory_bytes"):
        known_device_memory("CPU: AMD EPYC")
    data = _small_file()
    data["device_memory_bytes"] = 8 * GIB
    data["models"]["t"]["kv_bytes_per_token"] = 1024
    data["models"]["t"]["params"] = 1000
    cap = capacity_from_curves(parse_curves(data), "t", None, "none", RequestShape(64, 64),
                               MemorySettings(runtime_reserve_bytes=0))
    assert cap.device_memory_bytes == 8 * GIB
    data["device_memory_bytes"] = -1
    with pytest.raises(CurveError, match="device_memory_bytes"):
        parse_curves(data)


def test_drafter_device_holds_kv_for_every_replica_it_serves_and_a_window_bounds_it() -> None:
    request = RequestShape(4096, 256)
    full = drafter_device_concurrency(24 * GIB, DRAFTER, request)
    windowed = drafter_device_concurrency(24 * GIB, DRAFTER, request, window_tokens=512)
    assert full == (int(24 * GIB * 0.9) - 4 * GIB - 2 * GIB) // (DRAFTER.kv_bytes_per_token * 4352)
    assert windowed > 8 * full


def _small_file() -> dict[str, Any]:
    forward = [{"batch": b, "context": 1024, "new_tokens": q, "ms": 10.0 + 0.1 * b * q} for b in (1, 16)
               for q in (1, 4)]
    loops = [{"batch": b, "context": 1024, "k": 2, "ms": 2.0 + 0.1 * b} for b in (1, 16)]
    return copy.deepcopy({"format": "minedraft-cost-curves/v1", "device": "test", "dtype": "bfloat16", "models": {
        "t": {"role": "target", "config": {"layers": 2, "heads": 4, "head_dim": 8}, "forward_ms": forward},
        "d": {"role": "drafter", "draft_loop_ms": loops}}})


def test_prefill_measured_shape_is_interpolated_and_old_files_get_a_labelled_estimate() -> None:
    data = _small_file()
    data["models"]["t"]["prefill_ms"] = [{"tokens": 128, "context": 0, "ms": 20.0},
                                         {"tokens": 1024, "context": 0, "ms": 110.0},
                                         {"tokens": 1024, "context": 4096, "ms": 150.0}]
    target = parse_curves(data).models["t"]
    assert prefill_ms(target, 576).ms == pytest.approx(65.0)
    assert prefill_ms(target, 576).source == "measured"
    assert prefill_ms(target, 1024, context=2048).ms == pytest.approx(130.0)
    assert prefill_ms(target, 2048).extrapolated
    assert prefill_ms(target, 0).ms == 0.0
    data["models"]["t"]["prefill_ms"][1]["tokens"] = 0
    with pytest.raises(CurveError, match=r"models\.t\.prefill_ms\[1\]\.tokens"):
        parse_curves(data)


def test_prefill_roofline_on_the_h200_file_is_compute_bound_and_labelled() -> None:
    curves = load_curves(H200)
    target = curves.models["qwen3-32b"]
    one_k, four_k = prefill_ms(target, 1024), prefill_ms(target, 4096)
    assert one_k.source.startswith("estimate: roofline")
    # 2 x 32.8 GFLOP per token at the ~500 TFLOP/s the batch-128 x 6 verify achieved: ~130 ms for 1k tokens.
    assert 100 < one_k.ms < 170
    assert four_k.ms > 4 * one_k.ms  # attention over the prompt grows faster than linearly
    assert prefill_ms(target, 1).ms >= target.forward_ms(1, 0, 1).ms  # never below a one-token forward
    with pytest.raises(CurveError, match="peak FLOP"):
        prefill_ms(curves.models["qwen3-0.6b"], 1024)  # no forward times: needs the device's peak
    drafter = prefill_ms(curves.models["qwen3-0.6b"], 1024, peak_flops=989e12)
    assert drafter.source.startswith("estimate") and drafter.ms < one_k.ms / 10


def test_mode_max_concurrency_by_family_reserves_draft_slots() -> None:
    curves = load_curves(H200)

    def held(family: str, k: int = 0, placement: str = "own") -> int:
        return mode_max_concurrency(curves, "qwen3-32b", "qwen3-1.7b", family, 1024, 256, k=k,
                                    drafter_placement=placement).max_concurrency

    assert held("ar") == held("vllm-ar") == held("psd") > held("psd", k=64)
    assert held("psd", placement="shared") == held("vllm-sd") < held("psd")


def test_the_engine_batch_limit_uses_the_memory_an_off_gpu_drafter_frees() -> None:
    from minedraft.engine.batch_limit import sized_max_num_seqs

    curves = load_curves(H200)
    target = footprint(curves.models["qwen3-32b"], "bfloat16")
    drafter = footprint(curves.models["qwen3-1.7b"], "bfloat16")
    h200 = 143771 * MIB
    colocated = sized_max_num_seqs(h200, target, drafter, colocated=True, request_tokens=1280, lookahead_tokens=3)
    off_gpu = sized_max_num_seqs(h200, target, drafter, colocated=False, request_tokens=1280, lookahead_tokens=3)
    assert colocated == 130 and off_gpu == 200  # the colocated drafter's weights and KV are requests here
    assert sized_max_num_seqs(h200, target, drafter, colocated=False, request_tokens=64) == 1024  # the ceiling
    assert sized_max_num_seqs(60 * GIB, target, drafter, colocated=True, request_tokens=1280) == 1  # the floor


def test_footprint_from_a_hugging_face_config_matches_the_curve_files() -> None:
    from types import SimpleNamespace

    from minedraft.engine.batch_limit import footprint_from_config

    config = SimpleNamespace(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                             head_dim=128, intermediate_size=25600, vocab_size=151936, tie_word_embeddings=False)
    found = footprint_from_config("qwen3-32b", config, "bfloat16")
    expected = footprint(load_curves(H200).models["qwen3-32b"], "bfloat16")
    assert found.kv_bytes_per_token == expected.kv_bytes_per_token
    assert found.weight_bytes == pytest.approx(expected.weight_bytes, rel=1e-5)


def test_resize_keeps_the_fixed_limit_where_there_is_no_gpu_and_sizes_it_where_there_is(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from minedraft.engine import batch_limit

    @dataclasses.dataclass(frozen=True)
    class Settings:  # the fields of EngineSettings that resize reads
        model: str
        drafter: Any
        mode: str = "psd"
        max_num_seqs: int = 64
        dtype: str = "float32"
        target_gpus: tuple[int, ...] = ()
        gpu_memory_utilization: float | None = None
        tensor_parallel_size: int = 1
        max_draft_tokens_per_request: int = 3

        def with_changes(self, **changes: Any) -> Settings:
            return dataclasses.replace(self, **changes)

    pair = Path(__file__).resolve().parents[2] / "minedraft" / "models" / "data" / "pair-v1"
    settings = Settings(str(pair / "target"), SimpleNamespace(model=str(pair / "draft")))
    lines: list[str] = []
    monkeypatch.setattr(batch_limit, "gpu_memory_bytes", lambda index=0: None)
    assert batch_limit.resize(settings, 2048, lines.append) is settings and "keeping" in lines[-1]
    # An 8 GiB GPU for the local pair (a few MB of weights): off the GPU, more requests than with it colocated.
    monkeypatch.setattr(batch_limit, "gpu_memory_bytes", lambda index=0: 8 * GIB)
    off_gpu = batch_limit.resize(settings, 100_000, lines.append).max_num_seqs
    colocated = batch_limit.resize(settings.with_changes(mode="vllm-sd"), 100_000, lines.append).max_num_seqs
    assert off_gpu > colocated >= 1 and "off the target GPU" in lines[-2]
