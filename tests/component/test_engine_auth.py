"""No way around the gateway's auth (issue 30, defect 2): engines authenticate their callers when auth is on.

Many clusters do not enforce NetworkPolicy (EKS's default CNI, GKE Standard without Dataplane V2, flannel), so the
operator's policy cannot be all that keeps a pod from calling an engine directly. With spec.gateway.authTokenSecretRef
set, the operator mounts that Secret into the engine pods too: `minedraft serve --token-file` refuses gRPC (but
health, which the kubelet's probes use without credentials) and HTTP calls without the token, and the gateway
presents it on every call (`--engine-token-file`). Shown here over loopback with the real engine server (no model:
an authenticated call gets past the check to "loading"), the real gateway and a fake engine replica behind the same
interceptor, and the rendered pods. What only a real cluster shows: the kubelet's in-place update of the mounted
Secret (modelled here by the same atomic symlink swap it performs).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minedraft.api import pb, pb_grpc
from minedraft.api.auth import TokenFile
from minedraft.gateway.app import Gateway, GatewayConfig
from minedraft.operator import render
from minedraft.server.app import EngineServer
from minedraft.testing.fake_engine import FakeEngineServer

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
REQUEST = pb.GenerateRequest(prompt="def main():", sampling_params=pb.SamplingParams(max_tokens=3))


def kubelet_secret_volume(root: Path, key: str, value: str, version: int) -> Path:
    """A Secret volume as the kubelet writes it: `<key>` -> `..data/<key>`, `..data` -> a timestamped folder, the
    update an atomic rename of a new `..data` symlink. Returns the path the container reads."""
    folder = root / f"..2026_12_04_{version:02d}"
    folder.mkdir()
    (folder / key).write_text(value + "\n")
    tmp = root / "..data_tmp"
    tmp.symlink_to(folder.name)
    os.replace(tmp, root / "..data")
    if not (root / key).is_symlink():
        (root / key).symlink_to(f"..data/{key}")
    return root / key


async def code_of(call: Any) -> grpc.StatusCode | None:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return None


async def test_engine_refuses_callers_without_the_token_and_follows_rotation(tmp_path: Path) -> None:
    volume = tmp_path / "auth"
    volume.mkdir()
    path = kubelet_secret_volume(volume, "token", "first-secret", 1)
    tokens = TokenFile(path)
    server = EngineServer("engine-0", tokens=tokens.tokens)
    port = await server.start("127.0.0.1:0")
    http_port = await server.start_http("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            assert await code_of(stub.Generate(REQUEST)) == grpc.StatusCode.UNAUTHENTICATED
            assert await code_of(stub.Generate(REQUEST, metadata=(("authorization", "Bearer wrong"),))) == \
                grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetModelInfo(pb.GetModelInfoRequest())
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # Past the check (no model loaded here: "loading").
            good = (("authorization", "Bearer first-secret"),)
            assert await code_of(stub.Generate(REQUEST, metadata=good)) == grpc.StatusCode.UNAVAILABLE
            # The kubelet's gRPC probes carry no credentials: health stays open.
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            # The Secret rotates: the kubelet swaps the volume's data; no restart.
            kubelet_secret_volume(volume, "token", "second-secret", 2)
            assert await code_of(stub.Generate(REQUEST, metadata=good)) == grpc.StatusCode.UNAUTHENTICATED
            assert await code_of(stub.Generate(REQUEST, metadata=(("authorization", "Bearer second-secret"),))) == \
                grpc.StatusCode.UNAVAILABLE
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{http_port}/v1/models"
            async with session.get(url) as response:
                assert response.status == 401
            async with session.get(url, headers={"Authorization": "Bearer second-secret"}) as response:
                assert response.status != 401
    finally:
        await server.stop()


async def test_the_gateway_presents_its_credential_to_engines(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("team-token\n")
    engine_tokens = TokenFile(path)
    engine = await FakeEngineServer("engine-0", tokens=engine_tokens.tokens).start()
    results: dict[str, grpc.StatusCode | None] = {}
    try:
        for name, credential in (("with", TokenFile(path, "engine-token-file").first), ("without", None)):
            gateway = Gateway(GatewayConfig(tokens=(b"team-token",), engine_token=credential,
                                            engine_wait_timeout_seconds=5.0))
            port = await gateway.start("127.0.0.1:0")
            gateway.set_engines([engine.address])
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    call = pb_grpc.GenerationStub(channel).Generate(
                        REQUEST, metadata=(("authorization", "Bearer team-token"),), timeout=30)
                    results[name] = await code_of(call)
            finally:
                await gateway.stop()
    finally:
        await engine.stop(0)
    assert results["with"] is None  # the stream completed
    assert results["without"] is not None  # the engine refused the gateway that presented nothing


def test_rendered_engines_check_the_gateways_token() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "auth-tls.yaml").read_text())
    doc["metadata"].update(namespace="serving", uid="u")
    manifests = render.render_resource(doc)
    pods = {m["metadata"]["name"]: m["spec"]["template"]["spec"] for m in manifests if m["kind"] == "Deployment"}
    engine_pod = next(p for n, p in pods.items() if n.endswith("-engine"))
    gateway_pod = next(p for n, p in pods.items() if n.endswith("-gateway"))
    from minedraft.cli import build_parser

    engine_args = build_parser().parse_args(engine_pod["containers"][0]["command"][1:])
    gateway_args = build_parser().parse_args(gateway_pod["containers"][0]["command"][1:])
    assert engine_args.token_file and engine_args.token_file == gateway_args.engine_token_file
    assert engine_args.http_port == 0  # behind the gateway the engines' HTTP port is closed

    def secret_at(pod: dict[str, Any], path: str) -> tuple[str, str]:
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        key = path[len(mount["mountPath"]) + 1:]
        assert [i["path"] for i in volume["secret"]["items"]] == [key]
        return volume["secret"]["secretName"], volume["secret"]["items"][0]["key"]

    # The same Secrets, in the same order (the internal credential; for this release, the clients' token too).
    assert [secret_at(engine_pod, p) for p in engine_args.token_file] == \
        [secret_at(gateway_pod, p) for p in gateway_args.engine_token_file]
    assert secret_at(gateway_pod, gateway_args.token_file) == (doc["spec"]["gateway"]["authTokenSecretRef"]["name"],
                                                               doc["spec"]["gateway"]["authTokenSecretRef"]
                                                               .get("key", "token"))


async def test_no_token_no_check() -> None:
    """Without auth nothing changes: an engine server without tokens serves unauthenticated callers."""
    server = EngineServer("engine-0")
    port = await server.start("127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert await code_of(pb_grpc.GenerationStub(channel).Generate(REQUEST)) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop()
    await asyncio.sleep(0)
