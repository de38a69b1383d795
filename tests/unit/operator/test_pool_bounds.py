"""A drafter pool sized from bounds (its pod template does not change when the engines scale), rolled and drained
as the engines are, drafting in the engines' dtype (`--dtype auto`: 16-bit on GPUs), and a dozen MineDrafts written
for this test (pools, windows, TP sizes, aliases), each admitted or refused naming the field, by the CRD's rules and
by the operator's own parser."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from minedraft.engine.placement import DeviceInfo
from minedraft.operator import render
from minedraft.operator import spec as s
from minedraft.operator.admission import admit
from minedraft.operator.crd import defaulted
from minedraft.server.drafter_cli import drafts_on_gpu, pool_dtype
from minedraft.server.drafter_metrics import DrafterServiceCollector

from .test_crd import set_path
from .test_render import by_kind, flag

TOKEN = {"tokenSecretRef": {"name": "drafter-token"}}


def minedraft(**changes: Any) -> dict[str, Any]:
    """A MineDraft with a GPU drafter pool, then `changes` (dotted with __, None removes)."""
    doc: dict[str, Any] = {
        "apiVersion": "minedraft.io/v1alpha1", "kind": "MineDraft",
        "metadata": {"name": "chat", "namespace": "serving", "uid": "0f0f0f0f-0000-4000-8000-0000000000aa"},
        "spec": {"target": {"source": {"huggingFace": {"id": "Qwen/Qwen3-8B"}}},
                 "draft": {"source": {"huggingFace": {"id": "Qwen/Qwen3-0.6B"}}},
                 "speculation": {"mode": "psd"}, "drafterPool": copy.deepcopy(TOKEN)}}
    for dotted, value in changes.items():
        set_path(doc["spec"], dotted.split("__"), value)
    return doc


def pool_deployment(doc: dict[str, Any]) -> dict[str, Any]:
    return by_kind(render.render_resource(defaulted(doc)))["Deployment/chat-drafter"]


# -- sized from bounds -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("base", [
    {"autoscaling": {"minReplicas": 1, "maxReplicas": 8}},
    {},
    {"drafterPool__backend": "torch", "drafterPool__window": 512, "drafterPool__maxNumSeqs": 128},
], ids=["autoscaled", "fixed", "torch-window"])
def test_the_pool_pod_template_is_the_same_at_one_and_four_engine_replicas(base: dict[str, Any]) -> None:
    templates = []
    for replicas in (1, 4):
        doc = minedraft(**base)
        doc["spec"]["replicas"] = replicas  # what the autoscaler writes through /scale, or `kubectl scale`
        assert s.parse_spec(defaulted(doc)["spec"]).desired_replicas == replicas
        templates.append(pool_deployment(doc)["spec"]["template"])
    assert templates[0] == templates[1]


def test_the_pools_requests_come_from_bounds() -> None:
    command = pool_deployment(minedraft(autoscaling={"minReplicas": 1, "maxReplicas": 8},
                                        engine__maxNumSeqs=64))["spec"]["template"]["spec"]["containers"][0]["command"]
    assert flag(command, "--max-num-seqs") == str(64 * 8)  # every engine at maxReplicas
    fixed = pool_deployment(minedraft(engine__maxNumSeqs=64))["spec"]["template"]["spec"]["containers"][0]["command"]
    assert flag(fixed, "--max-num-seqs") == str(64 * s.DEFAULT_POOL_ENGINES_PER_POD)
    own = pool_deployment(minedraft(drafterPool__maxNumSeqs=300))["spec"]["template"]["spec"]["containers"][0]
    assert flag(own["command"], "--max-num-seqs") == "300"


def test_a_gpu_pool_rolls_as_the_engines_do_and_has_a_disruption_budget() -> None:
    replace = pool_deployment(minedraft(engine__rolloutStrategy="Replace"))
    assert replace["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    surge = pool_deployment(minedraft())
    assert surge["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    objects = by_kind(render.render_resource(defaulted(minedraft())))
    budget = objects["PodDisruptionBudget/chat-drafter"]
    assert budget["spec"] == {"maxUnavailable": 1,
                              "selector": {"matchLabels": {"minedraft.io/instance": "chat",
                                                           "minedraft.io/component": "drafter"}}}
    assert ("PodDisruptionBudget", "chat-drafter") in render.all_kinds_and_names(s.parse_meta({"name": "chat"}))
    without = by_kind(render.render_resource(defaulted(minedraft(engine__podDisruptionBudget=False))))
    assert "PodDisruptionBudget/chat-drafter" not in without


def test_a_minedraft_scaled_to_zero_frees_the_pools_gpus_too() -> None:
    doc = minedraft(autoscaling={"minReplicas": 0, "maxReplicas": 4})
    doc["spec"]["replicas"] = 0
    idle = pool_deployment(doc)
    assert idle["spec"]["replicas"] == 0
    doc["spec"]["replicas"] = 1
    awake = pool_deployment(doc)
    assert awake["spec"]["replicas"] == 1 and awake["spec"]["template"] == idle["spec"]["template"]


def test_the_torch_pools_kv_is_computed_and_refused_when_it_cannot_fit() -> None:
    spec = s.parse_spec(defaulted(minedraft(drafterPool__backend="torch", drafterPool__window=512,
                                            drafterPool__maxNumSeqs=128))["spec"])
    # Qwen3-0.6B: 28 layers x 8 KV heads x 128 x 2 (K and V) x 2 bytes (16-bit), 516 positions, 264 slots.
    assert s.torch_pool_kv_bytes(spec) == 264 * 516 * 2 * 28 * 8 * 128 * 2
    with pytest.raises(s.SpecError) as info:
        s.parse_spec(defaulted(minedraft(drafterPool__backend="torch", drafterPool__window=512,
                                         drafterPool__gpuMemory="24Gi"))["spec"])
    assert any(e.startswith("spec.drafterPool.maxNumSeqs: the torch pool preallocates") for e in info.value.errors)
    # A CPU pool: float32, in the pod's memory limit.
    cpu = s.parse_spec(defaulted(minedraft(drafterPool__backend="torch", drafterPool__gpus=0,
                                           drafterPool__window=512, drafterPool__maxNumSeqs=16))["spec"])
    assert s.torch_pool_kv_bytes(cpu) == 40 * 516 * 2 * 28 * 8 * 128 * 4


# -- the engines' dtype ----------------------------------------------------------------------------------------------


def test_a_gpu_pool_with_dtype_unset_drafts_in_a_16_bit_dtype() -> None:
    from minedraft.cli import build_parser

    command = pool_deployment(minedraft())["spec"]["template"]["spec"]["containers"][0]["command"]
    args = build_parser().parse_args(command[1:])
    assert args.dtype == "auto"
    on_gpu = drafts_on_gpu(args.backend, args.device, DeviceInfo(visible_gpus=("0",)))
    assert on_gpu
    for draft_dtype, resolved in ((None, "bfloat16"), ("float32", "bfloat16"), ("bfloat16", "bfloat16"),
                                  ("float16", "float16")):
        assert pool_dtype(args.dtype, on_gpu, draft_dtype) == resolved
    # A windowed torch pool on its GPU too; a CPU pool drafts in float32 (as the engines on CPUs).
    torch_gpu = pool_deployment(minedraft(drafterPool__backend="torch", drafterPool__window=512,
                                          drafterPool__maxNumSeqs=64))["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(torch_gpu["command"][1:])
    assert pool_dtype(args.dtype, drafts_on_gpu(args.backend, args.device, DeviceInfo()), None) == "bfloat16"
    cpu = pool_deployment(minedraft(drafterPool__backend="torch", drafterPool__gpus=0, drafterPool__window=512,
                                    drafterPool__maxNumSeqs=16))["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(cpu["command"][1:])
    assert pool_dtype(args.dtype, drafts_on_gpu(args.backend, args.device, DeviceInfo()), None) == "float32"
    # An explicit engine dtype is the pool's.
    explicit = pool_deployment(minedraft(engine__dtype="float16"))["spec"]["template"]["spec"]["containers"][0]
    assert flag(explicit["command"], "--dtype") == "float16"


def test_the_drafter_cli_no_longer_defaults_to_float32() -> None:
    from minedraft.cli import build_parser

    args = build_parser().parse_args(["drafter", "--token-file", "/t"])
    assert args.dtype == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["drafter", "--token-file", "/t", "--dtype", "fp8"])


def test_the_pools_resolved_dtype_is_a_metric() -> None:
    collector = DrafterServiceCollector()
    collector.info = {"dtype": "bfloat16", "backend": "vllm", "max_num_seqs": "1024"}
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert 'minedraft_drafter_info{backend="vllm",dtype="bfloat16",max_num_seqs="1024"} 1.0' in text


# -- MineDrafts written for this test: admitted, or refused naming the field ----------------------------------------

ADMITTED = {
    "autoscaled-gpu-pool": minedraft(autoscaling={"minReplicas": 0, "maxReplicas": 6},
                                     drafterPool__minReplicas=1, drafterPool__maxReplicas=3),
    "windowed-torch-pool-under-context": minedraft(engine__maxModelLen=8192, drafterPool__backend="torch",
                                                   drafterPool__window=2048, drafterPool__maxNumSeqs=96),
    "cpu-torch-pool": minedraft(drafterPool__gpus=0, drafterPool__backend="torch", drafterPool__window=256,
                                drafterPool__maxNumSeqs=8, drafterPool__memory="16Gi"),
    "tp4-with-aliases": minedraft(engine__targetGPUs=4, drafterPool=None,
                                  servedModelNames=["chat", "qwen3-8b", "gpt-4o-mini"]),
    "tp8-behind-a-pool": minedraft(engine__targetGPUs=8, speculation__mode="sd"),
    "auto-mode-pool-on-an-h200": minedraft(speculation={"mode": "auto", "numSpeculativeTokens": 4},
                                           autoscaling={"maxReplicas": 4,
                                                        "speculation": {"allowedModes": ["psd", "ar"]}},
                                           drafterPool__backend="torch", drafterPool__window=4096,
                                           drafterPool__gpuMemory="141Gi", drafterPool__maxNumSeqs=64),
}

# (doc, field named, whether the CRD's rules refuse it too or only the operator (its parser: a status condition))
REFUSED = {
    "tp3": (minedraft(engine__targetGPUs=3), "spec.engine.targetGPUs", True),
    "tp5-no-pool": (minedraft(engine__targetGPUs=5, drafterPool=None), "spec.engine.targetGPUs", True),
    "tp6-vllm-sd": (minedraft(engine__targetGPUs=6, speculation__mode="vllm-sd", drafterPool=None),
                    "spec.engine.targetGPUs", True),
    "tp7-ar": (minedraft(engine__targetGPUs=7, speculation__mode="ar", drafterPool=None), "spec.engine.targetGPUs",
               True),
    "cpu-pool-on-vllm": (minedraft(drafterPool__gpus=0), "spec.drafterPool.backend", True),
    "two-gpu-pool-pods": (minedraft(drafterPool__gpus=2), "spec.drafterPool.gpus", True),
    "window-equal-to-context": (minedraft(engine__maxModelLen=2048, drafterPool__backend="torch",
                                          drafterPool__window=2048), "spec.drafterPool.window", True),
    "window-beyond-models-context": (minedraft(drafterPool__backend="torch", drafterPool__window=65536,
                                               drafterPool__maxNumSeqs=1), "spec.drafterPool.window", False),
    "torch-pool-kv-over-a-24g-gpu": (minedraft(drafterPool__backend="torch", drafterPool__window=1024,
                                               drafterPool__gpuMemory="24Gi"), "spec.drafterPool.maxNumSeqs", False),
    "duplicate-alias": (minedraft(servedModelNames=["chat", "chat"]), "spec.servedModelNames", True),
    "alias-with-a-space": (minedraft(servedModelNames=["my model"]), "spec.servedModelNames", True),
    "autoscaled-modes-unbounded": (minedraft(autoscaling={"speculation": {"allowedModes": ["psd", "sd", "ar", "psd"]}}),
                                   "spec.autoscaling.speculation.allowedModes", True),
}


@pytest.mark.parametrize("name", sorted(ADMITTED))
def test_unseen_valid_minedrafts_are_admitted_and_render(name: str) -> None:
    doc = ADMITTED[name]
    assert admit(doc) == []
    manifests = render.render_resource(defaulted(doc))
    assert manifests


def _names(message: str, field: str) -> bool:
    return message.split(":", 1)[0].replace(".0", "").replace(".1", "").startswith(field) or field in message


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unseen_invalid_minedrafts_are_refused_naming_the_field(name: str) -> None:
    doc, field, by_the_crd = REFUSED[name]
    refused = admit(doc)
    if by_the_crd:
        assert any(_names(m, field) for m in refused), refused
    else:
        assert refused == [], refused  # the CRD cannot know the model's context or shape: the operator does
    if not refused:
        with pytest.raises(s.SpecError) as info:
            s.parse_spec(defaulted(doc)["spec"])
        assert any(e.startswith(field) for e in info.value.errors), info.value.errors
