"""The generic Kubernetes behaviours tests/component/kmock_store.py adds to kmock, each against a real HTTP client,
and that the tests use kmock through its public interface only (no `kmock._internal`, no private members)."""

from __future__ import annotations

import ast
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest
from kmock import ResourceInfo, Server

from tests.component.kmock_store import KubernetesStore

TESTS = Path(__file__).resolve().parents[1]
NS = "team-a"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
PODS = f"/api/v1/namespaces/{NS}/pods"


@pytest.fixture
async def api() -> AsyncIterator[KubernetesStore]:
    async with KubernetesStore(server_minor=31) as store, Server(store):
        store.resources["apps/v1/deployments"] = ResourceInfo(kind="Deployment", namespaced=True,
                                                              subresources={"status"}, verbs={"get", "list"})
        store.resources["v1/pods"] = ResourceInfo(kind="Pod", namespaced=True, verbs={"get", "list"})
        yield store


async def call(api: KubernetesStore, method: str, path: str, body: Any = None,
               content_type: str = "application/json") -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": content_type} if body is not None else {}
    async with api.request(method, path, json=body, headers=headers) as response:
        return response.status, await response.json()


async def test_create_stamps_metadata_and_takes_the_namespace_from_the_url(api: KubernetesStore) -> None:
    status, created = await call(api, "POST", DEPLOYMENTS, {"metadata": {"generateName": "web-"}, "spec": {"a": 1}})
    assert status == 201
    meta = created["metadata"]
    assert meta["namespace"] == NS and meta["name"].startswith("web-") and meta["generation"] == 1
    assert meta["uid"] and meta["resourceVersion"] and meta["creationTimestamp"]
    status, refused = await call(api, "POST", DEPLOYMENTS, {"metadata": {"name": "x", "namespace": "other"}})
    assert status == 400 and refused["reason"] == "BadRequest"
    status, _ = await call(api, "POST", DEPLOYMENTS, {"metadata": {"name": meta["name"]}})
    assert status == 409


async def test_writes_bump_versions_and_keep_status_apart(api: KubernetesStore) -> None:
    _, created = await call(api, "POST", DEPLOYMENTS, {"metadata": {"name": "web"}, "spec": {"replicas": 1}})
    path = f"{DEPLOYMENTS}/web"
    # A merge patch to the object: generation and resourceVersion move, a status in it is ignored.
    _, patched = await call(api, "PATCH", path, {"spec": {"replicas": 2}, "status": {"ready": 9}},
                            "application/merge-patch+json")
    assert patched["metadata"]["generation"] == 2 and "status" not in patched
    assert patched["metadata"]["uid"] == created["metadata"]["uid"]
    assert int(patched["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])
    # /status changes the status only, and not the generation.
    _, with_status = await call(api, "PATCH", f"{path}/status", {"status": {"ready": 2}, "spec": {"replicas": 7}},
                                "application/merge-patch+json")
    assert with_status["status"] == {"ready": 2} and with_status["spec"] == {"replicas": 2}
    assert with_status["metadata"]["generation"] == 2
    # PUT replaces; naming an older resourceVersion is a conflict.
    stale = {**patched, "spec": {"replicas": 3}}
    status, _ = await call(api, "PUT", path, stale)
    assert status == 409
    current = {**with_status, "spec": {"replicas": 3}}
    status, replaced = await call(api, "PUT", path, current)
    assert status == 200 and replaced["spec"] == {"replicas": 3} and replaced["status"] == {"ready": 2}
    # A JSON patch whose test fails is a 422.
    status, _ = await call(api, "PATCH", path, [{"op": "test", "path": "/spec/replicas", "value": 99}],
                           "application/json-patch+json")
    assert status == 422


async def test_lists_name_their_kind_and_core_is_group_version_v1(api: KubernetesStore) -> None:
    await call(api, "POST", PODS, {"metadata": {"name": "p"}})
    status, listed = await call(api, "GET", PODS)
    assert status == 200 and listed["apiVersion"] == "v1" and listed["kind"] == "PodList"
    assert [p["metadata"]["name"] for p in listed["items"]] == ["p"]
    _, deployments = await call(api, "GET", DEPLOYMENTS)
    assert deployments["apiVersion"] == "apps/v1" and deployments["kind"] == "DeploymentList"
    _, core = await call(api, "GET", "/api/v1")
    assert core["groupVersion"] == "v1" and [r["name"] for r in core["resources"]] == ["pods"]
    _, version = await call(api, "GET", "/version")
    assert version["minor"] == "31"


async def test_finalizers_hold_a_deletion_until_they_are_removed(api: KubernetesStore) -> None:
    await call(api, "POST", PODS, {"metadata": {"name": "p", "finalizers": ["x/y"]}})
    status, marked = await call(api, "DELETE", f"{PODS}/p")
    assert status == 200 and marked["metadata"]["deletionTimestamp"]
    await call(api, "PATCH", f"{PODS}/p", {"metadata": {"finalizers": None}}, "application/merge-patch+json")
    status, _ = await call(api, "GET", f"{PODS}/p")
    assert status == 404


def test_tests_use_kmock_through_its_public_interface_only() -> None:
    """No `kmock._internal` import and no private kmock attribute (kmock's `_handle`, `_serve_*`, ...) in tests/."""
    public = {name for name in dir(kmock) if not name.startswith("_")}  # what `kmock` itself exports
    problems = []
    for path in TESTS.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kmock")
                    and (node.module != "kmock" or any(a.name not in public for a in node.names))):
                problems.append(f"{path.relative_to(TESTS)}:{node.lineno}: from {node.module} import ...")
            if isinstance(node, ast.Import) and any(a.name.startswith("kmock.") for a in node.names):
                problems.append(f"{path.relative_to(TESTS)}:{node.lineno}: import of a kmock submodule")
            if isinstance(node, ast.Attribute) and (
                    node.attr.startswith("_serve_") or node.attr in {"_handle", "_buses", "_objects", "_resources"}):
                problems.append(f"{path.relative_to(TESTS)}:{node.lineno}: kmock's private {node.attr}")
    assert problems == []
