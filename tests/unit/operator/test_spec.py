"""Spec parsing: defaults, and errors that name the field."""

from __future__ import annotations

from typing import Any

import pytest

from minedraft.operator import spec as s

HF = {"source": {"huggingFace": {"id": "org/model"}}}


def minimal(**changes: Any) -> dict[str, Any]:
    return {"target": HF, "draft": {"source": {"huggingFace": {"id": "org/draft"}}}, **changes}


def errors(data: Any) -> list[str]:
    with pytest.raises(s.SpecError) as info:
        s.parse_spec(data)
    return info.value.errors


def test_defaults() -> None:
    spec = s.parse_spec(minimal())
    assert spec.speculation == s.SpeculationSpec("auto", 3, 0)
    assert spec.engine.target_gpus == 1 and spec.engine.drafter_gpus == 1
    assert spec.gateway.replicas == 2 and spec.gateway.service_type == "ClusterIP"
    assert spec.desired_replicas == 1 and spec.autoscaling is None
    assert spec.secret_refs() == []


@pytest.mark.parametrize(("data", "expected"), [
    (None, "spec: required"),
    ({"draft": HF}, "spec.target: required"),
    (minimal(target={"source": {"huggingFace": {"id": "a"}, "image": {"path": "/m"}}}),
     "spec.target.source: exactly one of huggingFace, persistentVolumeClaim or image must be set"),
    (minimal(draft={"source": {}}), "spec.draft.source: exactly one of"),
    (minimal(speculation={"numSpeculativeTokens": 0}), "spec.speculation.numSpeculativeTokens: must be between 1"),
    (minimal(speculation={"numSpeculativeTokens": 17}), "spec.speculation.numSpeculativeTokens: must be between"),
    (minimal(speculation={"mode": "fast"}), "spec.speculation.mode: must be one of psd, sd, ar, vllm-sd, auto"),
    (minimal(speculation={"mode": "ar", "numExtraDraftTokens": 2}),
     "spec.speculation.numExtraDraftTokens: extra drafts need mode psd or sd"),
    (minimal(speculation={"mode": "ar", "asyncSteps": True}),
     "spec.speculation.asyncSteps: async steps need mode psd, sd or auto (mode is ar"),
    (minimal(speculation={"mode": "vllm-sd", "asyncSteps": True}),
     "spec.speculation.asyncSteps: async steps need mode psd, sd or auto (mode is vllm-sd"),
    (minimal(speculation={"asyncSteps": "yes"}), "spec.speculation.asyncSteps: must be true or false"),
    (minimal(autoscaling={"minReplicas": 5, "maxReplicas": 2}), "spec.autoscaling.minReplicas: must not exceed"),
    (minimal(speculation={"numSpeculativeTokens": 10, "numExtraDraftTokens": 7}),
     "spec.speculation.numExtraDraftTokens: numSpeculativeTokens + numExtraDraftTokens must be at most 16"),
    (minimal(speculation={"mode": "auto", "numSpeculativeTokens": 9}, autoscaling={}),
     "spec.speculation.numSpeculativeTokens: auto mode starts at k within autoscaling.speculation 1..8"),
    (minimal(speculation={"mode": "auto"}, autoscaling={"speculation": {"allowedModes": ["vllm-sd"]}}),
     "spec.autoscaling.speculation.allowedModes: must be a non-empty list of psd, sd, ar"),
    (minimal(speculation={"mode": "psd"}, autoscaling={"speculation": {"allowedModes": ["ar"]}}),
     "spec.autoscaling.speculation.allowedModes: must include the fixed mode psd"),
    (minimal(engine={"drafterBackend": "torch"}), "spec.engine.drafterBackend: torch is the CPU drafter"),
    (minimal(engine={"extraArgs": ["--max-model-len", "4096"]}), "spec.engine.extraArgs: --max-model-len is set by"),
    (minimal(engine={"extraArgs": ["--dtype=half"]}), "spec.engine.extraArgs: --dtype is set by"),
    (minimal(engine={"extraArgs": ["enforce-eager"]}), "spec.engine.extraArgs: 'enforce-eager' is not a vLLM"),
    (minimal(engine={"dtype": "fp8"}), "spec.engine.dtype: must be one of auto, bfloat16, float16, float32"),
    (minimal(engine={"maxModelLen": 8}), "spec.engine.maxModelLen: must be between 16"),
    (minimal(engine={"env": [{"name": "1X", "value": "a"}]}), "spec.engine.env[0].name"),
    (minimal(engine={"runtimeClassName": "Bad_Name"}), "spec.engine.runtimeClassName: must be a DNS subdomain"),
    (minimal(engine={"ephemeralStorage": "lots"}), "spec.engine.ephemeralStorage: must be a Kubernetes quantity"),
    (minimal(imagePullSecrets=[{"name": "Bad_Name"}]), "spec.imagePullSecrets[0].name: must be a DNS subdomain"),
    (minimal(gateway={"enabled": "no"}), "spec.gateway.enabled: must be true or false"),
    (minimal(autoscaling={"speculation": {"minSpeculativeTokens": 6, "maxSpeculativeTokens": 2}}),
     "spec.autoscaling.speculation.minSpeculativeTokens: must not exceed"),
    (minimal(autoscaling={"speculation": {"allowedModes": ["psd", "warp"]}}),
     "spec.autoscaling.speculation.allowedModes"),
    (minimal(autoscaling={"targetUtilization": 1.5}), "spec.autoscaling.targetUtilization"),
    (minimal(engine={"memory": "lots"}), "spec.engine.memory: must be a Kubernetes quantity"),
    (minimal(engine={"targetGPUs": 9}), "spec.engine.targetGPUs: must be between 1 and 8"),
    (minimal(engine={"drafterGPUs": 2}), "spec.engine.drafterGPUs: must be between 1 and 1"),
    (minimal(target={"source": {"persistentVolumeClaim": {"claimName": "w", "path": "../etc"}}}),
     "spec.target.source.persistentVolumeClaim.path: must be relative"),
    (minimal(target={"source": {"image": {"path": "relative"}}}),
     "spec.target.source.image.path: must be an absolute path"),
    (minimal(gateway={"serviceType": "Ingress"}), "spec.gateway.serviceType: must be one of"),
    (minimal(gateway={"authTokenSecretRef": {"name": "Bad_Name"}}),
     "spec.gateway.authTokenSecretRef.name: must be a DNS subdomain"),
    (minimal(target={"source": {"huggingFace": {"id": "a", "tokenSecretRef": {"name": "t1"}}}},
             draft={"source": {"huggingFace": {"id": "b", "tokenSecretRef": {"name": "t2"}}}}),
     "spec.draft.source.huggingFace.tokenSecretRef: must equal the target's"),
    (minimal(replicas="3"), "spec.replicas: must be an integer"),
])
def test_errors_name_the_field(data: Any, expected: str) -> None:
    found = errors(data)
    assert any(e.startswith(expected) for e in found), found


def test_every_problem_reported_once() -> None:
    assert errors({"draft": HF}) == ["spec.target: required"]
    assert errors(minimal(target={})) == ["spec.target.source: required"]
    found = errors(minimal(speculation={"numSpeculativeTokens": 99}, engine={"cpu": "x"}, gateway={"port": 0}))
    assert len(found) == 3


def test_zero_is_a_value_not_a_default() -> None:
    spec = s.parse_spec(minimal(replicas=0, gateway={"replicas": 0}, autoscaling=None))
    assert spec.replicas == 0 and spec.gateway.replicas == 0 and spec.desired_replicas == 0
    spec = s.parse_spec(minimal(autoscaling={"minReplicas": 0, "maxReplicas": 2}))
    assert spec.desired_replicas == 0


def test_secret_refs_name_their_fields() -> None:
    spec = s.parse_spec(minimal(gateway={"authTokenSecretRef": {"name": "tok", "key": "k"},
                                         "tlsSecretRef": {"name": "tls"}}))
    assert spec.secret_refs() == [("spec.gateway.authTokenSecretRef", s.SecretKeyRef("tok", "k")),
                                  ("spec.gateway.tlsSecretRef", "tls")]


def test_name_must_leave_room_for_suffixes() -> None:
    with pytest.raises(s.SpecError, match=r"metadata.name"):
        s.parse_meta({"name": "x" * 60, "namespace": "ns"})
    with pytest.raises(s.SpecError, match=r"DNS-1035"):
        s.parse_meta({"name": "7b-model", "namespace": "ns"})  # a Service name must start with a letter
    assert s.parse_meta({"name": "x" * s.MAX_NAME_LENGTH, "namespace": "ns"}).name
    assert s.parse_meta({"name": "ok", "namespace": "ns", "uid": "u", "generation": 4}).generation == 4


def test_replicas_are_clamped_into_edited_autoscaling_bounds() -> None:
    """The autoscaler wrote spec.replicas; the user then narrows min/maxReplicas: admitted, and clamped at once."""
    assert s.parse_spec(minimal(autoscaling={"minReplicas": 1, "maxReplicas": 3}, replicas=7)).desired_replicas == 3
    assert s.parse_spec(minimal(autoscaling={"minReplicas": 4, "maxReplicas": 6}, replicas=2)).desired_replicas == 4
    assert s.parse_spec(minimal(autoscaling={"minReplicas": 0, "maxReplicas": 6}, replicas=0)).desired_replicas == 0


def test_users_write_quantities_as_numbers_and_vllm_flags_either_way() -> None:
    spec = s.parse_spec(minimal(engine={"cpu": 16, "memory": "64Gi", "ephemeralStorage": 100,
                                        "extraArgs": ["--gpu-memory-utilization", "0.85", "--enforce-eager",
                                                      "--kv-cache-dtype=fp8"]}))
    assert spec.engine.cpu == "16" and spec.engine.ephemeral_storage == "100"
    assert s.split_extra_args(spec.engine.extra_args) == ["--gpu-memory-utilization=0.85", "--enforce-eager",
                                                          "--kv-cache-dtype=fp8"]
    assert spec.engine.max_model_len is None  # the model's own context length


@pytest.mark.parametrize(("mode", "allowed", "needs"), [
    ("psd", None, True), ("sd", None, True), ("ar", None, False), ("vllm-sd", None, False),
    ("auto", None, True), ("auto", ["ar"], False), ("auto", ["ar", "sd"], True),
])
def test_drafter_gpu_only_for_modes_that_draft_on_it(mode: str, allowed: list[str] | None, needs: bool) -> None:
    autoscaling = {"speculation": {"allowedModes": allowed}} if allowed else None
    spec = s.parse_spec(minimal(speculation={"mode": mode}, autoscaling=autoscaling))
    assert spec.needs_drafter_gpu is needs


def test_replica_capacity_prior_is_optional_and_positive() -> None:
    assert s.parse_spec(minimal(autoscaling={})).autoscaling.replica_capacity_tokens_per_second is None
    spec = s.parse_spec(minimal(autoscaling={"replicaCapacityTokensPerSecond": 2500}))
    assert spec.autoscaling.replica_capacity_tokens_per_second == 2500.0
    for bad in (0, 0.5, -3, "fast", True):
        assert errors(minimal(autoscaling={"replicaCapacityTokensPerSecond": bad})) == [
            f"spec.autoscaling.replicaCapacityTokensPerSecond: must be a number >= 1 (got {bad!r})"]
