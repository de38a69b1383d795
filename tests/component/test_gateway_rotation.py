"""No outage at the first renewal (issue 30, defect 9): the gateway follows its mounted TLS Secret and token file.

The kubelet updates a mounted Secret in place: it writes the new files into a fresh timestamped folder and swaps the
volume's `..data` symlink to it atomically (the paths a container reads are symlinks through `..data`). cert-manager
renews a certificate well before it expires; before this fix the gateway read its certificate and tokens once at
start and served the old ones until restarted. The swap is done here the kubelet's way; what only a real cluster
shows is the kubelet's sync delay (up to about a minute plus its cache TTL) before the files change.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import ssl
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minedraft.api import pb, pb_grpc
from minedraft.gateway.app import Gateway, GatewayConfig, TlsFiles
from minedraft.gateway.cli import load_tokens
from tests.component.grpc_helpers import self_signed_cert

pytestmark = pytest.mark.timeout(60)


def kubelet_update(volume: Path, files: dict[str, bytes], version: int) -> None:
    """Write a Secret volume's files as the kubelet does (new folder, atomic `..data` swap, stable symlinks)."""
    folder = volume / f"..2026_12_04_15_{version:02d}_00.000000001"
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    tmp = volume / "..data_tmp"
    tmp.symlink_to(folder.name)
    os.replace(tmp, volume / "..data")
    for name in files:
        if not (volume / name).is_symlink():
            (volume / name).symlink_to(f"..data/{name}")


def pair(tmp_path: Path, name: str) -> dict[str, bytes]:
    folder = tmp_path / name
    folder.mkdir()
    cert, key = self_signed_cert(folder)
    return {"tls.crt": cert.read_bytes(), "tls.key": key.read_bytes()}


def served_certificate(port: int) -> bytes:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock, \
            context.wrap_socket(sock, server_hostname="localhost") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def pem_to_der(pem: bytes) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem.decode())


async def test_renewed_certificate_and_rotated_token_take_effect_without_a_restart(tmp_path: Path) -> None:
    tls_volume, auth_volume = tmp_path / "tls", tmp_path / "auth"
    tls_volume.mkdir()
    auth_volume.mkdir()
    first, second = pair(tmp_path, "a"), pair(tmp_path, "b")
    kubelet_update(tls_volume, first, 1)
    kubelet_update(auth_volume, {"token": b"old-token\n"}, 1)
    tokens = load_tokens(str(auth_volume / "token"), None)
    gateway = Gateway(GatewayConfig(tokens=tokens, tls=TlsFiles(tls_volume / "tls.crt", tls_volume / "tls.key"),
                                    engine_wait_timeout_seconds=0.0))
    port = await gateway.start("127.0.0.1:0")
    http_port = await gateway.start_http("127.0.0.1", 0)
    try:
        assert await asyncio.to_thread(served_certificate, port) == pem_to_der(first["tls.crt"])
        assert await asyncio.to_thread(served_certificate, http_port) == pem_to_der(first["tls.crt"])
        # Renewal and rotation, the kubelet's way.
        kubelet_update(tls_volume, second, 2)
        kubelet_update(auth_volume, {"token": b"new-token\n"}, 2)
        assert await asyncio.to_thread(served_certificate, port) == pem_to_der(second["tls.crt"])
        assert await asyncio.to_thread(served_certificate, http_port) == pem_to_der(second["tls.crt"])
        # A client trusting only the new certificate completes a call; the new token is accepted, the old refused.
        credentials = grpc.ssl_channel_credentials(second["tls.crt"])
        async with grpc.aio.secure_channel(f"localhost:{port}", credentials) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                     timeout=10)
            assert health.status in (health_pb2.HealthCheckResponse.SERVING,
                                     health_pb2.HealthCheckResponse.NOT_SERVING)
            stub = pb_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(max_tokens=1))
            for token, expected in (("old-token", grpc.StatusCode.UNAUTHENTICATED),
                                    ("new-token", grpc.StatusCode.UNAVAILABLE)):  # no engine: past auth
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stub.Generate(request, metadata=(("authorization", f"Bearer {token}"),),
                                                 timeout=10):
                        pass
                assert info.value.code() == expected, token
        ssl_context = ssl.create_default_context(cadata=second["tls.crt"].decode())
        async with aiohttp.ClientSession() as session:
            url = f"https://localhost:{http_port}/v1/models"
            async with session.get(url, ssl=ssl_context, headers={"Authorization": "Bearer old-token"}) as response:
                assert response.status == 401
            async with session.get(url, ssl=ssl_context, headers={"Authorization": "Bearer new-token"}) as response:
                assert response.status != 401
        # A half-written update (a key that is not PEM) keeps the good pair.
        kubelet_update(tls_volume, {"tls.crt": first["tls.crt"], "tls.key": b"garbage"}, 3)
        assert await asyncio.to_thread(served_certificate, port) == pem_to_der(second["tls.crt"])
    finally:
        await gateway.stop()
        shutil.rmtree(tmp_path / "a", ignore_errors=True)
