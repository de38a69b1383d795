"""The gateway process: Generation (routed to engines), grpc.health.v1 and reflection of its own.

Health: readiness ("" and the Generation service) is SERVING while at least one engine is ready and the gateway is
not shutting down (with ready_without_engines: while it is not shutting down and can hold streams until an engine
is ready, so a Service routes the first request of a deployment at zero engines to it); liveness
("minedraft.liveness") is SERVING from the moment the port is bound until the process exits (at zero engines and
while draining too): it only says the event loop answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from minedraft.api import SERVICE_NAME
from minedraft.api.grpc_policy import LIVENESS_SERVICE, SERVER_OPTIONS, add_generation_servicer, enable_reflection
from minedraft.gateway.discovery import EndpointSliceWatcher, KubernetesApi
from minedraft.gateway.metrics import GatewayMetrics, GatewayStateCollector
from minedraft.gateway.policy import Admission, EndpointSet
from minedraft.gateway.pool import EnginePool
from minedraft.gateway.router import Router, RouterConfig
from minedraft.gateway.service import GatewayServicer
from minedraft.openai_api.server import HttpServer

log = logging.getLogger(__name__)


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
        """Credentials that follow the files: gRPC asks before each handshake, and a changed certificate or key (the
        kubelet updates a mounted Secret in place, cert-manager renews before expiry) is served from the next
        connection on, without a restart. A pair that cannot be read or is not PEM keeps the previous one (mid-swap).
        Raises ValueError naming the file when the first read fails (gRPC itself says only "Failed to bind")."""
        from minedraft.api.auth import files_signature

        signature = files_signature(self.cert_file, self.key_file)
        initial = self.certificate_configuration()

        def fetch() -> Any:
            nonlocal signature
            now = files_signature(self.cert_file, self.key_file)
            if now is None or now == signature:
                return None
            try:
                config = self.certificate_configuration()
            except ValueError as exc:
                log.warning("TLS files changed but do not load (keeping the previous pair): %s", exc)
                return None
            signature = now
            log.info("TLS certificate reloaded from %s", self.cert_file)
            return config

        return grpc.dynamic_ssl_server_credentials(initial, fetch)

    def certificate_configuration(self) -> Any:
        """The current pair; raises ValueError naming the file that cannot be read or is not PEM."""
        pems = []
        for flag, path, marker in (("tls-key", self.key_file, b"PRIVATE KEY-----"),
                                   ("tls-cert", self.cert_file, b"-----BEGIN CERTIFICATE-----")):
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise ValueError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
            if marker not in data:
                raise ValueError(f"{flag}: {path} holds no PEM {'private key' if flag == 'tls-key' else 'certificate'}")
            pems.append(data)
        return grpc.ssl_server_certificate_configuration([(pems[0], pems[1])])


@dataclass(frozen=True)
class GatewayConfig:
    max_in_flight: int = 4096
    max_attempts: int = 3
    tokens: Sequence[bytes] = ()
    tls: TlsFiles | None = None
    health_retry_seconds: float = 0.5
    failure_cooldown_seconds: float = 1.0
    seed: int | None = None
    first_response_timeout_seconds: float | None = 60.0
    idle_timeout_seconds: float | None = 30.0
    engine_wait_timeout_seconds: float = 300.0
    max_waiting_streams: int = 1024
    # Ready at zero engines too (streams wait for one): for deployments that scale engines to zero, whose first
    # request must reach a gateway through a Service that routes only to ready pods.
    ready_without_engines: bool = False
    # The bearer token presented to engines (read per call: a rotated Secret takes effect); None: engines without auth.
    engine_token: Callable[[], str] | None = None
    # More credentials, offered in order to an engine that refused the one before (engine_token first): during an
    # upgrade, engines of the previous release accept only the credential it presented.
    engine_fallback_tokens: tuple[Callable[[], str], ...] = ()
    # The names clients address the model by (HTTP /v1/models and request matching); empty: the engines' answer.
    served_model_names: tuple[str, ...] = ()
    # An HTTP or gRPC stream whose client accepts nothing for this long is cut (None: never).
    client_stall_timeout_seconds: float | None = 60.0
    # Origins allowed to call the HTTP API from a browser (CORS); empty: CORS off.
    cors_origins: tuple[str, ...] = ()

    def router_config(self) -> RouterConfig:
        return RouterConfig(max_attempts=self.max_attempts,
                            first_response_timeout_seconds=self.first_response_timeout_seconds,
                            idle_timeout_seconds=self.idle_timeout_seconds,
                            engine_wait_timeout_seconds=self.engine_wait_timeout_seconds,
                            max_waiting_streams=self.max_waiting_streams)


class Gateway:
    def __init__(self, config: GatewayConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.endpoints = EndpointSet()
        credentials = (*((config.engine_token,) if config.engine_token else ()), *config.engine_fallback_tokens)
        self.pool = EnginePool(self.endpoints, self._health_changed, config.health_retry_seconds,
                               config.failure_cooldown_seconds, credentials)
        self.admission = Admission(config.max_in_flight)
        # Exported when a registry is given (the metrics endpoint's); counted either way.
        self.metrics = GatewayMetrics(registry)
        self.router = Router(self.pool, self.admission, config.router_config(), random.Random(config.seed),
                             self.metrics)
        if registry is not None:
            registry.register(GatewayStateCollector(self.endpoints, self.admission, lambda: self.router.num_waiting))
        self.servicer = GatewayServicer(self.router, config.tokens, config.client_stall_timeout_seconds)
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(options=SERVER_OPTIONS + pending_request_options(config.max_in_flight))
        add_generation_servicer(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection(self.server, (SERVICE_NAME, "grpc.health.v1.Health"))
        self._tasks: list[asyncio.Task[None]] = []
        self._health_task: asyncio.Task[None] | None = None
        self.port: int | None = None
        self.http: HttpServer | None = None

    async def start_http(self, host: str, port: int) -> int:
        """Serve the OpenAI HTTP API too (same router, admission, tokens and TLS); returns the bound port."""
        from minedraft.gateway.http import gateway_http_app

        tls = self.config.tls
        self.http = HttpServer(gateway_http_app(self.router, self.ready, self.config.tokens,
                                                self.config.served_model_names,
                                                self.config.client_stall_timeout_seconds,
                                                self.config.cors_origins).app,
                               tls.cert_file if tls else None, tls.key_file if tls else None)
        return await self.http.start(host, port)

    def _health_changed(self) -> None:
        # Called from sync code (pool, discovery); the health servicer's setter is async.
        self.router.engines_changed()
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.get_running_loop().create_task(self._publish_health())
        else:
            self._health_task.add_done_callback(lambda _: self._health_changed())

    def ready(self) -> bool:
        """Readiness, one meaning for gRPC health and HTTP /ready: not draining, and an engine to route to (with
        ready_without_engines, or a stream can wait for one)."""
        if self.router.draining:
            return False
        if (self.config.ready_without_engines and self.config.max_waiting_streams > 0
                and self.config.engine_wait_timeout_seconds > 0):
            return True
        # Health, not the short failure cool-down: a cool-down ends without any event to publish it.
        return any(endpoint.routable for endpoint in self.endpoints)

    async def _publish_health(self) -> None:
        if self.router.draining:
            return
        serving = self.ready()
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def start(self, address: str = "127.0.0.1:0") -> int:
        try:
            if self.config.tls is not None:
                self.port = self.server.add_secure_port(address, self.config.tls.server_credentials())
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError as exc:  # gRPC's "Failed to bind to address": in use, or not an address of this host
            raise OSError(f"cannot bind {address} (in use, or not an address of this host)") from exc
        if not self.port:
            raise OSError(f"cannot bind {address} (in use, or not an address of this host)")
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self._publish_health()
        await self.server.start()
        log.info("gateway on %s (port %d, %s)", address, self.port, "TLS" if self.config.tls else "plaintext")
        return self.port

    def set_engines(self, addresses: Sequence[str] | set[str]) -> None:
        _, removed = self.pool.update(addresses)
        for address in removed:
            # Per-engine series live as long as the engine is in the routing table: engine addresses are pod IPs,
            # new with every rollout, and a label set kept for each would grow without bound.
            self.metrics.engine_removed(address)

    def watch_kubernetes(self, api: KubernetesApi, namespace: str, service: str, port_name: str | None) -> None:
        watcher = EndpointSliceWatcher(api, namespace, service, port_name, self.set_engines)
        self._tasks.append(asyncio.create_task(watcher.run(), name=f"endpointslices {namespace}/{service}"))

    async def drain(self, grace_seconds: float) -> None:
        """Readiness NOT_SERVING (liveness stays SERVING), refuse new streams, let open ones finish within the grace
        period, cut the rest with UNAVAILABLE and their token count, then stop."""
        self.router.draining = True
        self.router.engines_changed()  # streams waiting for an engine give up now
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_seconds
        while self.admission.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.admission.in_flight:
            log.warning("drain grace over: cutting %d open streams", self.admission.in_flight)
            self.router.cut_all()
            cut_deadline = loop.time() + 2.0
            while self.admission.in_flight and loop.time() < cut_deadline:
                await asyncio.sleep(0.02)
        await self.stop()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.server.stop(0)
        if self.http is not None:
            await self.http.stop()
        await self.pool.close()


async def run_gateway(gateway: Gateway, address: str, grace_seconds: float,
                      stop_event: asyncio.Event | None = None,
                      on_started: Callable[[int], None] | None = None,
                      http_address: tuple[str, int] | None = None) -> int:
    await gateway.start(address)
    if http_address is not None:
        await gateway.start_http(*http_address)
    if on_started is not None:
        on_started(gateway.port or 0)
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("gateway stopping")
    await gateway.drain(grace_seconds)
    return 0
