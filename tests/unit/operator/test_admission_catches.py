"""Admission catches what would otherwise fail later (issue 30, defect 6): an ApplyFailed on a derived object after
GPU pods exist, a crash at start, a pod Pending forever, or a setting silently dropped.

Each mistake is checked three ways: the API server's answer (the CRD's schema and CEL rules, evaluated by
minedraft.operator.admission as the API server would), the operator's own parser (for MineDrafts admitted before
the CRD had the rule), and `minedraft operator render`, which must refuse what admission refuses.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from minedraft.cli import main
from minedraft.operator import spec as s
from minedraft.operator.admission import admit
from minedraft.operator.crd import defaulted

ROOT = Path(__file__).resolve().parents[3]


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())


def changed(name: str, **changes: Any) -> dict[str, Any]:
    doc = copy.deepcopy(example(name))
    for dotted, value in changes.items():
        node = doc["spec"]
        keys = dotted.split("__")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return doc


# (MineDraft, the field admission names, the field the parser names)
CASES = {
    "engine-http-on-grpc": (changed("minimal", engine__httpPort=50051), "spec.engine.httpPort",
                            "spec.engine.httpPort"),
    "engine-http-on-metrics": (changed("minimal", engine__httpPort=9400), "spec.engine.httpPort",
                               "spec.engine.httpPort"),
    "gateway-http-on-grpc": (changed("minimal", gateway__httpPort=50051), "spec.gateway.httpPort",
                             "spec.gateway.httpPort"),
    "gpus-8-plus-drafter": (changed("minimal", engine__targetGPUs=8), "spec.engine.targetGPUs",
                            "spec.engine.targetGPUs"),
    "gpus-auto-with-psd": (changed("autoscaled", engine__targetGPUs=8), "spec.engine.targetGPUs",
                           "spec.engine.targetGPUs"),
    "zero-without-gateway": (changed("autoscaled", autoscaling__minReplicas=0, gateway__enabled=False),
                             "spec.autoscaling.minReplicas", "spec.autoscaling.minReplicas"),
    "auth-without-gateway": (changed("auth-tls", gateway__enabled=False), "spec.gateway.authTokenSecretRef",
                             "spec.gateway.authTokenSecretRef"),
    "tls-without-gateway": (changed("minimal", gateway__enabled=False, gateway__tlsSecretRef={"name": "tls"}),
                            "spec.gateway.tlsSecretRef", "spec.gateway.tlsSecretRef"),
    "secret-name": (changed("minimal", gateway__authTokenSecretRef={"name": "Gateway_Token"}),
                    "spec.gateway.authTokenSecretRef.name", "spec.gateway.authTokenSecretRef.name"),
    "secret-key": (changed("minimal", gateway__authTokenSecretRef={"name": "gw", "key": "my token"}),
                   "spec.gateway.authTokenSecretRef.key", "spec.gateway.authTokenSecretRef.key"),
    "pvc-name": (changed("minimal", target={"source": {"persistentVolumeClaim": {"claimName": "Models"}}}),
                 "spec.target.source.persistentVolumeClaim.claimName",
                 "spec.target.source.persistentVolumeClaim.claimName"),
    "cache-pvc-name": (changed("minimal", engine__modelCache={"claimName": "hf_cache"}),
                       "spec.engine.modelCache.claimName", "spec.engine.modelCache.claimName"),
    "runtime-class": (changed("minimal", engine__runtimeClassName="NVIDIA"), "spec.engine.runtimeClassName",
                      "spec.engine.runtimeClassName"),
    "pull-secret": (changed("minimal", imagePullSecrets=[{"name": "regcred-"}]), "spec.imagePullSecrets.0.name",
                    "spec.imagePullSecrets[0].name"),
    "tls-secret-name": (changed("minimal", gateway__tlsSecretRef={"name": "a..b"}), "spec.gateway.tlsSecretRef.name",
                        "spec.gateway.tlsSecretRef.name"),
    "env-number": (changed("minimal", engine__env=[{"name": "VLLM_USE_V1", "value": 1}]), "spec.engine.env.0.value",
                   "spec.engine.env[0].value"),
    "env-bool": (changed("minimal", engine__env=[{"name": "NCCL_DEBUG", "value": True}]), "spec.engine.env.0.value",
                 "spec.engine.env[0].value"),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_admission_refuses_naming_the_field(case: str) -> None:
    doc, admission_field, _ = CASES[case]
    found = admit(doc)
    assert any(f.startswith(admission_field + ":") for f in found), found


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_the_parser_refuses_naming_the_field(case: str) -> None:
    doc, _, parser_field = CASES[case]
    with pytest.raises(s.SpecError) as info:
        s.parse_spec(defaulted(doc)["spec"])
    assert any(e.startswith(parser_field + ":") for e in info.value.errors), info.value.errors


def test_what_is_right_is_still_admitted() -> None:
    """The limits are tight, not shifted: 4 target GPUs plus the drafter (7, which would fit the node, divides no
    8-KV-head model), 8 target GPUs for modes without a drafter
    GPU or with a drafter pool, a scale-to-zero MineDraft with its gateway, an engine HTTP port of 8000, quoted env
    values."""
    for doc in (changed("minimal", engine__targetGPUs=4), changed("minimal", engine__targetGPUs=8,
                                                                  speculation={"mode": "vllm-sd"}),
                changed("autoscaled", engine__targetGPUs=8, autoscaling__speculation={"allowedModes": ["ar"]},
                        speculation={"mode": "auto", "numSpeculativeTokens": 3}),
                changed("autoscaled", autoscaling__minReplicas=0),
                # A drafter pool drafts for the engines: their pods request the target's GPUs only.
                changed("minimal", engine__targetGPUs=8, drafterPool={"tokenSecretRef": {"name": "drafter-token"}}),
                changed("minimal", gateway__enabled=False, engine__env=[{"name": "VLLM_USE_V1", "value": "1"}]),
                changed("minimal", imagePullSecrets=[{"name": "ghcr.io-pull"}],
                        gateway__authTokenSecretRef={"name": "gw", "key": "token.txt"})):
        assert admit(doc) == [], doc["spec"]
        s.parse_spec(defaulted(doc)["spec"])


def render_errors(tmp_path: Path, doc: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> str:
    path = tmp_path / "md.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["operator", "render", "-f", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


def test_render_gives_admissions_answer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Unknown fields and replicas together with autoscaling are admission's refusals only (the parser ignores an
    unknown field, and accepts replicas with autoscaling because the autoscaler writes replicas after creation):
    `minedraft operator render` refuses them as `kubectl apply` would."""
    typo = changed("minimal", engine__targetGPU=2)
    err = render_errors(tmp_path, typo, capsys)
    assert "MineDraft qwen3-8b: spec.engine: Additional properties are not allowed ('targetGPU' was unexpected)" in err
    both = changed("autoscaled", replicas=2)
    err = render_errors(tmp_path, both, capsys)
    assert "spec.replicas: set either replicas or autoscaling, not both" in err
    for case, (doc, admission_field, _) in CASES.items():
        assert admission_field in render_errors(tmp_path, doc, capsys), case
    # And what admission admits renders.
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump(example("autoscaled")))
    assert main(["operator", "render", "-f", str(path)]) == 0
