"""The gateway's Generation service: a thin gRPC adapter over the Router (authenticate, then route; RouteError
becomes the call's status)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any, NoReturn

import grpc

from minedraft.api import pb, pb_grpc
from minedraft.api.auth import bearer_token, token_accepted
from minedraft.api.grpc_policy import reject_undecodable
from minedraft.api.stall import StallWatch, end_stalled_call
from minedraft.gateway.router import RouteError, Router

log = logging.getLogger(__name__)


async def abort_with(context: grpc.aio.ServicerContext, error: RouteError) -> NoReturn:
    await context.abort(error.code, error.message, error.trailing_metadata)
    raise AssertionError("unreachable: context.abort raises")


class GatewayServicer(pb_grpc.GenerationServicer):  # type: ignore[misc]
    def __init__(self, router: Router, tokens: Sequence[bytes] = (),
                 client_stall_timeout_s: float | None = None) -> None:
        self.router = router
        self.tokens = tokens  # not copied: a LiveTokens follows its file's rotations
        # A stream whose caller accepts nothing for this long is cut (None: never).
        self.client_stall_timeout_s = client_stall_timeout_s

    async def _authorize(self, context: grpc.aio.ServicerContext, metadata: Sequence[tuple[str, Any]]) -> None:
        if self.tokens and not token_accepted(bearer_token(metadata), self.tokens):
            self.router.metrics.refused(grpc.StatusCode.UNAUTHENTICATED)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid bearer token is required")

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        metadata = context.invocation_metadata() or ()
        await self._authorize(context, metadata)
        await reject_undecodable(request, context, "minedraft.v1.GenerateRequest")
        # Written through the stall watch (not yielded): a caller that stops reading is cut, which closes the
        # router's stream (its admission slot back, its engine call cancelled).
        watch = StallWatch(self.client_stall_timeout_s)
        tokens_sent = 0
        try:
            async with contextlib.aclosing(  # type: ignore[type-var]
                    self.router.generate(request, metadata, context.time_remaining())) as stream:
                async for response in stream:
                    if not await watch.write(context, response):
                        break
                    tokens_sent += len(response.token_ids)
        except RouteError as exc:
            await abort_with(context, exc)
        finally:
            watch.close()
        if watch.expired:
            assert watch.limit_s is not None
            log.warning("gRPC stream cut: the client accepted nothing for %g s", watch.limit_s)
            await end_stalled_call(context, watch.limit_s, tokens_sent)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        await self._authorize(context, context.invocation_metadata() or ())
        await reject_undecodable(request, context, "minedraft.v1.GetModelInfoRequest")
        try:
            return await self.router.unary(lambda stub, timeout: stub.GetModelInfo(request, timeout=timeout),
                                           context.time_remaining())
        except RouteError as exc:
            await abort_with(context, exc)

    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.GetServerInfoResponse:
        # One engine's answer (the gateway routes; it has no load of its own to report).
        await self._authorize(context, context.invocation_metadata() or ())
        await reject_undecodable(request, context, "minedraft.v1.GetServerInfoRequest")
        try:
            return await self.router.unary(lambda stub, timeout: stub.GetServerInfo(request, timeout=timeout),
                                           context.time_remaining())
        except RouteError as exc:
            await abort_with(context, exc)
