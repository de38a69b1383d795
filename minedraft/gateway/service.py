"""The gateway's Generation service: authenticate, admit, route, forward; retry only before the first response."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, NoReturn, TypeVar

import grpc

from minedraft.api import pb, pb_grpc
from minedraft.gateway.metrics import GatewayMetrics
from minedraft.gateway.policy import Admission, FailureAction, bearer_token, classify_failure, pick, token_accepted
from minedraft.gateway.pool import EnginePool

log = logging.getLogger(__name__)

T = TypeVar("T")

# Metadata that belongs to this hop (transport, auth) and is not forwarded to engines.
_HOP_METADATA = frozenset({"authorization", "user-agent", "content-type", "te", "grpc-accept-encoding",
                           "grpc-encoding", "grpc-timeout"})


def forwarded_metadata(metadata: Sequence[tuple[str, Any]] | None) -> tuple[tuple[str, Any], ...]:
    return tuple((k, v) for k, v in (metadata or ()) if k.lower() not in _HOP_METADATA and not k.startswith(":"))


def trailing_metadata_of(error: grpc.aio.AioRpcError) -> tuple[tuple[str, Any], ...]:
    return tuple((k, v) for k, v in (error.trailing_metadata() or ()) if not k.startswith("grpc-"))


class GatewayServicer(pb_grpc.GenerationServicer):  # type: ignore[misc]
    def __init__(self, pool: EnginePool, admission: Admission, tokens: Sequence[bytes] = (),
                 max_attempts: int = 3, rng: random.Random | None = None,
                 metrics: GatewayMetrics | None = None) -> None:
        self.pool = pool
        self.metrics = metrics or GatewayMetrics()
        self.admission = admission
        self.tokens = tuple(tokens)
        self.max_attempts = max_attempts
        self.rng = rng or random.Random()
        self.draining = False

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if self.tokens and not token_accepted(bearer_token(context.invocation_metadata() or ()), self.tokens):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid bearer token is required")

    def _next_engine(self, tried: set[str]) -> tuple[str, pb_grpc.GenerationStub] | None:
        """The next engine to try (least loaded of those not tried yet), added to `tried`; None when the attempts
        are used up or no ready engine is left."""
        if len(tried) >= self.max_attempts:
            return None
        endpoint = pick(self.pool.endpoints, self.rng, time.monotonic(), exclude=tried)
        stub = self.pool.stub(endpoint.address) if endpoint is not None else None
        if endpoint is None or stub is None:
            return None
        tried.add(endpoint.address)
        return endpoint.address, stub

    async def _no_engine(self, context: grpc.aio.ServicerContext, last: grpc.aio.AioRpcError | None,
                         attempts: int) -> NoReturn:
        detail = f"; last error: {last.code().name}: {last.details()}" if last is not None else ""
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"no ready engine after {attempts} attempt(s){detail}")
        raise AssertionError("unreachable")

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        # One generator with the metrics as a context manager, not generators wrapping generators: the inner loop
        # runs once per forwarded token, and each layer would add to every token's latency.
        with self.metrics.stream(context) as observed:
            arrived = time.perf_counter()
            await self._authorize(context)
            if self.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "gateway is shutting down")
            if not self.admission.try_acquire():
                self.metrics.admission_rejected()
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"gateway at its limit of {self.admission.max_in_flight} streams in flight")
            try:
                metadata = forwarded_metadata(context.invocation_metadata())
                tried: set[str] = set()
                responses_sent = tokens_sent = 0
                last_error: grpc.aio.AioRpcError | None = None
                while (engine := self._next_engine(tried)) is not None:
                    address, stub = engine
                    self.pool.endpoints.acquire(address)
                    # The caller's deadline travels on: the engine stops work the caller can no longer use.
                    call = stub.Generate(request, timeout=context.time_remaining(), metadata=metadata)
                    self.metrics.engine_called(time.perf_counter() - arrived, len(tried))
                    try:
                        async for response in call:
                            if not responses_sent:
                                observed.responded()
                            responses_sent += 1
                            tokens_sent += len(response.token_ids)
                            yield response
                        return
                    except grpc.aio.AioRpcError as exc:
                        action = classify_failure(exc.code(), responses_sent)
                        if action is FailureAction.PASS_THROUGH:
                            await context.abort(exc.code(), exc.details() or "", trailing_metadata_of(exc))
                        self.pool.report_failure(address)
                        if action is FailureAction.UNAVAILABLE_AFTER_TOKENS:
                            # Never a silent truncation: the caller learns the stream broke and how far it got.
                            await context.abort(
                                grpc.StatusCode.UNAVAILABLE,
                                f"engine {address} failed after {tokens_sent} tokens delivered ({exc.code().name}: "
                                f"{exc.details()}); not retried because tokens were already streamed")
                        log.info("engine %s failed before the first token (%s): trying another", address,
                                 exc.code().name)
                        last_error = exc
                    finally:
                        # A no-op when the call ended; when the caller went away (cancel, deadline), cancels upstream.
                        call.cancel()
                        self.pool.endpoints.release(address)
                await self._no_engine(context, last_error, len(tried))
            finally:
                self.admission.release()

    async def _unary(self, context: grpc.aio.ServicerContext,
                     invoke: Callable[[pb_grpc.GenerationStub, float | None], Awaitable[T]]) -> T:
        await self._authorize(context)
        tried: set[str] = set()
        last_error: grpc.aio.AioRpcError | None = None
        while (engine := self._next_engine(tried)) is not None:
            address, stub = engine
            try:
                return await invoke(stub, context.time_remaining())
            except grpc.aio.AioRpcError as exc:
                if classify_failure(exc.code(), 0) is not FailureAction.RETRY:
                    await context.abort(exc.code(), exc.details() or "", trailing_metadata_of(exc))
                self.pool.report_failure(address)
                last_error = exc
        await self._no_engine(context, last_error, len(tried))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        return await self._unary(context, lambda stub, timeout: stub.GetModelInfo(request, timeout=timeout))

    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.GetServerInfoResponse:
        # One engine's answer (the gateway routes; it has no load of its own to report).
        return await self._unary(context, lambda stub, timeout: stub.GetServerInfo(request, timeout=timeout))
