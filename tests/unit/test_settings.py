import pytest

from minedraft.engine.requests import RequestError, SamplingSettings
from minedraft.engine.settings import DrafterSettings, EngineSettings, Mode, SchedulerSettings, SettingsError


def make(**changes):
    base = {"model": "t", "drafter": DrafterSettings(model="d")}
    base.update(changes)
    return EngineSettings(**base)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"num_extra_draft_tokens": -1}, "num_extra_draft_tokens"),
        ({"num_speculative_tokens": 10, "num_extra_draft_tokens": 7}, "num_extra_draft_tokens"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"model": ""}, "model"),
        ({"drafter": DrafterSettings(model="")}, "drafter.model"),
        ({"mode": Mode.VLLM_SD, "num_extra_draft_tokens": 2}, "num_extra_draft_tokens"),
        ({"auto": {"allowed_modes": ("vllm-sd",)}}, "auto"),
        ({"auto": {"k_candidates": (1, 4)}}, "auto.k_candidates"),  # the engine drafts at most 3 here
        ({"lookahead_fanout": 0}, "lookahead_fanout"),
        ({"lookahead_fanout": 17}, "lookahead_fanout"),
        ({"mode": Mode.LOOKAHEAD, "num_extra_draft_tokens": 1}, "num_extra_draft_tokens"),
        ({"draft_length": "dynamic"}, "draft_length"),
        ({"draft_length": "adaptive", "num_extra_draft_tokens": 1}, "num_extra_draft_tokens"),
        ({"mode": Mode.LOOKAHEAD, "draft_length": "adaptive"}, "draft_length"),
        ({"mode": Mode.AR, "draft_length": "adaptive"}, "draft_length"),
    ],
)
def test_invalid_engine_settings_name_the_field(changes, field):
    with pytest.raises(SettingsError) as info:
        make(**changes)
    assert info.value.field_name == field
    assert field in str(info.value)


def test_unknown_mode_names_the_field_and_the_choices():
    with pytest.raises(SettingsError) as info:
        Mode.parse("turbo")
    assert info.value.field_name == "mode"
    assert "psd" in str(info.value) and "vllm-sd" in str(info.value)


def test_lookahead_is_a_drafting_mode_whose_fanout_reaches_the_scheduler():
    settings = make(mode=Mode.parse("lookahead"), lookahead_fanout=3)
    assert settings.mode is Mode.LOOKAHEAD and Mode.LOOKAHEAD.uses_drafter
    scheduler = SchedulerSettings.from_engine(settings, drafter=None, async_steps=False, lend_cpu_cores=())
    assert SchedulerSettings.from_config(scheduler.to_config()).lookahead_fanout == 3


def test_adaptive_draft_length_reaches_the_scheduler():
    settings = make(mode=Mode.SD, draft_length="adaptive")
    scheduler = SchedulerSettings.from_engine(settings, drafter=None, async_steps=False, lend_cpu_cores=())
    assert SchedulerSettings.from_config(scheduler.to_config()).draft_length == "adaptive"


def test_ar_needs_no_draft_model():
    assert make(mode=Mode.AR, drafter=DrafterSettings(model="")).mode is Mode.AR


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (SamplingSettings(max_tokens=0), "max_tokens"),
        (SamplingSettings(max_tokens=-3), "max_tokens"),
        (SamplingSettings(temperature=-0.1), "temperature"),
        (SamplingSettings(top_p=0.0), "top_p"),
        (SamplingSettings(top_k=-1), "top_k"),
        (SamplingSettings(seed=-1), "seed"),
    ],
)
def test_invalid_sampling_names_the_field(sampling, field):
    with pytest.raises(RequestError) as info:
        sampling.validate()
    assert info.value.field_name == field


def test_auto_choices_from_the_command_line_build_an_engine_for_the_longest_draft(tmp_path):
    from minedraft.cli import build_parser, settings_from_args

    args = build_parser().parse_args(["run", "--model", "t", "--draft", "d", "--mode", "auto", "--auto-modes",
                                      "sd,psd", "--auto-k", "2,4,6", "--prompt", "x"])
    settings = settings_from_args(args)
    assert settings.auto == {"allowed_modes": ("sd", "psd"), "k_candidates": (2, 4, 6)}
    assert settings.max_draft_tokens_per_request == 6
    bad = build_parser().parse_args(["run", "--model", "t", "--draft", "d", "--auto-k", "2,x", "--prompt", "x"])
    with pytest.raises(SettingsError) as info:
        settings_from_args(bad)
    assert info.value.field_name == "auto.k_candidates"


ENGINE_COMMANDS = (["serve"], ["run"], ["generate", "--prompts-file", "p"], ["bench", "--json", "o.json"])


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_every_engine_command_takes_the_gpu_flags(command):
    from minedraft.cli import build_parser, settings_from_args

    args = build_parser().parse_args([
        *command, "--model", "t", "--draft", "d", "--dtype", "bfloat16", "--tensor-parallel-size", "4",
        "--gpu-memory-utilization", "0.85", "--drafter-gpu", "4", "--drafter-backend", "vllm",
        "--drafter-gpu-memory-utilization", "0.5", "--max-model-len", "32768",
        "--vllm-arg=--enable-prefix-caching", "--vllm-arg=--max-num-batched-tokens=8192"])
    settings = settings_from_args(args)
    assert (settings.dtype, settings.tensor_parallel_size, settings.gpu_memory_utilization) == ("bfloat16", 4, 0.85)
    assert (settings.drafter.gpu_index, settings.drafter.backend, settings.drafter.gpu_memory_utilization) == (
        4, "vllm", 0.5)
    assert settings.max_model_len == 32768
    assert settings.extra_vllm_args == {"enable_prefix_caching": True, "max_num_batched_tokens": 8192}


def test_engine_flag_defaults_leave_the_choices_to_the_machine_and_the_model():
    from minedraft.cli import build_parser, settings_from_args

    settings = settings_from_args(build_parser().parse_args(["run", "--model", "t", "--draft", "d"]))
    assert (settings.dtype, settings.drafter.backend, settings.max_model_len) == ("auto", "auto", 0)
    assert (settings.tensor_parallel_size, settings.target_gpus, settings.extra_vllm_args) == (1, (), {})


@pytest.mark.parametrize(
    ("vllm_args", "field"),
    [
        (["--max-num-batched-tokns=8192"], "vllm_args"),  # a typo: vLLM's own parser refuses it
        (["--max-num-batched-tokens=lots"], "vllm_args"),
        (["--pipeline-parallel-size=2"], "vllm_args.pipeline_parallel_size"),
        (["--async-scheduling"], "vllm_args.async_scheduling"),
        (["--data-parallel-size=2"], "vllm_args.data_parallel_size"),
        (["--tensor-parallel-size=2"], "vllm_args.tensor_parallel_size"),
        (["--dtype=half"], "vllm_args.dtype"),
        (["--speculative-config", '{"method": "ngram"}'], "vllm_args.speculative_config"),
        # The APIs send log-probabilities, and reproducible seeds rewrite processed logits.
        (["--logprobs-mode=processed_logprobs"], "vllm_args.logprobs_mode"),
        (["--logprobs-mode=raw_logits"], "vllm_args.logprobs_mode"),
    ],
)
def test_vllm_pass_through_is_checked_by_vllms_parser_and_our_rules(vllm_args, field):
    from minedraft.engine.settings import parse_vllm_args

    with pytest.raises(SettingsError) as info:
        parse_vllm_args(vllm_args)
    assert info.value.field_name == field


def test_pipeline_parallelism_is_refused_even_when_set_directly():
    with pytest.raises(SettingsError) as info:
        make(extra_vllm_args={"pipeline_parallel_size": 2})
    assert info.value.field_name == "vllm_args.pipeline_parallel_size"
    assert "batch queue" in str(info.value)
    assert make(extra_vllm_args={"pipeline_parallel_size": 1}).extra_vllm_args == {"pipeline_parallel_size": 1}


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"dtype": "fp8"}, "dtype"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"tensor_parallel_size": 9}, "tensor_parallel_size"),
        ({"tensor_parallel_size": 2, "target_gpus": (0,)}, "target_gpus"),
        ({"tensor_parallel_size": 2, "target_gpus": (1, 1)}, "target_gpus"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"drafter": DrafterSettings(model="d", gpu_memory_utilization=0.0)}, "drafter.gpu_memory_utilization"),
        ({"drafter": DrafterSettings(model="d", backend="onnx")}, "drafter.backend"),
        ({"drafter": DrafterSettings(model="d", backend="torch", gpu_index=1)}, "drafter.backend"),
        ({"tensor_parallel_size": 2, "target_gpus": (0, 1), "drafter": DrafterSettings(model="d", gpu_index=1)},
         "drafter.gpu_index"),
        ({"target_gpus": (3,), "drafter": DrafterSettings(model="d", gpu_index=3)}, "drafter.gpu_index"),
        ({"max_model_len": 8}, "max_model_len"),
    ],
)
def test_invalid_gpu_settings_name_the_field(changes, field):
    with pytest.raises(SettingsError) as info:
        make(**changes)
    assert info.value.field_name == field


def test_the_pod_command_for_the_papers_layout_is_accepted_and_maps_devices():
    """The engine command the operator renders for targetGPUs 4, dtype bfloat16 and a Qwen3 pair: our parser and
    settings validation accept it, vLLM's EngineArgs take the arguments, and the five GPUs of the pod split 4 + 1."""
    from minedraft.cli import build_parser, settings_from_args
    from minedraft.engine.core import engine_args
    from minedraft.engine.placement import DeviceInfo, plan_devices

    command = ["serve", "--host", "0.0.0.0", "--grpc-port", "50051", "--model", "/models/target/Qwen3-32B",
               "--draft", "/models/draft/Qwen3-1.7B", "--mode", "psd", "--num-speculative-tokens", "3",
               "--dtype", "bfloat16", "--tensor-parallel-size", "4", "--drafter-gpu", "4", "--drafter-backend",
               "vllm", "--max-num-seqs", "64", "--max-model-len", "32768"]
    settings = settings_from_args(build_parser().parse_args(command))
    args = engine_args(settings)
    assert (args.tensor_parallel_size, args.dtype, args.max_model_len) == (4, "bfloat16", 32768)
    assert args.pipeline_parallel_size == 1 and not args.async_scheduling
    plan = plan_devices(settings, DeviceInfo(visible_gpus=("0", "1", "2", "3", "4")))
    assert (plan.target_visible_devices, plan.drafter_visible_devices) == ("0,1,2,3", "4")


def test_a_vllm_argument_typo_is_a_one_line_cli_error(capsys):
    from minedraft.cli import main

    code = main(["run", "--model", "t", "--draft", "d", "--vllm-arg=--max-num-batched-tokns=8192"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("minedraft: error: vllm_args: ") and "max-num-batched-tokns" in err[-1]


def test_tensor_parallel_workers_are_spawned_not_forked(monkeypatch):
    """`minedraft serve` loads the engine in a process that already runs gRPC, HTTP and ZMQ threads: vLLM would fork
    its TP workers from it on a GPU machine (its default until CUDA is initialised, which the engine process avoids),
    copying those threads' locks. The engine's process setup asks for spawn before vLLM starts any worker."""
    import os

    from minedraft.cli import build_parser, settings_from_args
    from minedraft.engine.core import _configure_process
    from minedraft.engine.placement import DeviceInfo, plan_devices

    for name in ("VLLM_WORKER_MULTIPROC_METHOD", "CUDA_VISIBLE_DEVICES", "VLLM_ENABLE_V1_MULTIPROCESSING",
                 "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_LOGGING_STREAM"):
        monkeypatch.delenv(name, raising=False)
    command = ["serve", "--model", "/models/t", "--draft", "/models/d", "--tensor-parallel-size", "2",
               "--drafter-gpu", "2", "--drafter-backend", "vllm"]
    settings = settings_from_args(build_parser().parse_args(command))
    _configure_process(settings, plan_devices(settings, DeviceInfo(visible_gpus=("0", "1", "2"))))
    assert os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
