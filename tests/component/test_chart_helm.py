"""The Helm chart through a real Helm (helm-sdkpy: Helm v4's Go library): lint, and render by installing it into
the Kubernetes emulator (helm-sdkpy has no `template`); every rendered object validated against Kubernetes' own
schemas with kubernetes-validate (strict: unknown fields fail)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from minedraft.operator.crd import CRD_FILE, CRD_NAME, crd
from minedraft.operator.kube import PERMISSIONS

pytest.importorskip("helm_sdkpy", reason="helm-sdkpy is installed by scripts/setup.sh")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "minedraft"
K8S_VERSION = "1.34"  # a recent release; kubernetes-validate 1.37 ships schemas for 1.25-1.37
NAMESPACE = "minedraft-system"
# Not built-in kinds: kubernetes-validate has no schema for them (checked for shape below instead).
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule"}


def helm_run(values: dict[str, Any], chart: Path = CHART, **options: Any) -> subprocess.CompletedProcess[str]:
    """helm install (and, with upgrade=..., upgrade) into a fresh emulator; options: see helm_render.py."""
    env = {**os.environ, "HELM_DRIVER": "memory"}  # read by Helm's library when it loads: hence a subprocess
    return subprocess.run([sys.executable, "-m", "tests.component.helm_render", str(chart), json.dumps(values),
                           NAMESPACE, json.dumps(options)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


_RENDERED: dict[str, dict[str, Any]] = {}


def helm_render(values: dict[str, Any], chart: Path = CHART, **options: Any) -> dict[str, Any]:
    """The install's output plus its parsed `docs`; the repository's chart is rendered once per values/options (each
    render is a Helm run in a subprocess: seconds)."""
    key = json.dumps([values, options], sort_keys=True)
    if chart != CHART or key not in _RENDERED:
        result = helm_run(values, chart, **options)
        assert result.returncode == 0, result.stderr[-3000:]
        out: dict[str, Any] = json.loads(result.stdout)
        out["docs"] = [d for d in yaml.safe_load_all(out["manifest"]) if d]
        if chart != CHART:
            return out
        _RENDERED[key] = out
    return copy.deepcopy(_RENDERED[key])


def validate_all(docs: list[dict[str, Any]]) -> None:
    import kubernetes_validate

    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["metadata"]["name"]
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_chart_lints_clean() -> None:
    import asyncio

    from helm_sdkpy import Configuration
    from helm_sdkpy.chart import Lint

    result = asyncio.run(Lint(Configuration(namespace=NAMESPACE)).run(str(CHART)))
    # Helm's severities: 1 info, 2 warning, 3 error. Its messages are often empty here (see docs/architecture.md).
    assert result["TotalChartsLinted"] == 1
    assert not result.get("Errors"), result
    assert [m for m in result["Messages"] or [] if m["Severity"] >= 2] == [], result


@pytest.mark.parametrize("values", [
    {},
    {"operator": {"watchNamespaces": ["team-a", "team-b"]}, "networkPolicy": {"enabled": False}},
    {"operator": {"metricsPort": 0}, "monitoring": {"operatorServiceMonitor": True}},
    {"monitoring": {"operatorServiceMonitor": True}, "serviceAccount": {"annotations": {"a": "b"}}},
], ids=["defaults", "namespaced", "no-metrics", "service-monitor"])
def test_chart_renders_valid_kubernetes_objects(values: dict[str, Any]) -> None:
    out = helm_render(values)
    validate_all(out["docs"])
    kinds = sorted(d["kind"] for d in out["docs"])
    assert "Deployment" in kinds and "ServiceAccount" in kinds
    # The CRD is a template (so upgrades apply it) and exactly the generated one.
    assert [d["metadata"]["name"] for d in out["docs"] if d["kind"] == "CustomResourceDefinition"] == [CRD_NAME]
    assert len(out["crds"]) == 1
    assert out["crds"][0]["spec"] == crd()["spec"]
    assert "kubectl get md" in out["notes"]
    # Whatever dashboards/ holds ships: one ConfigMap per dashboard, one PrometheusRule per rules file.
    dashboards = sorted(p.name for p in (ROOT / "dashboards").glob("*.json"))
    shipped = sorted(k for d in out["docs"] if d["kind"] == "ConfigMap" for k in d["data"])
    assert shipped == dashboards
    rules = sorted((ROOT / "dashboards").glob("*.rules.yaml"))
    prometheus_rules = [d for d in out["docs"] if d["kind"] == "PrometheusRule"]
    assert [r["spec"] for r in prometheus_rules] == [yaml.safe_load(p.read_text()) for p in rules]


def _rules(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("ClusterRole", "Role")]


def test_rbac_is_exactly_what_the_operator_uses() -> None:
    for values in ({}, {"operator": {"watchNamespaces": ["team-a"]}}):
        roles = _rules(helm_render(values)["docs"])
        assert roles, values
        for role in roles:
            granted: dict[tuple[str, str], set[str]] = {}
            for rule in role["rules"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        granted.setdefault((group, resource), set()).update(rule["verbs"])
            assert granted == {k: set(v) for k, v in PERMISSIONS.items()}
            assert not any("*" in v for verbs in granted.values() for v in verbs)
            # Owned objects carry blockOwnerDeletion: OwnerReferencesPermissionEnforcement (OpenShift) then needs
            # update on the owner's finalizers. Secrets: the operator creates each MineDraft's internal credential
            # and never reads one (pods reference them): create only.
            assert "update" in granted[("minedraft.io", "minedrafts/finalizers")]
            assert granted[("", "secrets")] == {"create"}


def test_operator_deployment_is_locked_down_and_wired() -> None:
    docs = helm_render({})["docs"]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]},
                                            "seccompProfile": {"type": "RuntimeDefault"}}
    assert "runAsUser" not in pod["securityContext"]  # arbitrary UIDs (restricted-v2) must be accepted
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert container["image"] == f"ghcr.io/minedraft/operator:{chart['appVersion']}"
    # The flags parse with the operator's own parser.
    import argparse

    from minedraft.operator.cli import add_subcommands, settings_from_args

    parser = argparse.ArgumentParser()
    add_subcommands(parser.add_subparsers())
    settings = settings_from_args(parser.parse_args(container["args"]))
    assert settings.health_port == 8080 and settings.network_policy is True
    assert settings.prometheus_pod_selector == {"app.kubernetes.io/name": "prometheus"}


def test_dashboards_and_rules_ship_when_present(tmp_path: Path) -> None:
    """With a dashboard and a rules file in dashboards/ (made up here: the metrics issue provides the real ones)."""
    chart = tmp_path / "minedraft"
    shutil.copytree(CHART, chart, symlinks=False, ignore=shutil.ignore_patterns("dashboards"))
    files = chart / "files" / "dashboards"
    files.mkdir(parents=True, exist_ok=True)
    (files / "minedraft-overview.json").write_text(json.dumps({"title": "MineDraft overview", "panels": []}))
    (files / "minedraft.rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "minedraft", "rules": [
        {"alert": "MineDraftDrafterDown", "expr": "minedraft_engine_drafter_up == 0", "for": "5m"}]}]}))
    docs = helm_render({"monitoring": {"prometheusRule": {"labels": {"release": "kube-prometheus"}}}}, chart)["docs"]
    validate_all(docs)
    configmap = next(d for d in docs if d["kind"] == "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["minedraft-overview.json"])["title"] == "MineDraft overview"
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    assert rule["spec"]["groups"][0]["rules"][0]["alert"] == "MineDraftDrafterDown"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus"
    off = helm_render({"monitoring": {"dashboards": {"enabled": False}, "prometheusRule": {"enabled": False}}},
                      chart)["docs"]
    assert not [d for d in off if d["kind"] in ("ConfigMap", "PrometheusRule")]


def test_values_schema_rejects_unknown_and_bad_values() -> None:
    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(values, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**values, "operater": {}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**values, "monitoring": {**values["monitoring"], "podMonitors": "sometimes"}}, schema)
    # Helm enforces the same schema at install time.
    env = {**os.environ, "HELM_DRIVER": "memory"}
    result = subprocess.run([sys.executable, "-m", "tests.component.helm_render", str(CHART),
                             json.dumps({"operator": {"metricsPort": -1}}), NAMESPACE], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "metricsPort" in result.stderr


def test_chart_refuses_clusters_older_than_its_crd_needs() -> None:
    env = {**os.environ, "HELM_DRIVER": "memory", "EMULATOR_KUBERNETES_MINOR": "29"}
    result = subprocess.run([sys.executable, "-m", "tests.component.helm_render", str(CHART), "{}", NAMESPACE],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "kubeVersion" in result.stderr, result.stderr[-2000:]


def _monitoring_kinds(docs: list[dict[str, Any]]) -> list[str]:
    return sorted(d["kind"] for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/"))


def test_default_install_succeeds_on_a_cluster_without_the_prometheus_operator() -> None:
    """A plain cluster serves no monitoring.coreos.com/v1: creating a PrometheusRule there fails the whole install
    ("no matches for kind"), so by default the chart renders none; where the API is served, the rules ship."""
    assert list((ROOT / "dashboards").glob("*.rules.yaml")), "the repository ships alert rules"
    plain = helm_render({}, monitoring=False)
    assert _monitoring_kinds(plain["docs"]) == []
    assert "Deployment" in [d["kind"] for d in plain["docs"]]
    both = {"monitoring": {"operatorServiceMonitor": "auto"}}
    assert _monitoring_kinds(helm_render(both, monitoring=False)["docs"]) == []
    served = helm_render(both, monitoring=True)["docs"]
    assert set(_monitoring_kinds(served)) == {"PrometheusRule", "ServiceMonitor"}


def test_monitoring_objects_follow_an_explicit_setting() -> None:
    # Asked for on a plain cluster: rendered, and Helm reports the missing kind (the user asked for it).
    forced = helm_run({"monitoring": {"prometheusRule": {"enabled": True}}}, monitoring=False)
    assert forced.returncode != 0 and 'no matches for kind "PrometheusRule"' in forced.stderr, forced.stderr[-2000:]
    off = {"monitoring": {"prometheusRule": {"enabled": False}, "operatorServiceMonitor": False}}
    assert _monitoring_kinds(helm_render(off, monitoring=True)["docs"]) == []


def _crd_doc(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    return doc


def test_crd_is_a_kept_template_generated_from_crd_py() -> None:
    """Helm installs a chart's crds/ once and never upgrades it: the CRD must be a template (kept on uninstall)."""
    assert not (CHART / "crds").exists(), "Helm never upgrades crds/: ship the CRD from templates/"
    assert (CHART / "files" / "crds" / Path(CRD_FILE).name) == ROOT / CRD_FILE
    doc = _crd_doc(helm_render({})["docs"])
    assert doc["spec"] == crd()["spec"]  # survives Helm's YAML round trip unchanged
    assert doc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "minedraft"
    off = helm_render({"crds": {"install": False}})
    assert not [d for d in off["docs"] if d["kind"] == "CustomResourceDefinition"] and off["crds"] == []


def _older_chart(tmp_path: Path, crd_doc: dict[str, Any], crds_folder: bool) -> Path:
    """The chart as an earlier release shipped it: another CRD, either as the template or in crds/ (0.1.0)."""
    chart = tmp_path / "old" / "minedraft"
    shutil.copytree(CHART, chart)
    text = "# the old CRD\n" + yaml.safe_dump(crd_doc, sort_keys=False)
    (chart / "files" / "crds" / Path(CRD_FILE).name).write_text(text)
    if crds_folder:
        (chart / "templates" / "crd.yaml").unlink()
        (chart / "crds").mkdir()
        (chart / "crds" / Path(CRD_FILE).name).write_text(text)
    return chart


def _edited_crd() -> dict[str, Any]:
    old = crd()
    version = old["spec"]["versions"][0]
    version["additionalPrinterColumns"] = version["additionalPrinterColumns"][:1]
    version["schema"]["openAPIV3Schema"]["description"] = "an older schema"
    return old


def test_helm_upgrade_applies_a_changed_crd(tmp_path: Path) -> None:
    old = _edited_crd()
    out = helm_render({}, _older_chart(tmp_path, old, crds_folder=False), upgrade=[str(CHART), {}])
    [installed] = out["crds_after_install"]
    assert installed["spec"] == old["spec"]
    [upgraded] = out["crds"]
    assert upgraded["spec"] == crd()["spec"]


def test_upgrade_from_a_release_that_shipped_crds_folder_needs_take_ownership(tmp_path: Path) -> None:
    """0.1.0 installed the CRD from crds/, so Helm does not own it: a plain upgrade refuses to adopt it (the release
    notes tell users to upgrade once with --take-ownership); with it the new schema is applied."""
    old = _edited_crd()
    chart = _older_chart(tmp_path, old, crds_folder=True)
    refused = helm_run({}, chart, upgrade=[str(CHART), {}])
    assert refused.returncode != 0 and "invalid ownership metadata" in refused.stderr, refused.stderr[-2000:]
    out = helm_render({}, chart, upgrade=[str(CHART), {}], take_ownership=True)
    assert out["crds_after_install"][0]["spec"] == old["spec"]
    [upgraded] = out["crds"]
    assert upgraded["spec"] == crd()["spec"]
    assert upgraded["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_operator_pull_secrets_and_named_service_ports() -> None:
    docs = helm_render({"operator": {"imagePullSecrets": [{"name": "registry-a"}, {"name": "registry-b"}]}})["docs"]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "registry-a"}, {"name": "registry-b"}]
    [service] = [d for d in docs if d["kind"] == "Service"]
    container_ports = {p["name"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
    for port in service["spec"]["ports"]:
        assert port["name"] and port["targetPort"] in container_ports and port["appProtocol"] == "http", port


def test_crd_is_kept_when_the_release_stops_managing_it() -> None:
    """helm.sh/resource-policy keep: turning crds.install off (or uninstalling) must not delete the CRD, which would
    delete every MineDraft in the cluster."""
    out = helm_render({}, upgrade=[str(CHART), {"crds": {"install": False}}])
    assert not [d for d in out["docs"] if d["kind"] == "CustomResourceDefinition"]
    [kept] = out["crds"]
    assert kept["spec"] == crd()["spec"]
