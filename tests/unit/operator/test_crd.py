"""The CRD: one source of truth, structural, described, and its CEL rules evaluated on good and bad MineDrafts.

kubernetes-validate does not validate custom resources, so the examples go through jsonschema (on the CRD's
openAPIV3Schema, converted where OpenAPI 3.0 and JSON Schema differ) after structural defaulting, and each
x-kubernetes-validations rule is evaluated by a CEL library (common-expression-language) as the API server would:
minedraft.operator.admission, the code `minedraft operator render` runs before rendering.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from minedraft.operator import crd as crd_module
from minedraft.operator import spec as s
from minedraft.operator.admission import admit
from minedraft.operator.crd import apply_defaults

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
        if node.get("x-kubernetes-int-or-string"):
            # The one form structural schemas allow for int-or-string (as every Kubernetes quantity).
            assert "type" not in node and node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            continue
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


# -- the API server's pipeline, reproduced: defaults, schema, CEL (minedraft.operator.admission, which
# `minedraft operator render` runs too) -------------------------------------------------------------------------------


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


def set_path(node: dict[str, Any], keys: list[str], value: Any) -> None:
    """node[k0][k1]...[kn] = value, making the mappings on the way; None removes the last key."""
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if value is None:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value


def with_spec(name: str, **changes: Any) -> dict[str, Any]:
    doc = example(name)
    for dotted, value in changes.items():
        set_path(doc["spec"], dotted.split("__"), value)
    return doc


@pytest.mark.parametrize(("doc", "message"), [
    (with_spec("autoscaled", autoscaling__minReplicas=5, autoscaling__maxReplicas=2),
     "spec.autoscaling.minReplicas: minReplicas must not exceed maxReplicas"),
    (with_spec("autoscaled", replicas=2),
     "spec.replicas: set either replicas or autoscaling, not both (the autoscaler owns replicas)"),
    (with_spec("minimal", speculation__mode="ar", speculation__numExtraDraftTokens=2),
     "spec.speculation.numExtraDraftTokens: numExtraDraftTokens needs mode psd or sd"),
    (with_spec("minimal", speculation__mode="ar", speculation__asyncSteps=True),
     "spec.speculation.asyncSteps: asyncSteps needs mode psd, sd or auto"),
    (with_spec("minimal", speculation__numSpeculativeTokens=12, speculation__numExtraDraftTokens=5),
     "spec.speculation.numExtraDraftTokens: numSpeculativeTokens + numExtraDraftTokens must be at most 16"),
    (with_spec("minimal", target__source__image={"path": "/m"}),
     "spec.target.source: exactly one of huggingFace, persistentVolumeClaim or image must be set"),
    (with_spec("autoscaled", autoscaling__speculation__minSpeculativeTokens=6,
               autoscaling__speculation__maxSpeculativeTokens=7),
     "spec.speculation.numSpeculativeTokens: auto mode starts at a numSpeculativeTokens within "
     "autoscaling.speculation's min..max"),
    (with_spec("autoscaled", autoscaling__speculation__minSpeculativeTokens=6,
               autoscaling__speculation__maxSpeculativeTokens=3),
     "spec.autoscaling.speculation.minSpeculativeTokens: minSpeculativeTokens must not exceed maxSpeculativeTokens"),
    (with_spec("minimal", autoscaling={"speculation": {"allowedModes": ["ar", "sd"]}}),
     "spec.autoscaling.speculation.allowedModes: autoscaling.speculation.allowedModes must include the fixed "
     "speculation.mode (or use mode auto)"),
    (with_spec("minimal", engine__drafterBackend="torch"),
     "spec.engine.drafterBackend: torch is the CPU drafter; engine pods run on GPUs: use vllm"),
    (with_spec("minimal", engine__extraArgs=["--enforce-eager", "--tensor-parallel-size=2"]),
     "spec.engine.extraArgs: extraArgs must not set flags the operator sets from the MineDraft's own fields "
     "(--model, --dtype, --tensor-parallel-size, --max-model-len, ...): set those fields"),
    (with_spec("minimal", engine__extraArgs=["--max-model-len", "4096"]), "spec.engine.extraArgs: extraArgs must not"),
    (with_spec("minimal", engine__extraArgs=["--max-model-len 4096"]), "spec.engine.extraArgs: extraArgs must not"),
    (with_spec("minimal", engine__extraArgs=["--lookahead-fanout=8"]), "spec.engine.extraArgs: extraArgs must not"),
    (with_spec("minimal", speculation__mode="lookahead", speculation__numExtraDraftTokens=2),
     "spec.speculation.numExtraDraftTokens: numExtraDraftTokens needs mode psd or sd"),
    (with_spec("minimal", speculation__mode="lookahead", speculation__asyncSteps=True),
     "spec.speculation.asyncSteps: asyncSteps needs mode psd, sd or auto"),
    (with_spec("minimal", speculation__mode="lookahead", autoscaling={"speculation": {"allowedModes": ["psd", "sd"]}}),
     "spec.autoscaling.speculation.allowedModes: autoscaling.speculation.allowedModes must include the fixed "
     "speculation.mode (or use mode auto)"),
    (with_spec("minimal", speculation__lookaheadFanout=4),
     "spec.speculation.lookaheadFanout: lookaheadFanout needs mode lookahead, or auto with lookahead in "
     "autoscaling.speculation.allowedModes"),
    (with_spec("autoscaled", speculation__lookaheadFanout=4),
     "spec.speculation.lookaheadFanout: lookaheadFanout needs mode lookahead, or auto with lookahead in "
     "autoscaling.speculation.allowedModes"),
    (with_spec("minimal", speculation__mode="lookahead", engine__targetGPUs=8),
     "spec.engine.targetGPUs: targetGPUs plus the drafter's GPU must fit on one node of at most 8 GPUs"),
], ids=["min>max", "replicas+autoscaling", "extra-drafts-ar", "async-steps-ar", "k+e>16", "two-sources",
        "auto-k-outside", "k-range", "fixed-mode-not-allowed", "torch-drafter", "reserved-flag", "reserved-flag-split",
        "reserved-flag-one-word", "reserved-lookahead-fanout", "extra-drafts-lookahead", "async-steps-lookahead",
        "fixed-lookahead-not-allowed", "fanout-psd", "fanout-auto-without-lookahead", "lookahead-gpu-fit"])
def test_cel_rules_reject_with_their_message(doc: dict[str, Any], message: str) -> None:
    found = admit(doc)
    assert any(f.startswith(message) for f in found), found


def test_metadata_name_must_make_valid_service_names() -> None:
    """DNS-1035 (a letter first) and room for the "-gateway" suffix within 63 characters."""
    message = "<root>: metadata.name must be a DNS-1035 label"
    for bad in ("7b-qwen", "x" * (s.MAX_NAME_LENGTH + 1), "qwen.3"):
        doc = example("minimal")
        doc["metadata"]["name"] = bad
        assert any(f.startswith(message) for f in admit(doc)), bad
    doc = example("minimal")
    doc["metadata"]["name"] = "q" * s.MAX_NAME_LENGTH
    assert admit(doc) == []


def test_every_rule_names_its_field_and_reason() -> None:
    """Each CEL rule sets a reason, and a fieldPath that exists in the schema (the API server rejects a CRD whose
    fieldPath does not resolve), except rules about a whole object (one of several fields, the metadata name) and
    rules on a field that is not an object (the rule's own node is the field)."""
    whole_object = {"exactly one of huggingFace, persistentVolumeClaim or image must be set",
                    "valueFrom must set exactly one of fieldRef, resourceFieldRef, configMapKeyRef, secretKeyRef"}
    for path, node in walk(SCHEMA):
        for rule in node.get("x-kubernetes-validations", []):
            assert rule.get("reason") in ("FieldValueInvalid", "FieldValueForbidden", "FieldValueRequired",
                                          "FieldValueNotSupported"), rule
            if (rule["message"] in whole_object or rule["message"].startswith("metadata.name")
                    or node.get("type") != "object"):
                continue
            target = node
            for part in rule["fieldPath"].lstrip(".").split("."):
                target = target["properties"][part]
            assert target, (path, rule)


@pytest.mark.parametrize(("doc", "fragment"), [
    (with_spec("minimal", speculation__numSpeculativeTokens=17), "speculation.numSpeculativeTokens"),
    (with_spec("minimal", speculation__numSpeculativeTokens=0), "speculation.numSpeculativeTokens"),
    (with_spec("minimal", speculation__mode="fast"), "speculation.mode"),
    (with_spec("minimal", engine__targetGPUs=9), "engine.targetGPUs"),
    (with_spec("minimal", engine__dtype="fp8"), "engine.dtype"),
    (with_spec("minimal", engine__maxModelLen=8), "engine.maxModelLen"),
    (with_spec("minimal", engine__cpu=0.5), "engine.cpu"),
    (with_spec("autoscaled", autoscaling__speculation__allowedModes=["vllm-sd"]), "allowedModes"),
    (with_spec("minimal", engine__memory="lots"), "engine.memory"),
    (with_spec("minimal", gateway__tlsSecretRef={}), "gateway.tlsSecretRef"),
    (with_spec("minimal", replicas=-1), "spec.replicas"),
    (with_spec("minimal", autoscaling={"targetUtilization": 0}), "autoscaling.targetUtilization"),
    (with_spec("minimal", autoscaling={"replicaCapacityTokensPerSecond": 0.5}),
     "autoscaling.replicaCapacityTokensPerSecond"),
    (with_spec("minimal", autoscaling={"replicaCapacityTokensPerSecond": "2k"}),
     "autoscaling.replicaCapacityTokensPerSecond"),
    (with_spec("minimal", speculaton={"mode": "psd"}), "speculaton"),
    (with_spec("minimal", target=None), "target"),
    (with_spec("minimal", speculation__mode="lookahead", speculation__lookaheadFanout=0),
     "speculation.lookaheadFanout"),
    (with_spec("minimal", speculation__mode="lookahead", speculation__lookaheadFanout=17),
     "speculation.lookaheadFanout"),
], ids=["k-high", "k-zero", "mode", "gpus", "dtype", "context-len", "float-cpu", "auto-vllm-sd",
        "quantity", "tls-name", "replicas", "utilization", "capacity-prior-low", "capacity-prior-string", "typo",
        "no-target", "fanout-zero", "fanout-high"])
def test_schema_rejects(doc: dict[str, Any], fragment: str) -> None:
    problems = admit(doc)
    assert any(fragment in p for p in problems), problems


@pytest.mark.parametrize("changes", [
    {"speculation__mode": "lookahead"},
    {"speculation__mode": "lookahead", "speculation__lookaheadFanout": 1},
    {"speculation__mode": "lookahead", "speculation__lookaheadFanout": 16, "engine__targetGPUs": 4},
    {"speculation__mode": "lookahead", "autoscaling": {"speculation": {"allowedModes": ["lookahead", "ar"]}},
     "replicas": None},
    {"speculation__mode": "auto", "speculation__lookaheadFanout": 6},
    {"speculation__mode": "auto", "speculation__lookaheadFanout": 6,
     "autoscaling": {"speculation": {"allowedModes": ["lookahead"]}}, "replicas": None},
    {"speculation__mode": "lookahead", "drafterPool": {"tokenSecretRef": {"name": "pool-token"}},
     "engine__targetGPUs": 8},
], ids=["lookahead", "fanout-1", "fanout-16-tp4", "allowed", "auto-fanout", "auto-only-lookahead", "pool-tp8"])
def test_lookahead_is_admitted_and_parsed(changes: dict[str, Any]) -> None:
    doc = with_spec("minimal", **changes)
    assert admit(doc) == []
    spec = s.parse_spec(apply_defaults(SCHEMA, doc)["spec"])
    assert spec.runs_lookahead
    assert spec.speculation.lookahead_fanout == changes.get("speculation__lookaheadFanout")


def test_allowed_modes_default_to_every_mode_auto_knows() -> None:
    """auto chooses among psd, sd, lookahead and ar unless the MineDraft says otherwise (as `minedraft serve`)."""
    allowed = SCHEMA["properties"]["spec"]["properties"]["autoscaling"]["properties"]["speculation"]["properties"][
        "allowedModes"]
    assert allowed["default"] == ["psd", "sd", "lookahead", "ar"] and allowed["items"]["enum"] == allowed["default"]
    assert allowed["maxItems"] == 4
    defaulted = apply_defaults(SCHEMA, with_spec("minimal", speculation__mode="auto", autoscaling={}))["spec"]
    assert defaulted["autoscaling"]["speculation"]["allowedModes"] == ["psd", "sd", "lookahead", "ar"]
    modes = SCHEMA["properties"]["spec"]["properties"]["speculation"]["properties"]["mode"]["enum"]
    assert "lookahead" in modes


def test_autoscaler_may_write_replicas_and_users_may_then_edit_the_bounds() -> None:
    """After creation the autoscaler sets spec.replicas (via /scale); a user who then narrows min/maxReplicas below
    or above it is admitted (the operator clamps replicas into the new bounds)."""
    old = example("autoscaled")
    scaled = with_spec("autoscaled", replicas=4)
    assert admit(scaled, old=old) == []
    narrowed = with_spec("autoscaled", replicas=4, autoscaling__maxReplicas=2)
    assert admit(narrowed, old=scaled) == []
    raised = with_spec("autoscaled", replicas=4, autoscaling__minReplicas=5, autoscaling__maxReplicas=8)
    assert admit(raised, old=scaled) == []
    assert s.parse_spec(apply_defaults(SCHEMA, narrowed)["spec"]).desired_replicas == 2
    assert s.parse_spec(apply_defaults(SCHEMA, raised)["spec"]).desired_replicas == 5
    # A user's update of a fixed-replica MineDraft is unaffected.
    assert admit(with_spec("minimal", replicas=5), old=example("minimal")) == []


def test_users_write_quantities_as_numbers() -> None:
    doc = with_spec("minimal", engine__cpu=16, engine__memory="64Gi", engine__ephemeralStorage=200,
                    gateway__cpu=2, engine__extraArgs=["--gpu-memory-utilization", "0.85", "--enforce-eager"])
    assert admit(doc) == []
    assert s.parse_spec(apply_defaults(SCHEMA, doc)["spec"]).engine.cpu == "16"


def test_scale_to_zero_is_admitted_and_renders_engines_at_zero_with_the_gateway_up() -> None:
    from minedraft.operator import render

    doc = with_spec("autoscaled", autoscaling__minReplicas=0)
    assert admit(doc) == []
    doc["metadata"].update(namespace="serving", uid="u")
    manifests = render.render_resource(apply_defaults(SCHEMA, doc))
    deployments = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "Deployment"}
    assert deployments["qwen3-14b-engine"]["spec"]["replicas"] == 0
    assert deployments["qwen3-14b-gateway"]["spec"]["replicas"] >= 1


def test_replica_capacity_prior_is_admitted_and_reaches_the_policy() -> None:
    from minedraft.operator.autoscale.loop import policy_config

    doc = with_spec("autoscaled", autoscaling__replicaCapacityTokensPerSecond=2400)
    assert admit(doc) == []
    spec = s.parse_spec(apply_defaults(SCHEMA, doc)["spec"])
    assert policy_config(spec).prior_capacity_tokens_per_second_per_replica == 2400.0
    # Unset: no default is written (no prior), as the parser's.
    unset = apply_defaults(SCHEMA, example("autoscaled"))["spec"]
    assert "replicaCapacityTokensPerSecond" not in unset["autoscaling"]
    assert policy_config(s.parse_spec(unset)).prior_capacity_tokens_per_second_per_replica is None


def test_no_inference_pool_claim() -> None:
    """Issue 30: the CRD said the engines' HTTP port serves a Gateway API InferencePool, but nothing renders one, the
    NetworkPolicy blocks that port behind the gateway and it carries no metrics: the claim is gone (CRD and docs)."""
    texts = [crd_module.crd_yaml(), *(p.read_text() for p in (ROOT / "docs").glob("*.md"))]
    assert not [t for t in texts if "InferencePool" in t]


def test_shared_claims_say_which_access_modes_work() -> None:
    """Issue 30: every engine pod mounts the model and cache claims; a ReadWriteOnce volume attaches to one node."""
    source = SCHEMA["properties"]["spec"]["properties"]["target"]["properties"]["source"]["properties"]
    assert "ReadOnlyMany or ReadWriteMany" in source["persistentVolumeClaim"]["description"]
    cache = SCHEMA["properties"]["spec"]["properties"]["engine"]["properties"]["modelCache"]["properties"]
    assert "ReadWriteMany" in cache["claimName"]["description"]
    assert "ReadOnlyMany" in (ROOT / "docs" / "kubernetes.md").read_text()
