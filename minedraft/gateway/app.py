"""The gateway process: Generation (routed to engines), grpc.health.v1 and reflection of its own.

Health: SERVING while at least one engine is ready and the gateway is not shutting down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from minedraft.api import SERVICE_NAME, pb_grpc
from minedraft.gateway.discovery import EndpointSliceWatcher, KubernetesApi
from minedraft.gateway.metrics import GatewayMetrics, GatewayStateCollector
from minedraft.gateway.policy import Admission, EndpointSet
from minedraft.gateway.pool import EnginePool
from minedraft.gateway.service import GatewayServicer

log = logging.getLogger(__name__)

SERVER_OPTIONS = (
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
)


def pending_request_options(max_in_flight: int) -> tuple[tuple[str, int], ...]:
    """gRPC core cancels (CANCELLED, before any handler runs) calls arriving while more than 1000 wait to be
    accepted by the application: a burst of 1,500 new streams lost ~3% of them in the benchmark. Admission is the
    gateway's own bound (RESOURCE_EXHAUSTED), so core's queue is sized to it."""
    limit = max(1000, max_in_flight)
    return (("grpc.server.max_pending_requests", limit), ("grpc.server.max_pending_requests_hard_limit", limit))


@dataclass(frozen=True)
class TlsFiles:
    cert_file: Path
    key_file: Path

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_file.read_bytes(), self.cert_file.read_bytes())])


@dataclass(frozen=True)
class GatewayConfig:
    max_in_flight: int = 4096
    max_attempts: int = 3
    tokens: tuple[bytes, ...] = ()
    tls: TlsFiles | None = None
    health_retry_seconds: float = 0.5
    failure_cooldown_seconds: float = 1.0
    seed: int | None = None


class Gateway:
    def __init__(self, config: GatewayConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.endpoints = EndpointSet()
        self.pool = EnginePool(self.endpoints, self._health_changed, config.health_retry_seconds,
                               config.failure_cooldown_seconds)
        self.admission = Admission(config.max_in_flight)
        # Exported when a registry is given (the metrics endpoint's); counted either way.
        self.metrics = GatewayMetrics(registry)
        if registry is not None:
            registry.register(GatewayStateCollector(self.endpoints, self.admission))
        self.servicer = GatewayServicer(self.pool, self.admission, config.tokens, config.max_attempts,
                                        random.Random(config.seed), self.metrics)
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(options=SERVER_OPTIONS + pending_request_options(config.max_in_flight))
        pb_grpc.add_GenerationServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((SERVICE_NAME, "grpc.health.v1.Health", reflection.SERVICE_NAME),
                                            self.server)
        self._tasks: list[asyncio.Task[None]] = []
        self._health_task: asyncio.Task[None] | None = None
        self.port: int | None = None

    def _health_changed(self) -> None:
        # Called from sync code (pool, discovery); the health servicer's setter is async.
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.get_running_loop().create_task(self._publish_health())
        else:
            self._health_task.add_done_callback(lambda _: self._health_changed())

    async def _publish_health(self) -> None:
        if self.servicer.draining:
            return
        # Health, not the short failure cool-down: a cool-down ends without any event to publish it.
        serving = any(endpoint.healthy for endpoint in self.endpoints)
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def start(self, address: str = "127.0.0.1:0") -> int:
        if self.config.tls is not None:
            self.port = self.server.add_secure_port(address, self.config.tls.server_credentials())
        else:
            self.port = self.server.add_insecure_port(address)
        if not self.port:
            raise OSError(f"cannot bind {address}")
        await self._publish_health()
        await self.server.start()
        log.info("gateway on %s (port %d, %s)", address, self.port, "TLS" if self.config.tls else "plaintext")
        return self.port

    def set_engines(self, addresses: Sequence[str] | set[str]) -> None:
        self.pool.update(addresses)

    def watch_kubernetes(self, api: KubernetesApi, namespace: str, service: str, port_name: str | None) -> None:
        watcher = EndpointSliceWatcher(api, namespace, service, port_name, self.set_engines)
        self._tasks.append(asyncio.create_task(watcher.run(), name=f"endpointslices {namespace}/{service}"))

    async def drain(self, grace_seconds: float) -> None:
        """NOT_SERVING, refuse new streams, let open ones finish within the grace period, then stop."""
        self.servicer.draining = True
        await self.health.enter_graceful_shutdown()
        deadline = asyncio.get_running_loop().time() + grace_seconds
        while self.admission.in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        await self.stop()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.server.stop(0)
        await self.pool.close()


async def run_gateway(gateway: Gateway, address: str, grace_seconds: float,
                      stop_event: asyncio.Event | None = None) -> int:
    await gateway.start(address)
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("gateway stopping")
    await gateway.drain(grace_seconds)
    return 0
