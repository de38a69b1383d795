"""Render the chart with a real Helm (helm-sdkpy, Helm v4's Go library) by installing it into the emulator.

helm-sdkpy has no `template` call; an install with the in-memory release driver into the patched kmock emulator
renders every template (the emulator then holds the objects, and the result's `manifest` is the rendered YAML).
Helm reads HELM_DRIVER when its library loads, so this runs as a subprocess:

    HELM_DRIVER=memory python -m tests.component.helm_render CHART_DIR VALUES_JSON NAMESPACE

and prints {"manifest": ..., "notes": ...} as JSON on stdout.
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
    "monitoring.coreos.com/v1/prometheusrules": ("PrometheusRule", True),
}


async def render(chart: str, values: dict[str, Any], namespace: str) -> dict[str, Any]:
    from helm_sdkpy import Configuration
    from helm_sdkpy.actions import Install

    minor = int(os.environ.get("EMULATOR_KUBERNETES_MINOR", "34"))
    async with KubeEmulator(server_minor=minor) as kmock, Server(kmock):
        for key, (kind, namespaced) in RESOURCES.items():
            kmock.resources[key] = ResourceInfo(kind=kind, namespaced=namespaced, verbs=VERBS)
        url = str(kmock.url).rstrip("/")
        kubeconfig = yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": url}}],
            "users": [{"name": "test", "user": {"token": "test"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "test",
                                                          "namespace": namespace}}],
        })
        config = Configuration(namespace=namespace, kubeconfig=kubeconfig)
        result = await Install(config).run("minedraft", chart, values=values, wait=False, timeout=60)
        return {"manifest": result.get("manifest", ""), "notes": (result.get("info") or {}).get("notes", ""),
                "crds": [dict(obj.raw) for (res, _, _), obj in list(kmock.objects.items())
                         if res.plural == "customresourcedefinitions" and not obj.deleted]}


def main() -> int:
    chart, values, namespace = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    print(json.dumps(asyncio.run(render(chart, values, namespace))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
