"""The Generation service over an engine front end (AsyncEngine or EngineProcess): a thin adapter. Checks and
conversions live in convert.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from enum import StrEnum
from typing import Any, NoReturn

import grpc

from minedraft import __version__
from minedraft.api import pb, pb_grpc
from minedraft.api.errors import LEGACY_INVALID_FIELD_KEY, abort_field_error
from minedraft.api.grpc_policy import reject_undecodable
from minedraft.engine import calls
from minedraft.engine.requests import EngineDeadError, RequestError
from minedraft.engine.serving import ServingEngine
from minedraft.server.convert import (
    ModelLimits,
    PreparedRequest,
    chat_renderer,
    check_before_tokenizing,
    max_token_bytes,
    model_info,
    prepare_request,
    response_from_delta,
    token_texts,
)
from minedraft.server.metrics import RequestMetrics

log = logging.getLogger(__name__)

# Deprecated trailer naming the invalid field (kept for 0.1.x beside the google.rpc.BadRequest: minedraft.api.errors).
INVALID_FIELD_KEY = LEGACY_INVALID_FIELD_KEY


class ServerState(StrEnum):
    LOADING = "loading"
    SERVING = "serving"
    DRAINING = "draining"


async def abort_invalid(context: grpc.aio.ServicerContext, error: RequestError) -> NoReturn:
    await abort_field_error(context, error.field_name, str(error))


def engine_limits(engine: ServingEngine) -> ModelLimits:
    # The same sources encode_prompt checks against, so the checks here and the front end's agree.
    tokenizer = engine.tokenizer
    try:
        longest = max_token_bytes(tokenizer.get_vocab())
    except Exception:  # a tokenizer without a readable vocabulary: the conservative default bound
        log.warning("cannot read the tokenizer's vocabulary; prompts bounded at the default bytes per token")
        return ModelLimits(vocab_size=engine.vocab_size, max_model_len=engine.max_model_len)
    return ModelLimits(vocab_size=engine.vocab_size, max_model_len=engine.max_model_len,
                       max_token_bytes=longest)


class OpenStream:
    """A Generate stream in progress: its engine request (to cut it at the end of a drain) and how far it got."""

    __slots__ = ("cut", "engine_request_id", "tokens_sent")

    def __init__(self, engine_request_id: str) -> None:
        self.engine_request_id = engine_request_id
        self.tokens_sent = 0
        self.cut = False


class EngineService:
    """What the servicer and the server's lifecycle share: the engine (once loaded), state and open streams."""

    def __init__(self, replica_id: str | None = None, served_model_names: tuple[str, ...] = ()) -> None:
        self.replica_id = replica_id or socket.gethostname()
        # The names clients address the model by (the first is its name; the others aliases); empty: the model's
        # path or hub id.
        self.served_model_names = served_model_names
        self.state = ServerState.LOADING
        self.engine: ServingEngine | None = None
        self.limits: ModelLimits | None = None
        self.started_monotonic = time.monotonic()
        self.num_active_streams = 0
        self.open_streams: set[OpenStream] = set()
        # Set whenever no Generate stream is open (drain waits on it).
        self.idle = asyncio.Event()
        self.idle.set()
        # Set by the server when it exports metrics: times and counts every Generate stream.
        self.request_metrics: RequestMetrics | None = None
        # Each token's text alone (the log-probabilities' tokens), from the engine's tokenizer once attached.
        self.token_text: Callable[[int], str] = lambda token_id: ""

    def attach(self, engine: ServingEngine) -> None:
        self.engine = engine
        self.token_text = token_texts(engine.tokenizer)
        self.limits = engine_limits(engine)
        self.state = ServerState.SERVING

    async def cut_all(self) -> None:
        """End every open stream with UNAVAILABLE and its token count (the end of a drain's grace period).

        Each stream's request is aborted in the engine, whose final "abort" delta reaches the stream's own handler,
        which then ends the call with that status. Not by cancelling the handler's task: a cancellation that lands
        while gRPC itself is writing a response (not inside the handler) never reaches the handler, and the caller
        would see only the server's stop ("Cancelling all calls"). A stream whose caller reads nothing is ended by
        that stop, after the drain's last wait."""
        engine = self.engine
        for stream in list(self.open_streams):
            if stream.cut:
                continue
            stream.cut = True
            if engine is not None:
                with contextlib.suppress(EngineDeadError):
                    await engine.abort(stream.engine_request_id)

    def stream_opened(self) -> None:
        self.num_active_streams += 1
        self.idle.clear()

    def stream_closed(self) -> None:
        self.num_active_streams -= 1
        if self.num_active_streams == 0:
            self.idle.set()


def cut_message(service: EngineService, open_stream: OpenStream) -> str:
    """Why a stream cut by the drain ended, and how far it got (both APIs' callers read the same words)."""
    return (f"replica {service.replica_id} shutting down: stream cut at the end of the drain grace period after "
            f"{open_stream.tokens_sent} tokens")


async def abort_cut(context: grpc.aio.ServicerContext, service: EngineService, open_stream: OpenStream) -> None:
    """End a stream cut by the drain with UNAVAILABLE, saying why and how far it got."""
    await context.abort(grpc.StatusCode.UNAVAILABLE, cut_message(service, open_stream))


class GenerationServicer(pb_grpc.GenerationServicer):  # type: ignore[misc]
    def __init__(self, service: EngineService) -> None:
        self._service = service

    async def _serving_engine(self, context: grpc.aio.ServicerContext) -> tuple[ServingEngine, ModelLimits]:
        service = self._service
        if service.state is not ServerState.SERVING or service.engine is None or service.limits is None:
            # UNAVAILABLE: the gateway (or any client) may retry on another replica.
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"replica {service.replica_id} is {service.state.value}")
        assert service.engine is not None and service.limits is not None
        return service.engine, service.limits

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        await reject_undecodable(request, context, "minedraft.v1.GenerateRequest")
        engine, limits = await self._serving_engine(context)
        tokenizer = engine.tokenizer
        try:
            # Cheap checks first, on the loop: they bound what tokenizing may cost. Tokenizing runs in a thread so
            # a long prompt does not stall every other stream and the health service. Nothing reaches the engine
            # until every check has passed.
            check_before_tokenizing(request, limits)
            prepared: PreparedRequest
            if request.prompt or request.messages:
                prepared = await asyncio.to_thread(prepare_request, request, limits,
                                                   lambda text: list(tokenizer.encode(text)),
                                                   chat_renderer(tokenizer))
            else:
                prepared = prepare_request(request, limits, lambda text: [])
        except RequestError as exc:
            await abort_invalid(context, exc)
        # The engine's id is this stream's own, whatever the client sent: ids in flight are not shared between
        # callers (a reused or guessed id can neither fail nor reveal another caller's request). The client's id is
        # what its responses carry.
        engine_request_id = uuid.uuid4().hex
        response_id = prepared.request_id or engine_request_id
        if prepared.request_id:
            log.debug("request %r runs as %s", prepared.request_id, engine_request_id)
        service = self._service
        service.stream_opened()
        open_stream = OpenStream(engine_request_id)
        service.open_streams.add(open_stream)
        cut_off = False
        try:
            stream = engine.generate(prepared.prompt_token_ids, prepared.sampling, engine_request_id)
            if service.request_metrics is not None:
                stream = service.request_metrics.observe(stream, len(prepared.prompt_token_ids))
            # aclosing: a cancelled RPC (client cancel, disconnect, deadline) closes the stream, which aborts the
            # request in the engine.
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for delta in stream:
                    if open_stream.cut and delta.finish_reason == "abort":
                        cut_off = True
                        break  # cut by the drain: the caller hears why below, not a plain "abort"
                    response = response_from_delta(delta, service.token_text)
                    response.request_id = response_id
                    open_stream.tokens_sent += len(delta.token_ids)
                    yield response
            if cut_off:
                await abort_cut(context, service, open_stream)
        except RequestError as exc:
            await abort_invalid(context, exc)
        except EngineDeadError as exc:
            log.error("engine dead: %s", exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"replica {service.replica_id}: the engine is not running")
        finally:
            service.open_streams.discard(open_stream)
            service.stream_closed()

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        await reject_undecodable(request, context, "minedraft.v1.GetModelInfoRequest")
        engine, limits = await self._serving_engine(context)
        info = model_info(engine.settings, limits.vocab_size)
        if self._service.served_model_names:
            info.model = self._service.served_model_names[0]
        return info

    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.GetServerInfoResponse:
        await reject_undecodable(request, context, "minedraft.v1.GetServerInfoRequest")
        service = self._service
        running = waiting = 0
        if service.engine is not None and service.state is ServerState.SERVING:
            with contextlib.suppress(EngineDeadError):
                load: Any = await service.engine.call(calls.load)
                running, waiting = load
        return pb.GetServerInfoResponse(
            version=__version__,
            replica_id=service.replica_id,
            num_running_requests=running,
            num_waiting_requests=waiting,
            num_active_streams=service.num_active_streams,
            uptime_seconds=time.monotonic() - service.started_monotonic,
            state=service.state.value,
            dtype=service.engine.settings.dtype if service.engine is not None else "",
        )
