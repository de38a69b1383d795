"""The chart installs into a namespace labelled pod-security.kubernetes.io/enforce=restricted, and on clusters that
assign arbitrary UIDs: every pod template it renders (and every pod the operator renders for a MineDraft) passes
the restricted profile's checks (tests/pod_security.py), pins no UID/GID, and writes only to volumes."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from minedraft.operator import render
from minedraft.operator.cli import add_subcommands, settings_from_args
from tests.component.test_chart_helm import helm_render
from tests.pod_security import fixed_id_violations, restricted_violations, writable_path_violations

ROOT = Path(__file__).resolve().parents[2]
POD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}


def pod_templates(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    out = [(f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]) for d in docs if d["kind"] in POD_KINDS]
    out += [(f"CronJob/{d['metadata']['name']}", d["spec"]["jobTemplate"]["spec"]["template"])
            for d in docs if d["kind"] == "CronJob"]
    out += [(f"Pod/{d['metadata']['name']}", d) for d in docs if d["kind"] == "Pod"]
    return out


def check(templates: list[tuple[str, dict[str, Any]]]) -> list[str]:
    problems = []
    for where, template in templates:
        spec, annotations = template["spec"], (template.get("metadata") or {}).get("annotations") or {}
        problems += [f"{where}: {p}" for p in restricted_violations(spec, annotations) + fixed_id_violations(spec)
                     + writable_path_violations(spec)]
    return problems


@pytest.mark.parametrize("values", [
    {},
    {"operator": {"imagePullSecrets": [{"name": "registry"}], "watchNamespaces": ["team-a"],
                  "podAnnotations": {"a": "b"}}},
], ids=["defaults", "customised"])
def test_every_chart_pod_passes_restricted_with_any_uid(values: dict[str, Any]) -> None:
    docs = helm_render(values)["docs"]
    templates = pod_templates(docs)
    assert templates, "the chart renders the operator Deployment"
    assert check(templates) == []


def test_every_operator_rendered_pod_passes_restricted_with_any_uid() -> None:
    templates = []
    for example in sorted((ROOT / "examples").glob("*.yaml")):
        resource = yaml.safe_load(example.read_text())
        resource["metadata"].update(namespace="team-a", uid="u")
        templates += [(f"{example.name}: {w}", t) for w, t in pod_templates(render.render_resource(resource))]
    assert len(templates) >= 2 * len(list((ROOT / "examples").glob("*.yaml"))) - 1
    assert check(templates) == []


def test_operator_pod_writes_only_to_volumes_and_probes_kopfs_liveness_endpoint() -> None:
    dep = next(d for d in helm_render({})["docs"] if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e.get("value") for e in container.get("env") or []}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    empty_dirs = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    # An arbitrary UID has no passwd entry: HOME must be set, onto a writable volume.
    assert env["HOME"] in mounts and mounts[env["HOME"]] in empty_dirs
    # Every probe asks kopf's liveness endpoint, on the port the operator serves it on (its own parser reads the
    # chart's flags).
    parser = argparse.ArgumentParser()
    add_subcommands(parser.add_subparsers())
    settings = settings_from_args(parser.parse_args(container["args"]))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = container[kind]
        assert probe["httpGet"]["path"] == "/healthz", kind
        assert ports[probe["httpGet"]["port"]] == settings.health_port, kind
    # Liveness only after start-up, and it tolerates a busy event loop for a while before restarting.
    liveness = container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60
    assert liveness["timeoutSeconds"] >= 5
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60
