import pytest

from minedraft.engine.requests import RequestError, SamplingSettings
from minedraft.engine.settings import DrafterSettings, EngineSettings, Mode, SettingsError


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
