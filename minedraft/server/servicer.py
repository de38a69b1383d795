"""The Generation service over an AsyncEngine: a thin adapter. Checks and conversions live in convert.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from enum import StrEnum
from typing import Any, NoReturn

import grpc

from minedraft import __version__
from minedraft.api import pb, pb_grpc
from minedraft.engine.async_engine import AsyncEngine
from minedraft.engine.requests import EngineDeadError, RequestError
from minedraft.server.convert import ModelLimits, model_info, prepare_request, response_from_delta
from minedraft.server.metrics import RequestMetrics

log = logging.getLogger(__name__)

# Trailing metadata key naming the invalid field of an INVALID_ARGUMENT answer (the details string names it too).
INVALID_FIELD_KEY = "minedraft-invalid-field"


class ServerState(StrEnum):
    LOADING = "loading"
    SERVING = "serving"
    DRAINING = "draining"


async def abort_invalid(context: grpc.aio.ServicerContext, error: RequestError) -> NoReturn:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error),
                        trailing_metadata=((INVALID_FIELD_KEY, error.field_name),))
    raise AssertionError("unreachable: context.abort raises")


def engine_vocab_size(engine: AsyncEngine) -> int:
    # The same source encode_prompt checks against, so OOV checks here and in the engine agree.
    return engine.engine.vocab_size


class EngineService:
    """What the servicer and the server's lifecycle share: the engine (once loaded), state and open streams."""

    def __init__(self, replica_id: str | None = None) -> None:
        self.replica_id = replica_id or socket.gethostname()
        self.state = ServerState.LOADING
        self.engine: AsyncEngine | None = None
        self.limits: ModelLimits | None = None
        self.started_monotonic = time.monotonic()
        self.num_active_streams = 0
        # Set whenever no Generate stream is open (drain waits on it).
        self.idle = asyncio.Event()
        self.idle.set()
        # Set by the server when it exports metrics: times and counts every Generate stream.
        self.request_metrics: RequestMetrics | None = None

    def attach(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.limits = ModelLimits(vocab_size=engine_vocab_size(engine), max_model_len=engine.settings.max_model_len)
        self.state = ServerState.SERVING

    def stream_opened(self) -> None:
        self.num_active_streams += 1
        self.idle.clear()

    def stream_closed(self) -> None:
        self.num_active_streams -= 1
        if self.num_active_streams == 0:
            self.idle.set()


class GenerationServicer(pb_grpc.GenerationServicer):  # type: ignore[misc]
    def __init__(self, service: EngineService) -> None:
        self._service = service

    async def _serving_engine(self, context: grpc.aio.ServicerContext) -> tuple[AsyncEngine, ModelLimits]:
        service = self._service
        if service.state is not ServerState.SERVING or service.engine is None or service.limits is None:
            # UNAVAILABLE: the gateway (or any client) may retry on another replica.
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"replica {service.replica_id} is {service.state.value}")
        assert service.engine is not None and service.limits is not None
        return service.engine, service.limits

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        engine, limits = await self._serving_engine(context)
        tokenizer = engine.engine.tokenizer
        try:
            # Tokenizing reads the tokenizer only; nothing reaches the engine until every check has passed.
            prepared = prepare_request(request, limits, lambda text: list(tokenizer.encode(text)))
        except RequestError as exc:
            await abort_invalid(context, exc)
        self._service.stream_opened()
        try:
            stream = engine.generate(prepared.prompt_token_ids, prepared.sampling, prepared.request_id)
            if self._service.request_metrics is not None:
                stream = self._service.request_metrics.observe(stream, len(prepared.prompt_token_ids))
            # aclosing: a cancelled RPC (client cancel, disconnect, deadline) closes the stream, which aborts the
            # request in the engine.
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for delta in stream:
                    yield response_from_delta(delta)
        except RequestError as exc:  # e.g. a request id already in flight
            await abort_invalid(context, exc)
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"replica {self._service.replica_id}: {exc}")
        finally:
            self._service.stream_closed()

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        engine, limits = await self._serving_engine(context)
        return model_info(engine.settings, limits.vocab_size)

    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.GetServerInfoResponse:
        service = self._service
        running = waiting = 0
        if service.engine is not None and service.state is ServerState.SERVING:
            with contextlib.suppress(EngineDeadError):
                load: Any = await service.engine.call(lambda e: e.load())
                running, waiting = load
        return pb.GetServerInfoResponse(
            version=__version__,
            replica_id=service.replica_id,
            num_running_requests=running,
            num_waiting_requests=waiting,
            num_active_streams=service.num_active_streams,
            uptime_seconds=time.monotonic() - service.started_monotonic,
            state=service.state.value,
        )
