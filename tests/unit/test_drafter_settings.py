"""The drafter's hang threshold: a setting of its own, separate from the draft deadline, validated by name."""

import math

import pytest

from minedraft.engine.settings import DEFAULT_HANG_SECONDS, DrafterSettings, EngineSettings, SettingsError


@pytest.mark.parametrize("hang_seconds", [0.0, 0.5, -3.0, math.nan])
def test_a_hang_threshold_too_short_to_see_progress_reports_names_the_field(hang_seconds):
    with pytest.raises(SettingsError) as info:
        EngineSettings(model="t", drafter=DrafterSettings(model="d", hang_seconds=hang_seconds))
    assert info.value.field_name == "drafter.hang_seconds"


def test_the_hang_threshold_is_not_the_draft_deadline_from_flag_to_scheduler():
    from minedraft.cli import build_parser, settings_from_args
    from minedraft.engine.core import engine_args

    args = build_parser().parse_args(["run", "--model", "t", "--draft", "d", "--prompt", "x",
                                      "--draft-deadline-seconds", "2", "--drafter-hang-seconds", "45"])
    settings = settings_from_args(args)
    assert (settings.drafter.deadline_seconds, settings.drafter.hang_seconds) == (2.0, 45.0)
    config = engine_args(settings).additional_config["minedraft"]
    assert (config["deadline_seconds"], config["hang_seconds"]) == (2.0, 45.0)
    default = settings_from_args(build_parser().parse_args(["run", "--model", "t", "--draft", "d", "--prompt", "x"]))
    assert default.drafter.hang_seconds == DEFAULT_HANG_SECONDS > default.drafter.deadline_seconds


def test_a_target_stretched_by_hf_overrides_gets_a_drafter_stretched_the_same_way():
    """RoPE scaling given to the target through vLLM's --hf-overrides reaches the drafter's settings (both backends
    apply them), and only the context-stretching keys do."""
    import json

    from minedraft.cli import build_parser, settings_from_args
    from minedraft.engine.core import drafter_process_settings

    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    overrides = {"rope_parameters": rope, "max_position_embeddings": 8192, "num_hidden_layers": 2}
    args = build_parser().parse_args(["run", "--model", "t", "--draft", "d", "--prompt", "x",
                                      f"--vllm-arg=--hf-overrides={json.dumps(overrides)}"])
    settings = settings_from_args(args)
    assert drafter_process_settings(settings)["hf_overrides"] == {"rope_parameters": rope,
                                                                  "max_position_embeddings": 8192}
    plain = settings_from_args(build_parser().parse_args(["run", "--model", "t", "--draft", "d", "--prompt", "x"]))
    assert drafter_process_settings(plain)["hf_overrides"] is None


def test_the_drafter_service_takes_a_context_stretch_as_a_json_object_and_names_the_flag(capsys):
    from minedraft.cli import build_parser

    rope = '{"rope_parameters": {"rope_type": "linear", "factor": 4.0}, "max_position_embeddings": 8192}'
    args = build_parser().parse_args(["drafter", "--token-file", "t", "--hf-overrides", rope])
    assert args.hf_overrides["rope_parameters"]["rope_type"] == "linear"
    for bad in ("[1, 2]", "{not json"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["drafter", "--token-file", "t", "--hf-overrides", bad])
        assert "--hf-overrides" in capsys.readouterr().err
