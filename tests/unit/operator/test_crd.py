"""The CRD: one source of truth, structural, described, and its CEL rules evaluated on good and bad MineDrafts.

kubernetes-validate does not validate custom resources, so the examples go through jsonschema (on the CRD's
openAPIV3Schema, converted where OpenAPI 3.0 and JSON Schema differ) after structural defaulting, and each
x-kubernetes-validations rule is evaluated by a CEL library (common-expression-language) as the API server would.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cel
import jsonschema
import kubernetes_validate
import pytest
import yaml

from minedraft.operator import crd as crd_module
from minedraft.operator import spec as s

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
K8S_VERSION = "1.34"
SCHEMA = crd_module.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_chart_crd_is_the_generated_one() -> None:
    assert (ROOT / crd_module.CRD_FILE).read_text() == crd_module.crd_yaml(), (
        "regenerate: minedraft operator crd > " + crd_module.CRD_FILE)


def test_crd_is_a_valid_kubernetes_object() -> None:
    kubernetes_validate.validate(crd_module.crd(), K8S_VERSION, strict=True)


def walk(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}")
    if "items" in schema:
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


def test_structural_and_described() -> None:
    for path, node in walk(SCHEMA):
        assert "type" in node, f"{path}: structural schemas need a type"
        if path.count(".") >= 1 and not path.startswith(".metadata"):
            assert node.get("description"), f"{path}: every field needs a description"


def test_scale_subresource_and_printer_columns() -> None:
    version = crd_module.crd()["spec"]["versions"][0]
    scale = version["subresources"]["scale"]
    assert scale == {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                     "labelSelectorPath": ".status.selector"}
    assert "status" in version["subresources"]
    paths = {p for p, _ in walk(SCHEMA)}
    for column in version["additionalPrinterColumns"]:
        if column["jsonPath"] != ".metadata.creationTimestamp":
            assert column["jsonPath"] in paths, column
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names[:4] == ["Mode", "Ready", "Acceptance", "Endpoint"] and names[-1] == "Age"
    assert crd_module.crd()["spec"]["names"]["shortNames"] == ["md"]


# -- the API server's pipeline, reproduced: defaults, schema, CEL ---------------------------------------------------


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: absent properties with a default get it, recursively (as the API server does)."""
    if not isinstance(value, dict) or schema.get("type") != "object":
        if isinstance(value, list) and "items" in schema:
            return [apply_defaults(schema["items"], v) for v in value]
        return value
    out = dict(value)
    for name, sub in schema.get("properties", {}).items():
        if name not in out and "default" in sub:
            out[name] = copy.deepcopy(sub["default"])
        if name in out:
            out[name] = apply_defaults(sub, out[name])
    return out


def to_json_schema(schema: Any) -> Any:
    """OpenAPI 3.0 -> JSON Schema: boolean exclusiveMinimum, and no unknown fields (kubectl's strict validation)."""
    if isinstance(schema, list):
        return [to_json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: to_json_schema(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if out.get("exclusiveMinimum") is True:
        out["exclusiveMinimum"] = out.pop("minimum")
    if (schema.get("type") == "object" and "properties" in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in schema):
        out["additionalProperties"] = False
    return out


def cel_errors(schema: dict[str, Any], value: Any, old: Any, path: str = "") -> list[str]:
    """Evaluate every x-kubernetes-validations rule where `value` has the node; returns failed rules' messages."""
    found: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        expression = rule["rule"]
        variables: dict[str, Any] = {"self": value}
        if "oldSelf" in expression:
            if rule.get("optionalOldSelf"):
                # CEL's optional type: oldSelf has no value on create. The library takes no optionals from
                # Python, so spell the value as a CEL expression.
                replacement = "optional.none()" if old is None else "optional.of(oldSelfValue)"
                expression = re.sub(r"\boldSelf\b", replacement, expression)
                variables["oldSelfValue"] = old
            elif old is None:
                continue  # transition rules run on update only
            else:
                variables["oldSelf"] = old
        if cel.evaluate(expression, variables) is not True:
            found.append(f"{path or '<root>'}: {rule['message']}")
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                old_sub = old.get(name) if isinstance(old, dict) else None
                found += cel_errors(sub, value[name], old_sub, f"{path}.{name}" if path else name)
    return found


def admit(obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """What the API server would say about creating (old=None) or updating to `obj`: [] when admitted."""
    obj = apply_defaults(SCHEMA, obj)
    validator = jsonschema.Draft7Validator(to_json_schema(SCHEMA))
    problems = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
    if problems:
        return problems
    return cel_errors(SCHEMA, obj, apply_defaults(SCHEMA, old) if old is not None else None)


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_are_admitted(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    assert admit(doc) == []
    # And the operator parses them (same defaults on both sides).
    s.parse_spec(apply_defaults(SCHEMA, doc)["spec"])


def test_defaults_match_the_dataclasses() -> None:
    spec_doc = apply_defaults(SCHEMA, example("minimal"))["spec"]
    parsed = s.parse_spec(spec_doc)
    assert parsed == s.parse_spec(example("minimal")["spec"])
    assert spec_doc["engine"]["maxNumSeqs"] == s.EngineSpec().max_num_seqs
    assert spec_doc["gateway"]["replicas"] == s.GatewaySpec().replicas


def with_spec(name: str, **changes: Any) -> dict[str, Any]:
    doc = example(name)
    for dotted, value in changes.items():
        node = doc["spec"]
        keys = dotted.split("__")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return doc


@pytest.mark.parametrize(("doc", "message"), [
    (with_spec("autoscaled", autoscaling__minReplicas=5, autoscaling__maxReplicas=2),
     "spec.autoscaling: minReplicas must not exceed maxReplicas"),
    (with_spec("autoscaled", replicas=2),
     "spec: set either replicas or autoscaling, not both (the autoscaler owns replicas)"),
    (with_spec("minimal", speculation__mode="ar", speculation__numExtraDraftTokens=2),
     "spec.speculation: numExtraDraftTokens needs mode psd or sd"),
    (with_spec("minimal", target__source__image={"path": "/m"}),
     "spec.target.source: exactly one of huggingFace, persistentVolumeClaim or image must be set"),
    (with_spec("autoscaled", autoscaling__speculation__minSpeculativeTokens=6,
               autoscaling__speculation__maxSpeculativeTokens=3),
     "spec.autoscaling.speculation: minSpeculativeTokens must not exceed maxSpeculativeTokens"),
], ids=["min>max", "replicas+autoscaling", "extra-drafts-ar", "two-sources", "k-range"])
def test_cel_rules_reject_with_their_message(doc: dict[str, Any], message: str) -> None:
    assert message in admit(doc)


@pytest.mark.parametrize(("doc", "fragment"), [
    (with_spec("minimal", speculation__numSpeculativeTokens=17), "speculation.numSpeculativeTokens"),
    (with_spec("minimal", speculation__numSpeculativeTokens=0), "speculation.numSpeculativeTokens"),
    (with_spec("minimal", speculation__mode="fast"), "speculation.mode"),
    (with_spec("minimal", engine__targetGPUs=2), "engine.targetGPUs"),
    (with_spec("minimal", engine__memory="lots"), "engine.memory"),
    (with_spec("minimal", gateway__tlsSecretRef={}), "gateway.tlsSecretRef"),
    (with_spec("minimal", replicas=-1), "spec.replicas"),
    (with_spec("minimal", autoscaling={"targetUtilization": 0}), "autoscaling.targetUtilization"),
    (with_spec("minimal", speculaton={"mode": "psd"}), "speculaton"),
    (with_spec("minimal", target=None), "target"),
], ids=["k-high", "k-zero", "mode", "gpus", "quantity", "tls-name", "replicas", "utilization", "typo", "no-target"])
def test_schema_rejects(doc: dict[str, Any], fragment: str) -> None:
    problems = admit(doc)
    assert any(fragment in p for p in problems), problems


def test_autoscaler_may_write_replicas_through_scale_within_bounds() -> None:
    """After creation the autoscaler sets spec.replicas (via /scale): allowed within bounds, not outside."""
    old = example("autoscaled")
    scaled = with_spec("autoscaled", replicas=4)
    assert admit(scaled, old=old) == []
    outside = with_spec("autoscaled", replicas=9)
    assert "spec: replicas must lie within autoscaling minReplicas..maxReplicas" in admit(outside, old=old)
    # A user's update of a fixed-replica MineDraft is unaffected.
    assert admit(with_spec("minimal", replicas=5), old=example("minimal")) == []
