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
    assert spec.speculation == s.SpeculationSpec("psd", 3, 0)
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
    (minimal(autoscaling={"minReplicas": 5, "maxReplicas": 2}), "spec.autoscaling.minReplicas: must not exceed"),
    (minimal(autoscaling={"maxReplicas": 3}, replicas=7), "spec.replicas: must lie within autoscaling bounds"),
    (minimal(autoscaling={"speculation": {"minSpeculativeTokens": 6, "maxSpeculativeTokens": 2}}),
     "spec.autoscaling.speculation.minSpeculativeTokens: must not exceed"),
    (minimal(autoscaling={"speculation": {"allowedModes": ["psd", "warp"]}}),
     "spec.autoscaling.speculation.allowedModes"),
    (minimal(autoscaling={"targetUtilization": 1.5}), "spec.autoscaling.targetUtilization"),
    (minimal(engine={"memory": "lots"}), "spec.engine.memory: must be a Kubernetes quantity"),
    (minimal(engine={"targetGPUs": 2}), "spec.engine.targetGPUs: must be between 1 and 1"),
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
    assert s.parse_meta({"name": "ok", "namespace": "ns", "uid": "u", "generation": 4}).generation == 4
