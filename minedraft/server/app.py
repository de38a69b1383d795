"""One engine replica's gRPC server: Generation, grpc.health.v1 and reflection, with a graceful drain.

Lifecycle: start() binds the port with readiness NOT_SERVING (the engine is still loading: Kubernetes keeps the pod
out of its Service, the gateway routes elsewhere); attach(engine) flips it to SERVING; drain() goes NOT_SERVING,
refuses new streams with UNAVAILABLE, lets open streams finish within the grace period, then cuts the rest with
UNAVAILABLE and their token count (which aborts them in the engine) and stops. Liveness ("minedraft.liveness") is
SERVING from the bind to the exit, through loading and draining: it only says the event loop answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from minedraft.api import SERVICE_NAME, grpc_policy
from minedraft.engine.async_engine import AsyncEngine
from minedraft.server.metrics import EngineExporter
from minedraft.server.servicer import EngineService, GenerationServicer, ServerState

log = logging.getLogger(__name__)

# Streams are long and mostly idle between tokens: let clients keep connections alive without being told off.
SERVER_OPTIONS = (
    *grpc_policy.SERVER_OPTIONS,
    # gRPC core cancels calls that arrive while more than 1000 wait for the application (a burst through the
    # gateway); the engine's own queue (vLLM's waiting list) is the place where requests wait.
    ("grpc.server.max_pending_requests", 8192),
    ("grpc.server.max_pending_requests_hard_limit", 8192),
)


class EngineServer:
    def __init__(self, replica_id: str | None = None, registry: CollectorRegistry | None = None,
                 metrics_interval_seconds: float = 1.0) -> None:
        self.service = EngineService(replica_id)
        # The engine's metrics go into `registry` (the metrics endpoint's) once an engine is attached.
        self.registry = registry
        self.metrics_interval_seconds = metrics_interval_seconds
        self.exporter: EngineExporter | None = None
        self._metrics_task: asyncio.Task[None] | None = None
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(options=SERVER_OPTIONS)
        grpc_policy.add_generation_servicer(GenerationServicer(self.service), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        grpc_policy.enable_reflection(self.server, (SERVICE_NAME, "grpc.health.v1.Health"))
        self.port: int | None = None

    async def _set_health(self, status: int) -> None:
        # "" is the whole server (what Kubernetes' grpc probe asks by default); the service name for per-service checks.
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def start(self, address: str = "127.0.0.1:0") -> int:
        """Bind and start serving (NOT_SERVING until attach); returns the bound port."""
        self.port = self.server.add_insecure_port(address)
        if not self.port:
            raise OSError(f"cannot bind {address}")
        await self.health.set(grpc_policy.LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        log.info("gRPC server on %s (port %d), loading", address, self.port)
        return self.port

    async def attach(self, engine: AsyncEngine) -> None:
        """The engine is ready: start admitting requests."""
        self.service.attach(engine)
        if self.registry is not None and self.exporter is None:
            settings = engine.settings
            self.exporter = EngineExporter(self.registry, settings.model, settings.max_draft_tokens_per_request,
                                           self.metrics_interval_seconds)
            await self.exporter.start(engine)
            self.service.request_metrics = self.exporter.requests
            self._metrics_task = asyncio.create_task(self.exporter.run(engine), name="engine metrics")
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s (%s)", engine.settings.model, engine.settings.mode.value)

    async def drain(self, grace_seconds: float) -> None:
        """Stop admitting, let open streams finish for up to grace_seconds, cancel the rest, stop the server."""
        self.service.state = ServerState.DRAINING
        # Readiness only (not enter_graceful_shutdown, which also turns liveness off and freezes every status).
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        open_streams = self.service.num_active_streams
        log.info("draining: %d open streams, grace %.1fs", open_streams, grace_seconds)
        try:
            await asyncio.wait_for(self.service.idle.wait(), grace_seconds)
        except TimeoutError:
            log.warning("grace period over: cutting %d streams", self.service.num_active_streams)
            self.service.cut_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.service.idle.wait(), 2.0)
        # grace=0: whatever is still open is cancelled now; the servicer's stream closes and aborts it in the engine.
        await self.server.stop(0)

    async def stop(self) -> None:
        await self.server.stop(0)
        if self._metrics_task is not None:
            self._metrics_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._metrics_task


async def serve(
    engine_factory: Callable[[], Coroutine[Any, Any, AsyncEngine]],
    grpc_address: str,
    grace_seconds: float,
    replica_id: str | None = None,
    stop_event: asyncio.Event | None = None,
    on_started: Callable[[int], None] | None = None,
    registry: CollectorRegistry | None = None,
) -> int:
    """Run a replica until SIGTERM/SIGINT (or stop_event): bind, load the engine, serve, drain, shut the engine down."""
    server = EngineServer(replica_id, registry)
    port = await server.start(grpc_address)
    if on_started is not None:
        on_started(port)
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    load = asyncio.create_task(engine_factory())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({load, stopping}, return_when=asyncio.FIRST_COMPLETED)
    engine: AsyncEngine | None = None
    if load.done():
        engine = load.result()  # a failed load raises here: the process exits non-zero
        await server.attach(engine)
        await stopping
    else:
        # Stopped while loading: nothing to drain. Loading runs in a thread that cannot be interrupted; let it finish
        # so the engine's processes are shut down cleanly rather than orphaned.
        with contextlib.suppress(Exception):
            engine = await load
    log.info("stopping")
    await server.drain(grace_seconds)
    if engine is not None:
        await engine.shutdown()
    return 0
