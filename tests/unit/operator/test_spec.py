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
    (minimal(speculation={"mode": "fast"}), "spec.speculation.mode: must be one of psd, sd, lookahead, ar, vllm-sd, "
                                                 "auto"),
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
     "spec.autoscaling.speculation.allowedModes: must be a non-empty list of psd, sd, lookahead, ar"),
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
    (minimal(speculation={"mode": "lookahead", "lookaheadFanout": 0}),
     "spec.speculation.lookaheadFanout: must be between 1 and 16 (got 0)"),
    (minimal(speculation={"mode": "lookahead", "lookaheadFanout": 17}),
     "spec.speculation.lookaheadFanout: must be between 1 and 16 (got 17)"),
    (minimal(speculation={"mode": "lookahead", "lookaheadFanout": "6"}),
     "spec.speculation.lookaheadFanout: must be an integer"),
    (minimal(speculation={"mode": "psd", "lookaheadFanout": 4}),
     "spec.speculation.lookaheadFanout: needs mode lookahead, or auto with lookahead in "
     "autoscaling.speculation.allowedModes (mode is psd)"),
    (minimal(speculation={"mode": "auto", "lookaheadFanout": 4},
             autoscaling={"speculation": {"allowedModes": ["psd", "ar"]}}),
     "spec.speculation.lookaheadFanout: needs mode lookahead, or auto with lookahead in "
     "autoscaling.speculation.allowedModes (mode is auto, allowed psd, ar)"),
    (minimal(speculation={"mode": "lookahead", "numExtraDraftTokens": 2}),
     "spec.speculation.numExtraDraftTokens: extra drafts need mode psd or sd (mode is lookahead)"),
    (minimal(speculation={"mode": "lookahead", "asyncSteps": True}),
     "spec.speculation.asyncSteps: async steps need mode psd, sd or auto (mode is lookahead"),
    (minimal(speculation={"mode": "lookahead"}, autoscaling={"speculation": {"allowedModes": ["psd", "sd"]}}),
     "spec.autoscaling.speculation.allowedModes: must include the fixed mode lookahead"),
    (minimal(speculation={"mode": "lookahead"}, engine={"targetGPUs": 8}),
     "spec.engine.targetGPUs: targetGPUs plus the drafter's GPU (9) must fit on one node"),
])
def test_errors_name_the_field(data: Any, expected: str) -> None:
    found = errors(data)
    assert any(e.startswith(expected) for e in found), found


def test_lookahead_is_a_mode_with_an_optional_fanout() -> None:
    spec = s.parse_spec(minimal(speculation={"mode": "lookahead", "numSpeculativeTokens": 2, "lookaheadFanout": 8}))
    assert spec.speculation == s.SpeculationSpec("lookahead", 2, 0, False, 8)
    assert spec.runs_lookahead and spec.needs_drafter_gpu
    # Unset: the engine's own default (no fan-out of the operator's).
    assert s.parse_spec(minimal(speculation={"mode": "lookahead"})).speculation.lookahead_fanout is None
    for fanout in (s.MIN_LOOKAHEAD_FANOUT, s.MAX_LOOKAHEAD_FANOUT):
        assert s.parse_spec(minimal(speculation={"mode": "lookahead", "lookaheadFanout": fanout})
                            ).speculation.lookahead_fanout == fanout
    # Auto with lookahead among its modes takes a fan-out too: by default, and when allowedModes name it.
    assert s.parse_spec(minimal(speculation={"lookaheadFanout": 3})).speculation.lookahead_fanout == 3
    allowed = s.parse_spec(minimal(speculation={"lookaheadFanout": 3},
                                   autoscaling={"speculation": {"allowedModes": ["lookahead", "ar"]}}))
    assert allowed.runs_lookahead and allowed.needs_drafter_gpu
    # Fixed lookahead within autoscaling bounds that allow it.
    fixed = s.parse_spec(minimal(speculation={"mode": "lookahead"},
                                 autoscaling={"speculation": {"allowedModes": ["lookahead"]}}))
    assert fixed.speculation.mode == "lookahead"


def test_auto_allows_lookahead_by_default() -> None:
    """As `minedraft serve` does: auto chooses among psd, sd, lookahead and ar unless allowedModes narrow it."""
    assert s.SpeculationBounds().allowed_modes == ("psd", "sd", "lookahead", "ar")
    assert "lookahead" in s.AUTO_MODES and "lookahead" in s.MODES
    assert s.parse_spec(minimal()).auto_modes == ("psd", "sd", "lookahead", "ar")
    assert s.parse_spec(minimal(autoscaling={})).auto_modes == ("psd", "sd", "lookahead", "ar")
    assert s.parse_spec(minimal()).runs_lookahead
    narrowed = s.parse_spec(minimal(autoscaling={"speculation": {"allowedModes": ["psd", "ar"]}}))
    assert not narrowed.runs_lookahead


def test_lookahead_drafts_on_a_device_of_its_own() -> None:
    """Lookahead pre-drafts while the target verifies: the drafter's own GPU, as psd's (or the drafter pool)."""
    assert "lookahead" in s.DRAFTER_GPU_MODES
    only = s.parse_spec(minimal(autoscaling={"speculation": {"allowedModes": ["lookahead", "ar"]}}))
    assert only.needs_drafter_gpu
    pooled = s.parse_spec(minimal(speculation={"mode": "lookahead"},
                                  drafterPool={"tokenSecretRef": {"name": "pool-token"}}))
    assert pooled.drafter_pool is not None


def test_operator_bounds_agree_with_the_engine() -> None:
    from minedraft.engine.control.auto import AUTO_CHOICES
    from minedraft.engine.settings import MAX_LOOKAHEAD_FANOUT, Mode

    assert s.MAX_LOOKAHEAD_FANOUT == MAX_LOOKAHEAD_FANOUT and s.MIN_LOOKAHEAD_FANOUT == 1
    assert set(s.AUTO_MODES) == set(AUTO_CHOICES)
    assert set(s.MODES) == {m.value for m in Mode}
    assert "--lookahead-fanout" in s.RESERVED_ENGINE_FLAGS


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
