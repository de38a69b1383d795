"""A small async Kubernetes client for what the operator does besides kopf's own watching: get, apply, discover.

It wraps the official client's ApiClient (which owns authentication, token refresh and TLS) and runs its blocking
calls in threads. Every call the operator makes goes through here, and ``PERMISSIONS`` lists the verbs each method
needs on each resource: the chart's ClusterRole is checked against that list, and the component test checks that
the requests the real operator sends stay within it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from minedraft.operator import spec as s
from minedraft.operator.render import FIELD_MANAGER


@dataclass(frozen=True)
class Resource:
    group: str  # "" for the core API
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        path = f"{base}/namespaces/{namespace}/{self.plural}"
        if name is not None:
            path += f"/{name}"
            if subresource is not None:
                path += f"/{subresource}"
        return path


# Read-only tables (MappingProxyType): module-level, but never state.
RESOURCES = MappingProxyType({r.kind: r for r in (
    Resource("apps", "v1", "deployments", "Deployment"),
    Resource("", "v1", "services", "Service"),
    Resource("", "v1", "serviceaccounts", "ServiceAccount"),
    Resource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget"),
    Resource("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    Resource("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    Resource("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy"),
    Resource("monitoring.coreos.com", "v1", "podmonitors", "PodMonitor"),
)})
PODS = Resource("", "v1", "pods", "Pod")
# Only created (the internal credential, once per MineDraft), never read, listed or updated by the operator.
SECRETS = Resource("", "v1", "secrets", "Secret")
MINEDRAFTS = Resource(s.API_GROUP, s.API_VERSION, s.PLURAL, s.KIND)
EVENTS = Resource("", "v1", "events", "Event")

# (apiGroup, resource[/subresource]) -> verbs. Server-side apply needs "patch", plus "create" when the object does not
# exist yet; "delete" removes objects no longer rendered and replaces a Deployment whose (immutable) selector changed.
# The gateway's Role grants endpointslices get/list/watch, and Kubernetes only lets the operator create a Role
# granting what the operator itself holds (no "escalate"/"bind" verbs here), hence that entry; the autoscaler also
# lists them to find engine pods to scrape when no Prometheus is configured. Secrets are never read: pods reference
# them by name and the kubelet reads them; the operator only creates the internal credential's (see below).
PERMISSIONS: Mapping[tuple[str, str], frozenset[str]] = MappingProxyType({
    **{(r.group, r.plural): frozenset({"get", "create", "patch", "delete"}) for r in RESOURCES.values()},
    ("discovery.k8s.io", "endpointslices"): frozenset({"get", "list", "watch"}),
    # Why a rollout is stuck (Unschedulable, image pulls, crash loops) for the Progressing condition.
    ("", "pods"): frozenset({"list"}),
    # kopf: watching MineDrafts, its progress annotations, status writes and Events.
    (s.API_GROUP, s.PLURAL): frozenset({"list", "watch", "patch"}),
    (s.API_GROUP, f"{s.PLURAL}/status"): frozenset({"patch"}),
    # OwnerReferencesPermissionEnforcement (OpenShift, some hardened clusters): setting blockOwnerDeletion on an
    # owner reference needs "update" on the owner's finalizers subresource (checked, never called).
    (s.API_GROUP, f"{s.PLURAL}/finalizers"): frozenset({"update"}),
    # The autoscaler writes spec.replicas through /scale (as an HPA would), never the whole spec.
    (s.API_GROUP, f"{s.PLURAL}/scale"): frozenset({"patch"}),
    # create: the operator's own Events; list: why a pod stays in ContainerCreating (FailedMount of a missing or
    # mis-keyed Secret volume, FailedAttachVolume of a ReadWriteOnce volume attached elsewhere), which only Events
    # say. Listed on each reconcile pass, in the MineDraft's namespace: no watch needed.
    ("", "events"): frozenset({"create", "list"}),
    # The internal credential between gateway, engines and drafter pool (<name>-internal): created once with a
    # random token if absent (a 409 means it exists); the operator never reads a Secret.
    ("", "secrets"): frozenset({"create"}),
})


def slice_addresses(listing: Mapping[str, Any], ready_only: bool) -> list[str]:
    """Endpoint addresses of an EndpointSlice list; with ready_only, those whose `conditions.ready` is not false
    (unset means ready: the API's own rule)."""
    addresses: list[str] = []
    for item in listing.get("items") or []:
        for endpoint in item.get("endpoints") or []:
            if not ready_only or (endpoint.get("conditions") or {}).get("ready", True):
                addresses += [a for a in endpoint.get("addresses") or [] if a not in addresses]
    return addresses


class KubeError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        reason = body
        with contextlib.suppress(ValueError, AttributeError):  # not a Status object: keep the raw body
            reason = json.loads(body).get("message", body)
        super().__init__(f"{method} {path}: HTTP {status}: {reason}"[:500])
        self.status = status


SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


def token_file_hook(token_file: str) -> Any:
    """A refresh_api_key_hook that re-reads a projected service-account token before every request.

    Bound tokens expire (about an hour) and the kubelet rewrites the file well before; reading a small file per
    request is cheap and never sends a stale token (the official loader re-reads only once a minute).
    """
    def refresh(configuration: Any) -> None:
        with open(token_file) as f:
            token = f.read().strip()
        if token:
            configuration.api_key["BearerToken"] = f"Bearer {token}"
    return refresh


class KubeClient:
    """Thin async wrapper over kubernetes.client.ApiClient; construct with a Configuration (cluster or test)."""

    def __init__(self, configuration: Any | None = None) -> None:
        from kubernetes import client

        self._api = client.ApiClient(configuration)

    @classmethod
    def from_environment(cls) -> KubeClient:
        """In-cluster credentials when running in a pod (token re-read per request), else the kubeconfig context."""
        from kubernetes import client, config

        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)
            configuration.refresh_api_key_hook = token_file_hook(SERVICE_ACCOUNT_TOKEN)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
        return cls(configuration)

    def close(self) -> None:
        self._api.close()

    def _call(self, method: str, path: str, body: Any = None, query: list[tuple[str, str]] | None = None,
              content_type: str = "application/json") -> tuple[int, Any]:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        m, url, h, b, _ = self._api.param_serialize(method=method, resource_path=path, query_params=query or [],
                                                 header_params=headers, body=body, auth_settings=["BearerToken"])
        response = self._api.call_api(m, url, header_params=h, body=b)
        data = response.read()
        text = data.decode() if isinstance(data, bytes) else str(data)
        if response.status == 404:
            return 404, None
        if response.status >= 400:
            raise KubeError(response.status, method, path, text)
        return response.status, json.loads(text) if text else None

    async def get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any] | None:
        _, obj = await asyncio.to_thread(self._call, "GET", resource.path(namespace, name))
        return obj

    async def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply as the operator's field manager, taking over fields others changed (force)."""
        resource = RESOURCES[manifest["kind"]]
        meta = manifest["metadata"]
        status, obj = await asyncio.to_thread(
            self._call, "PATCH", resource.path(meta["namespace"], meta["name"]), dict(manifest),
            [("fieldManager", FIELD_MANAGER), ("force", "true")], "application/apply-patch+yaml")
        if status == 404:
            raise KubeError(404, "PATCH", resource.path(meta["namespace"], meta["name"]), "not found")
        return dict(obj or {})

    async def create_if_absent(self, resource: Resource, manifest: Mapping[str, Any]) -> bool:
        """Create an object unless one of that name exists (then nothing is read or changed): True if created."""
        try:
            await asyncio.to_thread(self._call, "POST", resource.path(manifest["metadata"]["namespace"]),
                                    dict(manifest))
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def delete(self, resource: Resource, namespace: str, name: str, orphan: bool = False) -> None:
        """Delete an object (a 404 counts as done); orphan=True leaves its dependents (a Deployment's ReplicaSets)."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Orphan" if orphan else "Background"}
        query = [("propagationPolicy", "Orphan" if orphan else "Background")]
        await asyncio.to_thread(self._call, "DELETE", resource.path(namespace, name), body, query)

    async def list_objects(self, resource: Resource, namespace: str, label_selector: str = "",
                           field_selector: str = "") -> list[dict[str, Any]]:
        query = [(k, v) for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector)) if v]
        _, doc = await asyncio.to_thread(self._call, "GET", resource.path(namespace), None, query)
        return list((doc or {}).get("items") or [])

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """Merge-patch a MineDraft's status subresource (the periodic passes' status writes)."""
        path = MINEDRAFTS.path(namespace, name, "status")
        code, _ = await asyncio.to_thread(self._call, "PATCH", path, {"status": dict(status)}, None,
                                          "application/merge-patch+json")
        if code == 404:
            raise KubeError(404, "PATCH", path, "not found")

    async def scale(self, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        """Set a MineDraft's spec.replicas through its /scale subresource (what `kubectl scale` and HPAs use)."""
        path = MINEDRAFTS.path(namespace, name, "scale")
        status, obj = await asyncio.to_thread(self._call, "PATCH", path, {"spec": {"replicas": replicas}}, None,
                                              "application/merge-patch+json")
        if status == 404:
            raise KubeError(404, "PATCH", path, "not found")
        return dict(obj or {})

    async def scale_drafter_pool(self, namespace: str, name: str, replicas: int) -> None:
        """Set a MineDraft's spec.drafterPool.replicas (the pool's autoscaler; the reconcile renders it)."""
        path = MINEDRAFTS.path(namespace, name)
        code, _ = await asyncio.to_thread(self._call, "PATCH", path, {"spec": {"drafterPool": {"replicas": replicas}}},
                                          None, "application/merge-patch+json")
        if code == 404:
            raise KubeError(404, "PATCH", path, "not found")

    async def _slices(self, namespace: str, service: str) -> Mapping[str, Any]:
        path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        _, doc = await asyncio.to_thread(self._call, "GET", path, None,
                                         [("labelSelector", f"kubernetes.io/service-name={service}")])
        return doc or {}

    async def ready_addresses(self, namespace: str, service: str) -> list[str]:
        """IP addresses of a Service's ready endpoints, from its EndpointSlices."""
        return slice_addresses(await self._slices(namespace, service), ready_only=True)

    async def all_addresses(self, namespace: str, service: str) -> list[str]:
        """IP addresses of every endpoint of a Service, ready or not (gateways at zero engines are scraped whatever
        their readiness: a not-ready gateway may still hold the streams that must wake the engines)."""
        return slice_addresses(await self._slices(namespace, service), ready_only=False)

    async def has_api(self, group: str, version: str, plural: str) -> bool:
        """Discovery (allowed to every authenticated client): whether the cluster serves group/version/plural."""
        status, doc = await asyncio.to_thread(self._call, "GET", f"/apis/{group}/{version}")
        if status == 404 or not doc:
            return False
        return any(r.get("name") == plural for r in doc.get("resources", []))
