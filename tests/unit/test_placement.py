"""Lending the drafter's cores: the step thread's affinity and torch's thread count widen and narrow together."""

from __future__ import annotations

import os
import threading

import torch

from minedraft.engine.placement import ComputePlacement, should_widen


def test_widen_and_narrow_on_the_calling_thread_only() -> None:
    cores = tuple(sorted(os.sched_getaffinity(0)))
    threads_before = torch.get_num_threads()
    seen: dict[str, object] = {}

    def step_thread() -> None:
        placement = ComputePlacement(cores[:1], cores[1:])
        placement.apply(wide=False)
        seen["narrow"] = (os.sched_getaffinity(0), torch.get_num_threads())
        placement.apply(wide=True)
        seen["wide"] = (os.sched_getaffinity(0), torch.get_num_threads())

    try:
        worker = threading.Thread(target=step_thread)
        worker.start()
        worker.join()
        assert seen["narrow"] == ({cores[0]}, 1)
        assert seen["wide"] == (set(cores), len(cores))
        assert os.sched_getaffinity(0) == set(cores), "other threads keep their affinity"
    finally:
        torch.set_num_threads(threads_before)


def test_nothing_to_lend_keeps_the_target_cores() -> None:
    placement = ComputePlacement((0,), ())
    assert not placement.can_widen
    assert placement.wide_cores == (0,)


# -- devices ---------------------------------------------------------------------------------------------------------

import pytest  # noqa: E402

from minedraft.engine.placement import (  # noqa: E402
    CPU_FAST_BF16_ENV,
    DeviceInfo,
    cpu_thread_binding,
    detect_device,
    model_config_dtype,
    plan_devices,
    resolve_dtype,
    resolve_for_device,
)
from minedraft.engine.settings import DrafterSettings, EngineSettings, Mode, SettingsError  # noqa: E402


def settings(mode: Mode = Mode.PSD, tp: int = 1, target_gpus: tuple[int, ...] = (), drafter_gpu: int | None = None,
             backend: str = "vllm") -> EngineSettings:
    return EngineSettings(model="t", drafter=DrafterSettings(model="d", gpu_index=drafter_gpu, backend=backend),
                          mode=mode, tensor_parallel_size=tp, target_gpus=target_gpus)


FIVE = DeviceInfo(visible_gpus=("4", "5", "6", "7", "8"))


def test_target_and_drafter_index_into_the_inherited_device_list() -> None:
    plan = plan_devices(settings(tp=4), FIVE)
    assert plan.target_visible_devices == "4,5,6,7"
    assert plan.drafter_visible_devices == "8"  # the next device, as the pod named it, not "4"


def test_uuids_and_an_explicit_layout_are_kept_as_given() -> None:
    device = DeviceInfo(visible_gpus=("GPU-a", "GPU-b", "GPU-c"))
    plan = plan_devices(settings(tp=2, target_gpus=(1, 2), drafter_gpu=0), device)
    assert (plan.target_visible_devices, plan.drafter_visible_devices) == ("GPU-b,GPU-c", "GPU-a")
    # Without target GPUs given, the target skips the drafter's device.
    plan = plan_devices(settings(tp=2, drafter_gpu=0), device)
    assert (plan.target_visible_devices, plan.drafter_visible_devices) == ("GPU-b,GPU-c", "GPU-a")


def test_ar_needs_no_drafter_device() -> None:
    plan = plan_devices(settings(mode=Mode.AR, tp=4), DeviceInfo(visible_gpus=("0", "1", "2", "3")))
    assert (plan.target_visible_devices, plan.drafter_visible_devices) == ("0,1,2,3", None)


@pytest.mark.parametrize(
    ("case", "device", "field", "words"),
    [
        (settings(tp=4), DeviceInfo(visible_gpus=("0", "1", "2", "3")), "drafter.gpu_index", "no GPU left"),
        (settings(tp=2), DeviceInfo(visible_gpus=("0",)), "target_gpus", "tensor parallel size 2"),
        (settings(drafter_gpu=7), FIVE, "drafter.gpu_index", "does not exist"),
        (settings(tp=2, target_gpus=(0, 9)), FIVE, "target_gpus", "needs GPUs"),
        (settings(drafter_gpu=1), DeviceInfo(), "drafter.gpu_index", "no GPU is visible"),
        (settings(target_gpus=(0,)), DeviceInfo(), "target_gpus", "no GPU is visible"),
    ],
)
def test_device_errors_name_the_field(case: EngineSettings, device: DeviceInfo, field: str, words: str) -> None:
    with pytest.raises(SettingsError) as info:
        plan_devices(case, device)
    assert info.value.field_name == field
    assert words in str(info.value)


def test_a_torch_drafter_on_a_gpu_machine_stays_on_the_cpu() -> None:
    plan = plan_devices(settings(tp=2, backend="torch"), DeviceInfo(visible_gpus=("0", "1")))
    assert (plan.target_visible_devices, plan.drafter_visible_devices) == ("0,1", None)


def test_auto_choices_resolve_per_machine() -> None:
    auto = EngineSettings(model="t", drafter=DrafterSettings(model="d"))
    assert (auto.dtype, auto.drafter.backend) == ("auto", "auto")
    cpu = resolve_for_device(auto, DeviceInfo())
    assert (cpu.dtype, cpu.drafter.backend) == ("float32", "torch")
    # Issue 27: on a CPU with AVX-512 BF16 "auto" stayed "auto" and vLLM loaded the float32 pair in bfloat16, whose
    # greedy choices depend on batch composition. float32 on every CPU; vLLM never sees "auto".
    bf16_cpu = resolve_for_device(auto, DeviceInfo(cpu_fast_bf16=True), model_dtype="bfloat16")
    assert bf16_cpu.dtype == "float32"
    gpu = resolve_for_device(auto, FIVE, model_dtype="float16")
    assert (gpu.dtype, gpu.drafter.backend) == ("float16", "vllm")
    chosen = resolve_for_device(auto.with_changes(dtype="bfloat16", drafter=DrafterSettings(model="d",
                                                                                           backend="torch")), FIVE)
    assert (chosen.dtype, chosen.drafter.backend) == ("bfloat16", "torch")
    assert resolve_for_device(auto.with_changes(dtype="bfloat16"), DeviceInfo()).dtype == "bfloat16"  # asked for


@pytest.mark.parametrize(("model_dtype", "expected"), [
    ("bfloat16", "bfloat16"), ("torch.float16", "float16"),
    # float32 checkpoints run in bfloat16 on GPUs, as vLLM's own "auto" does there; no dtype in the config likewise.
    ("float32", "bfloat16"), (None, "bfloat16")])
def test_auto_dtype_on_a_gpu_is_the_targets_own_and_concrete(model_dtype, expected) -> None:
    assert resolve_dtype("auto", FIVE, model_dtype) == expected


@pytest.mark.parametrize("fast_bf16", [False, True])
def test_auto_dtype_is_float32_on_every_cpu(fast_bf16) -> None:
    assert resolve_dtype("auto", DeviceInfo(cpu_fast_bf16=fast_bf16), "bfloat16") == "float32"


def test_the_cpu_kind_can_be_forced_both_ways() -> None:
    assert detect_device({CPU_FAST_BF16_ENV: "1"}).cpu_fast_bf16 is True
    assert detect_device({CPU_FAST_BF16_ENV: "0"}).cpu_fast_bf16 is False
    with pytest.raises(SettingsError) as info:
        detect_device({CPU_FAST_BF16_ENV: "yes"})
    assert info.value.field_name == CPU_FAST_BF16_ENV


def test_the_targets_config_dtype_is_read(pair_dir) -> None:
    assert model_config_dtype(str(pair_dir / "target")) == "float32"
    assert model_config_dtype(str(pair_dir / "no-such-model")) is None


def test_detect_device_reads_the_inherited_list_without_a_gpu() -> None:
    # No GPU on this machine (or CUDA unavailable): nothing is visible whatever the variable says.
    import torch

    if torch.cuda.device_count():
        pytest.skip("counts real GPUs here")
    assert detect_device({"CUDA_VISIBLE_DEVICES": "3,4"}).visible_gpus == ()


def test_cpu_tensor_parallel_binding_gives_each_rank_its_cores() -> None:
    assert cpu_thread_binding((0, 1, 2, 3), 2, (0, 1, 2, 3, 4, 5, 6, 7)) == "0,1|2,3"
    assert cpu_thread_binding((0,), 2, (0, 1)) == "0|1"  # fewer target cores than ranks: all this process's
    with pytest.raises(SettingsError) as info:
        cpu_thread_binding((0,), 4, (0, 1))
    assert info.value.field_name == "tensor_parallel_size"


# -- the model pair ----------------------------------------------------------------------------------------------------


def test_pair_check_accepts_a_shared_vocabulary_and_refuses_what_would_break(tmp_path) -> None:
    import json
    import shutil

    from minedraft.engine.placement import check_model_pair
    from minedraft.models.tiny import tiny_pair

    pair = tiny_pair("qwen3")
    report = check_model_pair(str(pair / "target"), str(pair / "draft"), "torch")
    assert (report["target_model_type"], report["draft_vocab_size"]) == ("qwen3", report["target_vocab_size"])

    # Same vocabulary size, different tokens: two ids swapped in the draft's tokenizer.
    swapped = tmp_path / "swapped"
    shutil.copytree(pair / "draft", swapped)
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    (a, ia), (b, ib) = sorted(vocab.items(), key=lambda kv: kv[1])[300:302]
    vocab[a], vocab[b] = ib, ia
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(SettingsError) as info:
        check_model_pair(str(pair / "target"), str(swapped), "vllm")
    assert info.value.field_name == "drafter.model" and "2 of" in str(info.value)

    # An architecture the torch drafter does not implement is refused by name before anything loads.
    mistral = tmp_path / "mistral"
    shutil.copytree(pair / "draft", mistral)
    config = json.loads((mistral / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (mistral / "config.json").write_text(json.dumps(config))
    with pytest.raises(SettingsError) as info:
        check_model_pair(str(pair / "target"), str(mistral), "torch")
    assert info.value.field_name == "drafter.backend" and "use --drafter-backend vllm" in str(info.value)
    assert check_model_pair(str(pair / "target"), str(mistral), "vllm")["draft_model_type"] not in ("llama", "qwen3")


def test_a_second_engine_in_the_process_indexes_into_the_inherited_list() -> None:
    from minedraft.engine.placement import narrow_visible_devices

    env = {"CUDA_VISIBLE_DEVICES": "4,5,6"}
    narrow_visible_devices(env, "4")  # the first engine's target
    assert env["CUDA_VISIBLE_DEVICES"] == "4"
    assert detect_device(env).visible_gpus == ("4", "5", "6")
    narrow_visible_devices(env, "5,6")
    assert detect_device(env).visible_gpus == ("4", "5", "6")


def test_the_target_widens_only_onto_cores_where_nothing_drafts_or_loads() -> None:
    assert should_widen(plain_decoding=True, drafts_outstanding=False, drafter_loading=False)
    assert should_widen(plain_decoding=False, drafts_outstanding=False, drafter_loading=False)
    assert not should_widen(plain_decoding=False, drafts_outstanding=True, drafter_loading=False)
    # A replacement drafter loading its model on the lent cores: plain decoding stays narrow until it is up.
    assert not should_widen(plain_decoding=True, drafts_outstanding=False, drafter_loading=True)
    assert not should_widen(plain_decoding=True, drafts_outstanding=True, drafter_loading=True)


def test_deterministic_turns_on_vllms_batch_invariant_mode_on_gpus_only() -> None:
    from minedraft.engine.core import BATCH_INVARIANT_ENV, deterministic_environment
    from minedraft.engine.placement import DevicePlan

    on = EngineSettings(model="t", drafter=DrafterSettings(model="d"), deterministic=True)
    gpu = DevicePlan(target_visible_devices="0,1", drafter_visible_devices="2")
    assert deterministic_environment(on, gpu) == {BATCH_INVARIANT_ENV: "1"}
    # Off (the default), or on a CPU (float32 is batch-invariant already): "0", never an inherited "1".
    assert deterministic_environment(on.with_changes(deterministic=False), gpu) == {BATCH_INVARIANT_ENV: "0"}
    assert deterministic_environment(on, DevicePlan()) == {BATCH_INVARIANT_ENV: "0"}


def test_deterministic_on_a_cpu_needs_float32() -> None:
    on = EngineSettings(model="t", drafter=DrafterSettings(model="d"), deterministic=True)
    assert resolve_for_device(on, DeviceInfo()).dtype == "float32"  # auto
    with pytest.raises(SettingsError) as info:
        resolve_for_device(on.with_changes(dtype="bfloat16"), DeviceInfo())
    assert info.value.field_name == "deterministic" and "float32" in str(info.value)
    assert resolve_for_device(on.with_changes(dtype="bfloat16"), FIVE).dtype == "bfloat16"  # GPUs: vLLM's mode


def test_the_deterministic_flag_reaches_the_settings() -> None:
    import argparse

    from minedraft.engine_options import add_engine_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    for argv, expected in (([], False), (["--deterministic"], True)):
        args = parser.parse_args(["--model", "t", "--draft", "d", *argv])
        assert settings_from_args(args).deterministic is expected
