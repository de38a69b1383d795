"""The engine server's OpenAI HTTP API: the shared front end (minedraft.openai_api) over this replica's engine.

Requests go through the same checks as the gRPC API's (convert.prepare_request) and are counted in the same stream
bookkeeping (drain waits for them) and metrics (protocol="http").
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

import grpc

from minedraft.api import pb
from minedraft.api.auth import bearer_token, token_accepted
from minedraft.engine.requests import EngineDeadError, RequestError
from minedraft.openai_api.app import BackendError, OpenAiApp
from minedraft.openai_api.protocol import ApiError
from minedraft.server.convert import chat_renderer, check_before_tokenizing, prepare_request, response_from_delta
from minedraft.server.servicer import EngineService, OpenStream, ServerState, cut_message


class EngineBackend:
    error_types: tuple[type[Exception], ...] = (BackendError,)

    def __init__(self, service: EngineService, serving: Callable[[], bool],
                 tokens: Callable[[], Sequence[bytes]] | None = None) -> None:
        self.service = service
        self.serving = serving
        self.tokens = tokens

    def backend_error(self, error: Exception) -> BackendError:
        assert isinstance(error, BackendError)
        return error

    def live(self) -> bool:
        # As gRPC liveness: false once the engine is gone for good (its process killed, its loop dead), so a kubelet
        # probing over HTTP restarts the container too.
        engine = self.service.engine
        return engine is None or engine.dead_error is None

    def refused(self, error: ApiError) -> None:
        pass  # the engine's request metrics count admitted requests only (as on its gRPC side)

    def ready(self) -> bool:
        # The server's readiness (loaded, engine loop answering, not draining), as its gRPC health reports it.
        return self.serving()

    def authorize(self, authorization: str | None, stream: bool) -> bool:
        # With tokens (`serve --token-file`, set by the operator when the gateway has auth on), the same check as the
        # gRPC port's: a NetworkPolicy alone does not keep other pods off an engine where it is not enforced.
        if self.tokens is None:
            return True
        return token_accepted(bearer_token((("authorization", authorization or ""),)), self.tokens())

    async def model_ids(self) -> list[str]:
        engine = self.service.engine
        if engine is None:
            raise BackendError(grpc.StatusCode.UNAVAILABLE, f"replica {self.service.replica_id} is loading")
        return list(self.service.served_model_names) or [engine.settings.model]

    def known_model_ids(self) -> list[str]| None:
        engine = self.service.engine
        return None if engine is None else list(self.service.served_model_names) or [engine.settings.model]

    def max_streams(self) -> int | None:
        return None  # the engine queues what its batch cannot take yet

    async def generate(self, request: pb.GenerateRequest, headers: Mapping[str, str], protocol: str,
                       timeout_seconds: float | None) -> AsyncIterator[pb.GenerateResponse]:
        service = self.service
        loop = asyncio.get_running_loop()
        deadline = None if timeout_seconds is None else loop.time() + timeout_seconds
        engine, limits = service.engine, service.limits
        if service.state is not ServerState.SERVING or engine is None or limits is None:
            raise BackendError(grpc.StatusCode.UNAVAILABLE,
                               f"replica {service.replica_id} is {service.state.value}")
        tokenizer = engine.tokenizer
        try:
            # As on the gRPC side: the cheap bounds on the loop, tokenizing (or rendering the chat) in a thread.
            check_before_tokenizing(request, limits)
            prepared = await asyncio.to_thread(prepare_request, request, limits,
                                               lambda text: list(tokenizer.encode(text)), chat_renderer(tokenizer))
        except RequestError as exc:
            raise BackendError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.field_name) from exc
        # The drain cuts a stream still open at the end of its grace period by aborting its request in the engine
        # (as the gRPC side's): the final "abort" delta ends it here with UNAVAILABLE, saying why and how far it got
        # (an error event and [DONE], or a 503), rather than the HTTP server's stop closing the connection bare.
        engine_request_id = prepared.request_id or uuid.uuid4().hex
        open_stream = OpenStream(engine_request_id)
        service.stream_opened()
        service.open_streams.add(open_stream)
        try:
            stream = engine.generate(prepared.prompt_token_ids, prepared.sampling, engine_request_id)
            if service.request_metrics is not None:
                stream = service.request_metrics.observe(stream, len(prepared.prompt_token_ids), protocol)
            # Closing this generator (the client went away) closes the engine stream, which aborts the request.
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                if deadline is None:
                    async for delta in stream:
                        if open_stream.cut and delta.finish_reason == "abort":
                            raise BackendError(grpc.StatusCode.UNAVAILABLE, cut_message(service, open_stream))
                        open_stream.tokens_sent += len(delta.token_ids)
                        yield response_from_delta(delta, service.token_text)
                    return
                # Each wait bounded by what is left (a timeout around the yields would cancel the consumer instead).
                while True:
                    try:
                        delta = await asyncio.wait_for(anext(stream), max(0.0, deadline - loop.time()))
                    except StopAsyncIteration:
                        return
                    except TimeoutError:
                        raise BackendError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                           f"deadline exceeded after {open_stream.tokens_sent} tokens") from None
                    if open_stream.cut and delta.finish_reason == "abort":
                        raise BackendError(grpc.StatusCode.UNAVAILABLE, cut_message(service, open_stream))
                    open_stream.tokens_sent += len(delta.token_ids)
                    yield response_from_delta(delta, service.token_text)
        except RequestError as exc:
            raise BackendError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.field_name) from exc
        except EngineDeadError as exc:
            raise BackendError(grpc.StatusCode.UNAVAILABLE, f"replica {service.replica_id}: {exc}") from exc
        finally:
            service.open_streams.discard(open_stream)
            service.stream_closed()


def engine_http_app(service: EngineService, serving: Callable[[], bool],
                    tokens: Callable[[], Sequence[bytes]] | None = None) -> OpenAiApp:
    return OpenAiApp(EngineBackend(service, serving, tokens), service.client_stall_timeout_s)
