"""Channels to the engines and their health: one channel per engine, its grpc.health.v1 status watched."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minedraft.api import SERVICE_NAME, pb, pb_grpc
from minedraft.api.auth import client_interceptors
from minedraft.api.grpc_policy import CHANNEL_OPTIONS
from minedraft.gateway.policy import EndpointSet

log = logging.getLogger(__name__)

# Backpressure: a stream's gRPC flow-control window bounds what the gateway holds for a caller that stopped reading
# (the router reads the next response only once the caller took the last). gRPC's bandwidth-delay probing grows
# that window to megabytes per stream (measured: ~4 MiB more per stalled stream); fixed at gRPC's 64 KiB, the
# engine's writes block instead.
ENGINE_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (*CHANNEL_OPTIONS, ("grpc.http2.bdp_probe", 0))

# A health check of an engine taken out of rotation for a stalled call: how long one check may take.
UNRESPONSIVE_PROBE_TIMEOUT_SECONDS = 1.0


# A removed engine's channel stays open this long so streams still running on it can finish.
RETIRED_CHANNEL_GRACE_SECONDS = 120.0


async def _close_later(channel: grpc.aio.Channel, delay_seconds: float) -> None:
    await asyncio.sleep(delay_seconds)
    await channel.close()


class _Engine:
    def __init__(self, address: str, tokens: Sequence[Callable[[], str]] = ()) -> None:
        self.address = address
        # The gateway's credentials, in the order they are offered; this engine is presented tokens[credential]
        # (the first until it refuses one: during an upgrade, an engine of the previous release accepts only the
        # credential that release's gateway presented).
        self.tokens = tuple(tokens)
        self.credential = 0
        # With engines that authenticate callers, every call presents the gateway's credential.
        self.channel = grpc.aio.insecure_channel(address, options=ENGINE_CHANNEL_OPTIONS,
                                                 interceptors=client_interceptors(self._token) if tokens else None)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health_task: asyncio.Task[None] | None = None
        self.probe_task: asyncio.Task[None] | None = None
        self.credential_task: asyncio.Task[None] | None = None

    def _token(self) -> str:
        return self.tokens[self.credential]()

    def offer_next_credential(self) -> None:
        """The engine refused the credential it was presented: present the next one (round the list: a token
        rotated on one side only comes back to the first)."""
        self.credential = (self.credential + 1) % max(1, len(self.tokens))

    def cancel_tasks(self) -> None:
        for task in (self.health_task, self.probe_task, self.credential_task):
            if task is not None:
                task.cancel()


class EnginePool:
    def __init__(self, endpoints: EndpointSet, on_health_change: Callable[[], None],
                 health_retry_seconds: float = 0.5, failure_cooldown_seconds: float = 1.0,
                 engine_tokens: Sequence[Callable[[], str]] = ()) -> None:
        self.endpoints = endpoints
        self.engine_tokens = tuple(engine_tokens)
        self._engines: dict[str, _Engine] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._on_health_change = on_health_change
        self.health_retry_seconds = health_retry_seconds
        self.failure_cooldown_seconds = failure_cooldown_seconds

    def update(self, addresses: Iterable[str]) -> tuple[set[str], set[str]]:
        """Track exactly these engines: open channels and health watches for new ones, close removed ones. Returns
        the addresses added and removed."""
        added, removed = self.endpoints.replace(addresses)
        for address in removed:
            engine = self._engines.pop(address)
            engine.cancel_tasks()
            # Streams still open on it finish (or fail) on their own; close the channel once they had a chance.
            closing = asyncio.create_task(_close_later(engine.channel, RETIRED_CHANNEL_GRACE_SECONDS))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        for address in added:
            engine = _Engine(address, self.engine_tokens)
            engine.health_task = asyncio.create_task(self._watch_health(engine), name=f"health {address}")
            self._engines[address] = engine
            if len(self.engine_tokens) > 1:
                # Several credentials (an upgrade: engines of the previous release accept another): which one this
                # engine takes is found before it is routed to, so no caller's stream meets a refusal for it.
                self.endpoints.set_credential_refused(address, True)
                engine.credential_task = asyncio.create_task(self._probe_credential(engine, refused=False),
                                                             name=f"credential {address}")
        if added or removed:
            log.info("engines: %s (added %s, removed %s)", self.endpoints.addresses, sorted(added), sorted(removed))
            self._on_health_change()
        return added, removed

    def stub(self, address: str) -> pb_grpc.GenerationStub | None:
        engine = self._engines.get(address)
        return engine.stub if engine is not None else None

    def report_failure(self, address: str) -> None:
        """A call to this engine failed as an engine failure: keep it out of routing for a moment."""
        self.endpoints.cool_down(address, time.monotonic() + self.failure_cooldown_seconds)

    def report_unresponsive(self, address: str) -> None:
        """A call to this engine stalled: out of routing until a health check (with a timeout) answers SERVING.

        The health watch cannot tell: a frozen process's watch stream just stays silent."""
        engine = self._engines.get(address)
        if engine is None:
            return
        self.endpoints.set_unresponsive(address, True)
        self._on_health_change()
        if engine.probe_task is None or engine.probe_task.done():
            engine.probe_task = asyncio.create_task(self._probe_until_answered(engine), name=f"probe {address}")

    def report_credential_refused(self, address: str) -> None:
        """A call to this engine was refused as UNAUTHENTICATED: the gateway's own credential (--engine-token-file)
        is not one the engine accepts. Out of routing until an authenticated call succeeds (checked every
        health_retry_seconds: a rotated token file on either side brings it back)."""
        engine = self._engines.get(address)
        endpoint = self.endpoints.get(address)
        if engine is None or endpoint is None:
            return
        if not endpoint.credential_refused and len(engine.tokens) > 1:
            log.warning("engine %s refused the gateway's credential %d of %d (UNAUTHENTICATED): out of rotation "
                        "while the next is offered", address, engine.credential + 1, len(engine.tokens))
        elif not endpoint.credential_refused:
            log.error("engine %s refused the gateway's credential (UNAUTHENTICATED): out of rotation until it accepts "
                      "it; check --engine-token-file against the engine's --token-file", address)
        self.endpoints.set_credential_refused(address, True)
        self._on_health_change()
        if engine.credential_task is None or engine.credential_task.done():
            engine.credential_task = asyncio.create_task(self._probe_credential(engine), name=f"credential {address}")

    async def _probe_credential(self, engine: _Engine, refused: bool = True) -> None:
        """Keep the engine out of rotation until a call with one of the credentials passes its check. `refused`: the
        call that brought it here was refused the credential it presented (else: a new engine, not yet tried)."""
        was_refused, wait = refused, refused
        while True:
            if refused:
                # With several credentials (--engine-token-file repeated), the next one is tried.
                engine.offer_next_credential()
            if wait:
                await asyncio.sleep(self.health_retry_seconds)
            wait = True
            try:
                # The cheapest call that needs the credential (health does not).
                await engine.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=UNRESPONSIVE_PROBE_TIMEOUT_SECONDS)
                break
            except grpc.aio.AioRpcError as exc:
                # UNAUTHENTICATED: still refused; UNAVAILABLE or DEADLINE_EXCEEDED (a frozen engine): nothing shows
                # that the credential passes, so it stays out. Any other answer came from past the auth check.
                if exc.code() not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE,
                                      grpc.StatusCode.DEADLINE_EXCEEDED):
                    break
                refused = exc.code() is grpc.StatusCode.UNAUTHENTICATED
                was_refused |= refused
                log.debug("credential probe of %s: %s", engine.address, exc.code())
        self.endpoints.set_credential_refused(engine.address, False)
        if was_refused:
            log.warning("engine %s accepts the gateway's credential %d of %d (--engine-token-file): in rotation",
                        engine.address, engine.credential + 1, max(1, len(engine.tokens)))
        self._on_health_change()

    async def _probe_until_answered(self, engine: _Engine) -> None:
        stub = health_pb2_grpc.HealthStub(engine.channel)
        while True:
            try:
                response = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                            timeout=UNRESPONSIVE_PROBE_TIMEOUT_SECONDS)
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.aio.AioRpcError as exc:
                log.debug("probe of %s: %s", engine.address, exc.code())
            await asyncio.sleep(self.health_retry_seconds)
        self.endpoints.set_unresponsive(engine.address, False)
        log.info("engine %s answers again: back in rotation", engine.address)
        self._on_health_change()

    def _set_healthy(self, address: str, healthy: bool) -> None:
        endpoint = self.endpoints.get(address)
        if endpoint is not None and endpoint.healthy != healthy:
            self.endpoints.set_healthy(address, healthy)
            log.info("engine %s %s", address, "ready" if healthy else "not ready")
            self._on_health_change()

    async def _watch_health(self, engine: _Engine) -> None:
        """Follow Health.Watch (a stream: NOT_SERVING arrives the moment a replica starts draining); reconnect on
        any break, counting the engine unready meanwhile."""
        stub = health_pb2_grpc.HealthStub(engine.channel)
        while True:
            try:
                call = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
                async for response in call:
                    self._set_healthy(engine.address, response.status == health_pb2.HealthCheckResponse.SERVING)
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                log.debug("health watch of %s: %s", engine.address, exc.code())
            self._set_healthy(engine.address, False)
            await asyncio.sleep(self.health_retry_seconds)

    async def close(self) -> None:
        engines = list(self._engines.values())
        self._engines.clear()
        for engine in engines:
            engine.cancel_tasks()
            for task in (engine.health_task, engine.probe_task, engine.credential_task):
                if task is not None:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await engine.channel.close()
        for closing in list(self._closing):
            closing.cancel()
