"""One engine replica's gRPC server: Generation, grpc.health.v1 and reflection, with a graceful drain.

Lifecycle: start() binds the port with readiness NOT_SERVING (the engine is still loading: Kubernetes keeps the pod
out of its Service, the gateway routes elsewhere); attach(engine) flips it to SERVING; drain() goes NOT_SERVING,
refuses new streams with UNAVAILABLE, lets open streams finish within the grace period, then cuts the rest with
UNAVAILABLE and their token count (which aborts them in the engine) and stops. Liveness ("minedraft.liveness") is
SERVING from the bind to the exit, through loading and draining: it says the event loop answers, and turns
NOT_SERVING only when the engine is gone for good (its process killed or its loop dead), which no wait can mend.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from minedraft.api import SERVICE_NAME, grpc_policy
from minedraft.api.auth import TokenAuthInterceptor
from minedraft.engine import calls
from minedraft.engine.serving import ServingEngine
from minedraft.openai_api.app import CLIENT_STALL_TIMEOUT_S
from minedraft.openai_api.server import HttpServer
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
                 metrics_interval_seconds: float = 1.0, engine_check_interval_seconds: float = 5.0,
                 engine_check_timeout_seconds: float = 30.0,
                 tokens: Callable[[], Sequence[bytes]] | None = None,
                 served_model_names: tuple[str, ...] = (),
                 client_stall_timeout_s: float | None = CLIENT_STALL_TIMEOUT_S) -> None:
        self.service = EngineService(replica_id, served_model_names, client_stall_timeout_s)
        # Accepted bearer tokens (read per call: a rotated Secret takes effect without a restart); None: no auth.
        self.tokens = tokens
        # Readiness includes "the engine loop answers": a no-op run on the engine thread between steps, this often,
        # must come back within the timeout (a loop stuck in a step leaves the event loop, and so health, answering).
        self.engine_check_interval_seconds = engine_check_interval_seconds
        self.engine_check_timeout_seconds = engine_check_timeout_seconds
        self._engine_check_task: asyncio.Task[None] | None = None
        # The engine's metrics go into `registry` (the metrics endpoint's) once an engine is attached.
        self.registry = registry
        self.metrics_interval_seconds = metrics_interval_seconds
        self.exporter: EngineExporter | None = None
        self._metrics_task: asyncio.Task[None] | None = None
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(options=SERVER_OPTIONS,
                                      interceptors=[TokenAuthInterceptor(tokens)] if tokens is not None else None)
        grpc_policy.add_generation_servicer(GenerationServicer(self.service), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        grpc_policy.enable_reflection(self.server, (SERVICE_NAME, "grpc.health.v1.Health"))
        self.port: int | None = None
        self.http: HttpServer | None = None
        self.serving = False

    async def start_http(self, host: str, port: int) -> int:
        """Serve the OpenAI HTTP API too (same engine, checks, drain and metrics); returns the bound port."""
        from minedraft.server.http import engine_http_app

        # HTTP readiness is the gRPC health's ("" service): one meaning, one source.
        self.http = HttpServer(engine_http_app(self.service, lambda: self.serving, self.tokens).app)
        return await self.http.start(host, port)

    async def _set_health(self, status: int) -> None:
        self.serving = status == health_pb2.HealthCheckResponse.SERVING
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

    async def attach(self, engine: ServingEngine) -> None:
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
        self._engine_check_task = asyncio.create_task(self._check_engine_loop(engine), name="engine loop check")
        log.info("serving %s (%s, %s)", engine.settings.model, engine.settings.mode.value, engine.settings.dtype)

    async def _check_engine_loop(self, engine: ServingEngine) -> None:
        """Readiness follows the engine loop: NOT_SERVING while it does not answer (stuck, or dead), SERVING again
        once it does. The probe is never cancelled (the engine thread would find its future cancelled): a slow one
        is waited for again at the next check."""
        answering = True
        probe: asyncio.Task[object] | None = None
        while self.service.state is ServerState.SERVING:
            await asyncio.sleep(self.engine_check_interval_seconds)
            if probe is None or probe.done():
                probe = asyncio.ensure_future(engine.call(calls.noop))
            try:
                await asyncio.wait_for(asyncio.shield(probe), self.engine_check_timeout_seconds)
                alive = True
            except TimeoutError:
                alive = False
            except Exception as exc:  # EngineDeadError: the loop is gone for good
                log.error("engine loop is not running: %s", exc)
                alive = False
            if self.service.state is not ServerState.SERVING:
                return
            if engine.dead_error is not None:
                # Gone for good (the engine process was killed, e.g. by the kernel's OOM killer, which picks the
                # largest process of the container, or its loop died): this process cannot serve again, and a
                # kubelet restarts a container only when its main process exits or liveness fails.
                log.error("engine is gone for good (%s): liveness NOT_SERVING, for a restart", engine.dead_error)
                await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
                await self.health.set(grpc_policy.LIVENESS_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
                return
            if alive != answering:
                answering = alive
                log.warning("engine loop %s", "answers again: ready" if alive else
                            f"did not answer within {self.engine_check_timeout_seconds:g} s: not ready")
                await self._set_health(health_pb2.HealthCheckResponse.SERVING if alive
                                       else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def drain(self, grace_seconds: float) -> None:
        """Stop admitting, let open streams finish for up to grace_seconds, cancel the rest, stop the server."""
        self.service.state = ServerState.DRAINING
        await self._stop_engine_check()
        # Readiness only (not enter_graceful_shutdown, which also turns liveness off and freezes every status).
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        open_streams = self.service.num_active_streams
        log.info("draining: %d open streams, grace %.1fs", open_streams, grace_seconds)
        try:
            await asyncio.wait_for(self.service.idle.wait(), grace_seconds)
        except TimeoutError:
            log.warning("grace period over: cutting %d streams", self.service.num_active_streams)
            await self.service.cut_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.service.idle.wait(), 2.0)
        # grace=0: whatever is still open is cancelled now; the servicer's stream closes and aborts it in the engine.
        await self.server.stop(0)
        if self.http is not None:
            await self.http.stop()

    async def _stop_engine_check(self) -> None:
        if self._engine_check_task is not None:
            self._engine_check_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._engine_check_task
            self._engine_check_task = None

    async def stop(self) -> None:
        await self.server.stop(0)
        if self.http is not None:
            await self.http.stop()
        await self._stop_engine_check()
        if self._metrics_task is not None:
            self._metrics_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._metrics_task


async def serve(
    engine_factory: Callable[[], Coroutine[Any, Any, ServingEngine]],
    grpc_address: str,
    grace_seconds: float,
    replica_id: str | None = None,
    stop_event: asyncio.Event | None = None,
    on_started: Callable[[int], None] | None = None,
    registry: CollectorRegistry | None = None,
    http_address: tuple[str, int] | None = None,
    tokens: Callable[[], Sequence[bytes]] | None = None,
    served_model_names: tuple[str, ...] = (),
    client_stall_timeout_s: float | None = CLIENT_STALL_TIMEOUT_S,
) -> int:
    """Run a replica until SIGTERM/SIGINT (or stop_event): bind, load the engine, serve, drain, shut the engine down."""
    server = EngineServer(replica_id, registry, tokens=tokens, served_model_names=served_model_names,
                          client_stall_timeout_s=client_stall_timeout_s)
    port = await server.start(grpc_address)
    if http_address is not None:
        await server.start_http(*http_address)
    if on_started is not None:
        on_started(port)
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    load = asyncio.create_task(engine_factory())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({load, stopping}, return_when=asyncio.FIRST_COMPLETED)
    engine: ServingEngine | None = None
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
