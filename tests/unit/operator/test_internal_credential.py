"""The internal credential: an operator-generated Secret (<name>-internal) between gateway, engines and drafter pool,
so a pod that is not the gateway cannot call an engine (for this release engines behind an authenticating gateway also
accept the clients' token, which 0.1.0's gateways present: an upgrade mixes old and new pods)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from minedraft.api.auth import TokenFile
from minedraft.engine.drafter import wire
from minedraft.operator import render
from minedraft.operator import spec as s
from minedraft.operator.crd import defaulted

from .test_render import engine_container, flag, load
from .test_staged_rollout import FakeCluster, minedraft, operator


def pod(manifests: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (deployment,) = [m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == name]
    return deployment["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def secret_volumes(pod_spec: dict[str, Any]) -> dict[str, str]:
    return {v["name"]: v["secret"]["secretName"] for v in pod_spec["volumes"] if "secret" in v}


def test_behind_the_gateway_engines_accept_only_the_internal_credential() -> None:
    manifests = render.render_resource(load("minimal"))
    engine = engine_container(manifests)
    assert flag(engine["command"], "--token-file") == render.INTERNAL_TOKEN_PATH
    assert secret_volumes(pod(manifests, "qwen3-8b-engine"))["internal"] == "qwen3-8b-internal"
    gateway = pod(manifests, "qwen3-8b-gateway")
    command = gateway["containers"][0]["command"]
    assert flag(command, "--engine-token-file") == render.INTERNAL_TOKEN_PATH
    assert "--token-file" not in command  # no client auth asked for
    assert secret_volumes(gateway)["internal"] == "qwen3-8b-internal"


def test_the_gateway_presents_the_internal_credential_first_and_the_clients_token_only_to_old_engines() -> None:
    manifests = render.render_resource(load("auth-tls"))
    gateway = pod(manifests, "llama-secure-gateway")
    command = gateway["containers"][0]["command"]
    assert flag(command, "--token-file") == f"{render.AUTH_DIR}/token"  # clients
    assert flag(command, "--engine-token-file") == render.INTERNAL_TOKEN_PATH  # engines: this release's first
    # For this release only (an upgrade from 0.1.0 mixes old and new pods, tests/component/test_upgrade_credentials):
    # 0.1.0's engines accept only the clients' token, and 0.1.0's gateways present it to this release's engines.
    assert [w for i, w in enumerate(command) if command[i - 1] == "--engine-token-file"] == [
        render.INTERNAL_TOKEN_PATH, f"{render.AUTH_DIR}/token"]
    engine_pod = pod(manifests, "llama-secure-engine")
    assert secret_volumes(engine_pod)["auth"] == "minedraft-token"
    engine = engine_container(manifests)["command"]
    assert [w for i, w in enumerate(engine) if engine[i - 1] == "--token-file"] == [
        render.INTERNAL_TOKEN_PATH, f"{render.AUTH_DIR}/token"]


def test_without_the_gateway_engines_serve_clients_directly_and_no_credential_is_made() -> None:
    doc = load("minimal")
    doc["spec"]["gateway"] = {"enabled": False}
    spec = s.parse_spec(defaulted(doc)["spec"])
    assert not render.needs_internal_secret(spec)
    assert "--token-file" not in engine_container(render.render_resource(doc))["command"]


def test_a_pool_without_a_secret_of_its_own_uses_the_internal_credential() -> None:
    doc = minedraft("chat")
    doc["spec"]["speculation"] = {"mode": "psd"}
    doc["spec"]["drafterPool"] = {}
    manifests = render.render_resource(defaulted(doc))
    assert secret_volumes(pod(manifests, "chat-drafter"))["drafter-token"] == "chat-internal"
    assert secret_volumes(pod(manifests, "chat-engine"))["drafter-token"] == "chat-internal"
    doc["spec"]["drafterPool"] = {"tokenSecretRef": {"name": "pool-token"}}
    manifests = render.render_resource(defaulted(doc))
    assert secret_volumes(pod(manifests, "chat-drafter"))["drafter-token"] == "pool-token"
    doc["spec"]["gateway"] = {"enabled": False}
    assert render.needs_internal_secret(s.parse_spec(defaulted(doc)["spec"])) is False
    doc["spec"]["drafterPool"] = {}
    assert render.needs_internal_secret(s.parse_spec(defaulted(doc)["spec"])) is True


def test_the_operator_creates_the_secret_once_and_never_overwrites_it(tmp_path: Path) -> None:
    cluster = FakeCluster()
    reconciler = operator(cluster, "1.0", "OneAtATime")
    outcome = asyncio.run(reconciler.reconcile(minedraft("chat")))
    assert "Secret/chat-internal created" in outcome.applied
    secret = cluster.objects[("Secret", "ns", "chat-internal")]
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-chat"  # goes with the MineDraft
    token = secret["stringData"]["token"]
    # The file the pods read works for both readers: the engine server's token file and the drafter pool's.
    path = tmp_path / "token"
    path.write_text(token)
    assert TokenFile(str(path)).tokens and len(wire.read_tokens(str(path))[0]) >= 16
    # Rotated by its owner: left alone (the operator only creates it when it is missing).
    secret["stringData"]["token"] = "rotated-token-of-enough-bytes\n"
    again = operator(cluster, "1.0", "OneAtATime")
    assert "Secret/chat-internal created" not in asyncio.run(again.reconcile(minedraft("chat"))).applied
    kept = cluster.objects[("Secret", "ns", "chat-internal")]["stringData"]["token"]
    assert kept == "rotated-token-of-enough-bytes\n"
    # Two MineDrafts never share one.
    asyncio.run(reconciler.reconcile(minedraft("other")))
    assert cluster.objects[("Secret", "ns", "other-internal")]["stringData"]["token"] != token


def test_a_restarted_operator_sends_nothing_and_a_deleted_secret_is_made_again() -> None:
    class Counting(FakeCluster):
        creates = 0

        async def create_if_absent(self, resource: Any, manifest: dict[str, Any]) -> bool:
            Counting.creates += 1
            return await super().create_if_absent(resource, manifest)

    cluster = Counting()
    doc = minedraft("chat")
    first = asyncio.run(operator(cluster, "1.0", "OneAtATime").reconcile(doc))
    assert first.status["internalCredential"] == "chat-internal" and Counting.creates == 1
    doc["status"] = first.status  # what the handler wrote
    asyncio.run(operator(cluster, "1.0", "OneAtATime").reconcile(doc))  # a restarted operator
    assert Counting.creates == 1
    # Deleted by someone: the pods say so (FailedMount), and the operator creates a new one.
    del cluster.objects[("Secret", "ns", "chat-internal")]
    cluster.objects[("Pod", "ns", "chat-gateway-1")] = {}

    async def issues(meta: Any) -> tuple[Any, ...]:
        from minedraft.operator.status import PodIssue

        return (PodIssue("gateway", "chat-gateway-1", "FailedMount",
                         'MountVolume.SetUp failed for volume "internal" : secret "chat-internal" not found'),)

    again = operator(cluster, "1.0", "OneAtATime")
    again._pod_issues = issues  # type: ignore[method-assign]
    outcome = asyncio.run(again.reconcile(doc))
    assert "Secret/chat-internal created" in outcome.applied and ("Secret", "ns", "chat-internal") in cluster.objects


def test_an_api_error_recreating_the_deleted_secret_becomes_a_condition_not_an_exception() -> None:
    from minedraft.operator.kube import KubeError
    from minedraft.operator.status import PodIssue

    class Refusing(FakeCluster):
        """Creates the Secret once; the second create (after its deletion) is refused by the API server."""

        creates = 0

        async def create_if_absent(self, resource: Any, manifest: dict[str, Any]) -> bool:
            if manifest["kind"] == "Secret":
                self.creates += 1
                if self.creates > 1:
                    raise KubeError(403, "POST", "/api/v1/namespaces/ns/secrets", '{"message": "secrets is forbidden"}')
            return await super().create_if_absent(resource, manifest)

    cluster = Refusing()
    doc = minedraft("chat")
    doc["status"] = asyncio.run(operator(cluster, "1.0", "OneAtATime").reconcile(doc)).status
    del cluster.objects[("Secret", "ns", "chat-internal")]

    async def issues(meta: Any) -> tuple[Any, ...]:
        return (PodIssue("gateway", "chat-gateway-1", "FailedMount",
                         'MountVolume.SetUp failed for volume "internal" : secret "chat-internal" not found'),)

    again = operator(cluster, "1.0", "OneAtATime")
    again._pod_issues = issues  # type: ignore[method-assign]
    outcome = asyncio.run(again.reconcile(doc))  # raised KubeError before
    ready = next(c for c in outcome.status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "ApplyFailed"
    assert "Secret/chat-internal" in ready["message"] and "forbidden" in ready["message"]
    assert any(e.type == "Warning" and e.reason == "ApplyFailed" for e in outcome.events)
    assert outcome.status["internalCredential"] == "chat-internal"
