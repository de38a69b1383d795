"""engine.maxNumSeqsFromKV: the operator renders `--max-num-seqs-from-kv` so each engine sizes its batch from the KV
cache its placement leaves on the target's GPU (maxNumSeqs the ceiling); refused at admission naming the field."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from minedraft.engine.batch_limit import sized_max_num_seqs
from minedraft.operator import render
from minedraft.operator import spec as s
from minedraft.operator.admission import admit
from minedraft.twin.capacity import MIB, footprint
from minedraft.twin.curves import load_curves

from .test_crd import SCHEMA as CRD_SCHEMA
from .test_crd import apply_defaults, with_spec
from .test_render import engine_container

ROOT = Path(__file__).resolve().parents[3]
H200_CURVES = ROOT / "benchmarks" / "curves" / "h200-qwen3-32b.json"
# One H200 as NVML reports it (141 GB).
H200_BYTES = 143771 * MIB


def engine_args(**changes: Any) -> argparse.Namespace:
    """The rendered engine command of the minimal example with `changes`, through the engine's own CLI parser."""
    from minedraft.cli import build_parser

    doc = with_spec("minimal", **changes)
    assert admit(doc) == []
    command = engine_container(render.render_resource(doc))["command"]
    assert command[:2] == ["minedraft", "serve"]
    return build_parser().parse_args(command[1:])


def test_the_flag_is_rendered_only_when_asked_for_and_parses_with_the_engine_cli() -> None:
    plain = engine_args()
    assert plain.max_num_seqs_from_kv is None and plain.max_num_seqs == s.EngineSpec().max_num_seqs
    assert "--max-num-seqs-from-kv" not in engine_container(render.render_resource(with_spec("minimal")))["command"]
    sized = engine_args(engine__maxNumSeqsFromKV={"requestTokens": 1280}, engine__maxNumSeqs=512)
    # maxNumSeqs stays on the command: the engine's ceiling for the sized batch.
    assert sized.max_num_seqs_from_kv == 1280 and sized.max_num_seqs == 512


def test_the_engine_caps_the_sized_batch_at_the_rendered_max_num_seqs(monkeypatch: pytest.MonkeyPatch) -> None:
    from minedraft.cli import settings_from_args
    from minedraft.engine import batch_limit

    ceilings: list[int] = []

    def resize(settings: Any, request_tokens: int, log: Any = None, ceiling: int = batch_limit.CEILING) -> Any:
        ceilings.append(ceiling)
        return settings

    monkeypatch.setattr(batch_limit, "resize", resize)
    args = engine_args(engine__maxNumSeqsFromKV={"requestTokens": 1280}, engine__maxNumSeqs=96)
    args.model, args.draft = "t", "d"  # no hub downloads: resize (stubbed here) is what reads the models
    assert settings_from_args(args).max_num_seqs == 96 and ceilings == [96]
    # Without --max-num-seqs (a person's command line) only the engine's own ceiling bounds it.
    from minedraft.cli import build_parser

    settings_from_args(build_parser().parse_args(["serve", "--model", "t", "--draft", "d",
                                                  "--max-num-seqs-from-kv", "1280"]))
    assert ceilings[-1] == batch_limit.CEILING


def _limit(args: argparse.Namespace) -> int:
    """The batch the engine started from `args` sizes on one H200 for Qwen3-32B with Qwen3-1.7B drafting (bf16, the
    footprints of the repository's H200 curve file), colocated exactly where batch_limit.resize says: vllm-sd."""
    curves = load_curves(H200_CURVES)
    target = footprint(curves.models["qwen3-32b"], "bfloat16")
    drafter = footprint(curves.models["qwen3-1.7b"], "bfloat16")
    return sized_max_num_seqs(H200_BYTES, target, drafter, colocated=args.mode == "vllm-sd",
                              request_tokens=args.max_num_seqs_from_kv,
                              lookahead_tokens=args.num_speculative_tokens, ceiling=args.max_num_seqs)


def test_an_off_gpu_drafter_leaves_the_engine_a_larger_batch_than_vllm_sd_at_the_same_request_length() -> None:
    sized = {"engine__maxNumSeqsFromKV": {"requestTokens": 1280}, "engine__maxNumSeqs": 1024}
    colocated = engine_args(speculation__mode="vllm-sd", **sized)
    off_gpu = engine_args(speculation__mode="psd", **sized)
    assert off_gpu.max_num_seqs_from_kv == colocated.max_num_seqs_from_kv == 1280
    assert colocated.drafter_gpu is None and off_gpu.drafter_gpu == 1  # the drafter's own device
    # The colocated drafter's weights and KV are requests here (200 vs 130 at k=3, about 1.5x).
    assert (_limit(colocated), _limit(off_gpu)) == (130, 200)
    # maxNumSeqs is the ceiling: below the sized batch, it is the limit.
    assert _limit(engine_args(speculation__mode="psd", engine__maxNumSeqsFromKV={"requestTokens": 1280},
                              engine__maxNumSeqs=150)) == 150


@pytest.mark.parametrize(("engine", "field"), [
    ({"maxNumSeqsFromKV": {"requestTokens": 0}}, "spec.engine.maxNumSeqsFromKV.requestTokens"),
    ({"maxNumSeqsFromKV": {"requestTokens": s.MAX_MODEL_LEN + 1}}, "spec.engine.maxNumSeqsFromKV.requestTokens"),
    ({"maxNumSeqsFromKV": {"requestTokens": "4k"}}, "spec.engine.maxNumSeqsFromKV.requestTokens"),
    ({"maxNumSeqsFromKV": {}}, "spec.engine.maxNumSeqsFromKV.requestTokens"),
    ({"maxNumSeqsFromKV": {"requestTokens": 8192}, "maxModelLen": 4096},
     "spec.engine.maxNumSeqsFromKV.requestTokens"),
    # Set from the field, never through extraArgs (which would hand it to vLLM's parser, failing at start-up).
    ({"extraArgs": ["--max-num-seqs-from-kv=4096"]}, "spec.engine.extraArgs"),
    ({"extraArgs": ["--max_num_seqs_from_kv", "4096"]}, "spec.engine.extraArgs"),
])
def test_invalid_request_lengths_are_refused_at_admission_and_by_the_parser_naming_the_field(
        engine: dict[str, Any], field: str) -> None:
    doc = with_spec("minimal")
    doc["spec"]["engine"].update(engine)
    refused = admit(doc)
    assert any(field in m for m in refused), refused
    with pytest.raises(s.SpecError) as parsed:
        s.parse_spec(apply_defaults(CRD_SCHEMA, doc)["spec"])
    assert any(field in e for e in parsed.value.errors), parsed.value.errors
