"""Render the chart with a real Helm (helm-sdkpy, Helm v4's Go library) by installing it into the emulator.

helm-sdkpy has no `template` call; an install with the in-memory release driver into the patched kmock emulator
renders every template (the emulator then holds the objects, and the result's `manifest` is the rendered YAML).
Helm reads HELM_DRIVER when its library loads, so this runs as a subprocess:

    HELM_DRIVER=memory python -m tests.component.helm_render CHART_DIR VALUES_JSON NAMESPACE [OPTIONS_JSON]

and prints {"manifest": ..., "notes": ..., "crds": [...]} as JSON on stdout. OPTIONS_JSON (optional):
  "monitoring": false      the emulator does not serve monitoring.coreos.com/v1 (a cluster without the Prometheus
                           operator): Helm's .Capabilities then lacks it and creating such objects fails
  "upgrade": [CHART, VALUES]   after the install, `helm upgrade` the release to this chart and values (the output
                           then describes the upgrade, and "crds" the CRDs the emulator holds after it)
  "take_ownership": true   the upgrade adopts existing objects that lack Helm's ownership metadata
  "openshift": true        the emulator serves security.openshift.io/v1 SecurityContextConstraints (as OpenShift
                           does): Helm's .Capabilities then has it
  "precreate": [OBJECTS]   objects stored in the emulator before the install (e.g. a CRD an older chart installed
                           from crds/, which Helm does not own)
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import yaml
from kmock import ResourceInfo, Server

from tests.component.kube_emulator import KubeEmulator

VERBS = ["get", "list", "watch", "create", "update", "patch", "delete"]
MONITORING_GROUP = "monitoring.coreos.com/"
RESOURCES = {
    "v1/serviceaccounts": ("ServiceAccount", True), "v1/services": ("Service", True),
    "v1/configmaps": ("ConfigMap", True), "v1/secrets": ("Secret", True), "v1/namespaces": ("Namespace", False),
    "apps/v1/deployments": ("Deployment", True),
    "rbac.authorization.k8s.io/v1/clusterroles": ("ClusterRole", False),
    "rbac.authorization.k8s.io/v1/clusterrolebindings": ("ClusterRoleBinding", False),
    "rbac.authorization.k8s.io/v1/roles": ("Role", True),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", True),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False),
    "monitoring.coreos.com/v1/servicemonitors": ("ServiceMonitor", True),
    "monitoring.coreos.com/v1/podmonitors": ("PodMonitor", True),
    "monitoring.coreos.com/v1/prometheusrules": ("PrometheusRule", True),
}


def _crds(kmock: KubeEmulator) -> list[dict[str, Any]]:
    return [dict(obj.raw) for (res, _, _), obj in list(kmock.objects.items())
            if res.plural == "customresourcedefinitions" and not obj.deleted]


async def render(chart: str, values: dict[str, Any], namespace: str,
                 options: dict[str, Any] | None = None) -> dict[str, Any]:
    from helm_sdkpy import Configuration
    from helm_sdkpy.actions import Install, Upgrade

    options = options or {}
    minor = int(os.environ.get("EMULATOR_KUBERNETES_MINOR", "34"))
    async with KubeEmulator(server_minor=minor) as kmock, Server(kmock):
        for key, (kind, namespaced) in RESOURCES.items():
            if key.startswith(MONITORING_GROUP) and not options.get("monitoring", True):
                continue  # discovery then lists no monitoring.coreos.com group at all
            kmock.resources[key] = ResourceInfo(kind=kind, namespaced=namespaced, verbs=VERBS)
        if options.get("openshift"):
            kmock.resources["security.openshift.io/v1/securitycontextconstraints"] = ResourceInfo(
                kind="SecurityContextConstraints", namespaced=False, verbs=VERBS)
        url = str(kmock.url).rstrip("/")
        kubeconfig = yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": url}}],
            "users": [{"name": "test", "user": {"token": "test"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "test",
                                                          "namespace": namespace}}],
        })
        config = Configuration(namespace=namespace, kubeconfig=kubeconfig)
        for obj in options.get("precreate", []):
            kmock.objects["apiextensions.k8s.io/v1/customresourcedefinitions", None, obj["metadata"]["name"]] = obj
        result = await Install(config).run("minedraft", chart, values=values, wait=False, timeout=60)
        crds_after_install = _crds(kmock)
        if "upgrade" in options:
            upgrade_chart, upgrade_values = options["upgrade"]
            result = await Upgrade(config).run("minedraft", upgrade_chart, values=upgrade_values, wait=False,
                                               timeout=60, take_ownership=bool(options.get("take_ownership")))
        return {"manifest": result.get("manifest", ""), "notes": (result.get("info") or {}).get("notes", ""),
                "crds_after_install": crds_after_install, "crds": _crds(kmock)}


def main() -> int:
    chart, values, namespace = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    print(json.dumps(asyncio.run(render(chart, values, namespace, options))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
