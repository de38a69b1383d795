"""The engine pods' fsGroup (issue 30, defect 4): a PersistentVolumeClaim model cache is writable on vanilla clusters.

A freshly provisioned disk's root directory is owned by root (mode 0755): the engine, running as a non-root user,
cannot write the cache the docs recommend unless the pod has an fsGroup, for which the kubelet makes the volume
group-writable. On OpenShift the SCC assigns each namespace's fsGroup and refuses another one, so it stays unset
there. Both renderings are tested: the chart (Helm's real template engine, on a plain cluster and on one serving
OpenShift's SecurityContextConstraints API) passes the operator its flag, and the operator renders the pod with or
without it. What the kubelet does with fsGroup (the chown/chmod of the volume root, OnRootMismatch skipping it when
the root already matches) is the real cluster's; the test checks the pod asks for it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from minedraft.operator import render
from minedraft.operator.cli import add_subcommands, settings_from_args
from tests.component.test_chart_helm import helm_render
from tests.pod_security import fixed_id_violations, restricted_violations

ROOT = Path(__file__).resolve().parents[2]


def operator_args(values: dict[str, Any], **options: Any) -> list[str]:
    dep = next(d for d in helm_render(values, **options)["docs"] if d["kind"] == "Deployment")
    return list(dep["spec"]["template"]["spec"]["containers"][0]["args"])


def settings_of(args: list[str]) -> Any:
    parser = argparse.ArgumentParser()
    add_subcommands(parser.add_subparsers())
    return settings_from_args(parser.parse_args(args))


def engine_pod(fs_group: int | None) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
    doc["metadata"].update(namespace="serving", uid="u")
    doc["spec"]["engine"] = {"modelCache": {"claimName": "model-cache"}}
    options = render.RenderOptions(pod_fs_group=fs_group)
    dep = next(m for m in render.render_resource(doc, options) if m["kind"] == "Deployment"
               and m["metadata"]["name"] == "qwen3-8b-engine")
    kubernetes_validate.validate(dep, "1.34", strict=True)
    return dict(dep["spec"]["template"]["spec"])


def test_vanilla_cluster_engine_pods_get_an_fs_group() -> None:
    settings = settings_of(operator_args({}, openshift=False))
    assert settings.pod_fs_group == 65532
    pod = engine_pod(settings.pod_fs_group)
    assert pod["securityContext"]["fsGroup"] == 65532
    assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    # PodSecurity restricted allows a fixed fsGroup (only OpenShift's SCC refuses one).
    assert restricted_violations(pod, {}) == []
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "model-cache"}} in pod["volumes"]


def test_openshift_engine_pods_leave_the_fs_group_to_the_scc() -> None:
    args = operator_args({}, openshift=True)
    assert not any(a.startswith("--pod-fs-group") for a in args)
    settings = settings_of(args)
    assert settings.pod_fs_group is None
    pod = engine_pod(settings.pod_fs_group)
    assert "fsGroup" not in pod["securityContext"] and "fsGroupChangePolicy" not in pod["securityContext"]
    assert fixed_id_violations(pod) == [] and restricted_violations(pod, {}) == []


def test_an_explicit_fs_group_or_none() -> None:
    assert settings_of(operator_args({"operator": {"enginePodFsGroup": 2000}})).pod_fs_group == 2000
    assert settings_of(operator_args({"operator": {"enginePodFsGroup": ""}})).pod_fs_group is None
