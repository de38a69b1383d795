"""extraArgs from the MineDraft to vLLM's own parser: values with spaces (JSON-valued flags) pass through intact,
and a reserved flag written as one word (`"--max-model-len 4096"`) is refused like `--max-model-len=4096`.

The whole path runs here: the operator's rendered container command, parsed by `minedraft serve`'s real argument
parser, its --vllm-arg values split as the engine splits them, and (where vLLM is installed) vLLM's own EngineArgs
parser reading the result.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from minedraft.engine_options import _split_vllm_args
from minedraft.operator import render
from minedraft.operator import spec as s

HF_OVERRIDES = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
COMPILATION = '{"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4]}'


def doc(extra_args: list[str]) -> dict[str, Any]:
    return {"metadata": {"name": "q", "namespace": "serving", "uid": "u"},
            "spec": {"target": {"source": {"huggingFace": {"id": "Qwen/Qwen3-8B"}}},
                     "draft": {"source": {"huggingFace": {"id": "Qwen/Qwen3-0.6B"}}},
                     "engine": {"extraArgs": extra_args}}}


def vllm_argv(extra_args: list[str]) -> list[str]:
    """What reaches vLLM's parser: the rendered command through `minedraft serve`'s parser and the engine's split."""
    from minedraft.cli import build_parser

    manifests = render.render_resource(doc(extra_args))
    deployment = next(m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == "q-engine")
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    return _split_vllm_args(build_parser().parse_args(command[1:]).vllm_arg)


@pytest.mark.parametrize("extra", [
    ["--hf-overrides", json.dumps(HF_OVERRIDES)],
    [f"--hf-overrides={json.dumps(HF_OVERRIDES)}"],
    [f"--hf-overrides {json.dumps(HF_OVERRIDES)}"],
], ids=["two-words", "equals", "one-word"])
def test_json_values_with_spaces_reach_vllm_intact(extra: list[str]) -> None:
    argv = vllm_argv([*extra, "--compilation-config", COMPILATION, "--enforce-eager"])
    # Each value is one argument, whole (the engine used to cut `--flag={"a": 1}` at its first space).
    joined = {a.split("=", 1)[0]: a.split("=", 1)[1] if "=" in a else None for a in argv if a.startswith("--")}
    assert json.loads(joined["--hf-overrides"] or argv[argv.index("--hf-overrides") + 1]) == HF_OVERRIDES
    assert json.loads(joined["--compilation-config"] or "") == json.loads(COMPILATION)
    assert "--enforce-eager" in argv


def test_the_engine_split_keeps_what_follows_an_equals_sign() -> None:
    assert _split_vllm_args(['--hf-overrides={"a": 1, "b": [1, 2]}']) == ['--hf-overrides={"a": 1, "b": [1, 2]}']
    # A space before any `=` still separates flag and value (`--vllm-arg "--flag value"`).
    assert _split_vllm_args(["--max-num-batched-tokens 8192"]) == ["--max-num-batched-tokens", "8192"]
    assert _split_vllm_args(['--hf-overrides {"a": 1}']) == ["--hf-overrides", '{"a": 1}']
    assert _split_vllm_args(["--enforce-eager"]) == ["--enforce-eager"]


def test_vllm_parses_the_json_values() -> None:
    """vLLM's own EngineArgs parser, as the engine calls it (skipped where vLLM is not installed)."""
    pytest.importorskip("vllm")
    from minedraft.engine.settings import parse_vllm_args

    parsed = parse_vllm_args(vllm_argv(["--hf-overrides", json.dumps(HF_OVERRIDES)]))
    assert parsed["hf_overrides"] == HF_OVERRIDES


@pytest.mark.parametrize("extra", [["--max-model-len 4096"], ["--max-model-len=4096"], ["--max-model-len", "4096"],
                                   ["--tensor-parallel-size 2"]])
def test_a_reserved_flag_is_refused_however_written(extra: list[str]) -> None:
    with pytest.raises(s.SpecError, match=r"spec\.engine\.extraArgs: --(max-model-len|tensor-parallel-size) is set"):
        s.parse_spec(doc(extra)["spec"])


def test_an_engine_flag_written_as_one_word_stays_the_engines() -> None:
    """`--gpu-memory-utilization 0.85` as one word is the engine's own flag, not a vLLM pass-through."""
    manifests = render.render_resource(doc(["--gpu-memory-utilization 0.85"]))
    command = next(m for m in manifests if m["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0][
        "command"]
    assert command[-1] == "--gpu-memory-utilization=0.85"
