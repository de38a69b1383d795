"""Helpers for the API tests: polling with a deadline, a self-signed test certificate, health checks."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minedraft.api import SERVICE_NAME

# Waits end as soon as what they wait for holds, so a generous limit costs a passing test nothing; a short one fails
# tests on a loaded machine for being slow, not for being wrong.
PATIENCE_SECONDS = 60.0


async def wait_for(predicate: Callable[[], bool], timeout_seconds: float = PATIENCE_SECONDS,
                   what: str = "condition") -> None:
    """Poll until predicate() holds; fail with `what` after the timeout (no sleep-and-hope)."""
    deadline = time.monotonic() + timeout_seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_seconds}s waiting for {what}")
        await asyncio.sleep(0.01)


async def health_status(target: str, service: str = SERVICE_NAME,
                        credentials: grpc.ChannelCredentials | None = None, timeout_seconds: float = 5) -> int:
    channel = (grpc.aio.secure_channel(target, credentials) if credentials is not None
               else grpc.aio.insecure_channel(target))
    async with channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_seconds)
        return int(response.status)


async def wait_for_health(target: str, status: int, timeout_seconds: float = PATIENCE_SECONDS) -> None:
    deadline = time.monotonic() + timeout_seconds
    last = None
    while True:
        try:
            last = await health_status(target)
        except grpc.aio.AioRpcError as exc:
            last = exc.code()
        if last == status:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"health of {target} stayed {last}, wanted {status}")
        await asyncio.sleep(0.02)


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A certificate for localhost and 127.0.0.1 and its key: with the `cryptography` package when installed (it is
    no dependency of this project), else with the openssl command."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        return _self_signed_cert_openssl(directory)
    return _self_signed_cert_cryptography(directory)


def _self_signed_cert_openssl(directory: Path) -> tuple[Path, Path]:
    import subprocess

    cert_file, key_file = directory / "tls.crt", directory / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key_file), "-out", str(cert_file), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    return cert_file, key_file


def _self_signed_cert_cryptography(directory: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "tls.crt", directory / "tls.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file
