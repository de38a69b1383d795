"""Rotating service-account tokens (issue 16): every Kubernetes client re-reads the projected token.

Bound tokens expire in about an hour and the kubelet rewrites the token file before then. The emulator here serves
only the tokens it currently accepts (401 otherwise) and ends open watches (as an API server does at its request
timeout), so a client that read its token once stops seeing changes; one that reads the file per request does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kmock import ResourceInfo, Server
from kubernetes import client as k8s_client

from minedraft.gateway.discovery import EndpointSliceWatcher, KubernetesApi
from minedraft.operator.kube import KubeClient, Resource, token_file_hook
from tests.component.kube_emulator import KubeEmulator

pytestmark = pytest.mark.timeout(60)
NS = "serving"
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
TIMEOUT_SECONDS = 20.0


async def wait_for(what: str, predicate: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        await asyncio.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def endpoint_slice(name: str, ip: str) -> dict[str, Any]:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": NS, "labels": {"kubernetes.io/service-name": "engines"}},
            "addressType": "IPv4", "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}],
            "ports": [{"name": "grpc", "port": 50051, "protocol": "TCP"}]}


@pytest.fixture
async def api() -> AsyncIterator[KubeEmulator]:
    async with KubeEmulator() as kmock, Server(kmock):
        kmock.resources["discovery.k8s.io/v1/endpointslices"] = ResourceInfo(
            kind="EndpointSlice", namespaced=True, verbs=["get", "list", "watch", "create", "delete"])
        kmock.resources["apps/v1/deployments"] = ResourceInfo(kind="Deployment", namespaced=True,
                                                              verbs=["get", "create", "patch"])
        yield kmock


async def post(kmock: KubeEmulator, token: str, path: str, body: dict[str, Any]) -> None:
    async with aiohttp.ClientSession() as session, session.post(
            str(kmock.url).rstrip("/") + path, json=body, headers={"Authorization": f"Bearer {token}"}) as response:
        assert response.status in (200, 201), await response.text()


@pytest.mark.parametrize("reads_file", [True, False], ids=["token-file", "token-read-once"])
async def test_discovery_keeps_following_endpointslices_after_the_token_rotates(
        api: KubeEmulator, tmp_path: Path, reads_file: bool) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("token-1\n")
    api.accepted_tokens = {"token-1"}
    await post(api, "token-1", SLICES, endpoint_slice("engines-a", "10.0.0.1"))
    base = str(api.url).rstrip("/")
    # What the gateway gets in a pod (KubernetesApi.in_cluster reads the same file), against the old behaviour of
    # reading the token once.
    kube_api = (KubernetesApi(base, token_file=str(token_file)) if reads_file
                else KubernetesApi(base, token=token_file.read_text().strip()))
    seen: list[set[str]] = []
    watcher = EndpointSliceWatcher(kube_api, NS, "engines", "grpc", seen.append, retry_seconds=0.05)
    task = asyncio.create_task(watcher.run())
    try:
        await wait_for("the first slice", lambda: seen and seen[-1] == {"10.0.0.1:50051"})
        # The kubelet rotates the token; the old one expires; the API server's watch timeout ends the stream.
        token_file.write_text("token-2\n")
        api.accepted_tokens = {"token-2"}
        await api.end_watches(NS)
        await post(api, "token-2", SLICES, endpoint_slice("engines-b", "10.0.0.2"))
        if reads_file:
            await wait_for("the slice added after the rotation",
                           lambda: seen[-1] == {"10.0.0.1:50051", "10.0.0.2:50051"})
        else:
            # The defect this test is about: the old token is refused and discovery stays frozen.
            await wait_for("401s on the re-list", lambda: watcher.num_lists == 1 and len([
                r for r in list(api) if r.headers.get("Authorization") == "Bearer token-1"]) >= 4)
            assert seen[-1] == {"10.0.0.1:50051"}
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_operator_client_sends_the_token_on_file_at_each_request(api: KubeEmulator, tmp_path: Path) -> None:
    """The operator's client (kube.KubeClient) in a pod: the official loader's configuration with our hook, which
    reads the projected token file before every request."""
    token_file = tmp_path / "token"
    token_file.write_text("token-1")
    configuration = k8s_client.Configuration(host=str(api.url).rstrip("/"))
    configuration.api_key["BearerToken"] = "Bearer token-0"  # what the in-cluster loader read at start-up
    configuration.refresh_api_key_hook = token_file_hook(str(token_file))
    kube = KubeClient(configuration)
    deployments = Resource("apps", "v1", "deployments", "Deployment")
    try:
        api.accepted_tokens = {"token-1"}
        assert await kube.get(deployments, NS, "missing") is None
        token_file.write_text("token-2")
        api.accepted_tokens = {"token-2"}
        assert await kube.get(deployments, NS, "missing") is None  # 404, not 401
    finally:
        kube.close()
