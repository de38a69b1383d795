"""The OpenAI-compatible HTTP front end (Starlette under uvicorn, the stack vLLM itself serves with).

Thin: every route decodes, calls protocol.py's pure translations and a Backend (the engine server's own engine, or
the gateway's router), and encodes. A backend raises BackendError with a gRPC status code, so both front ends share
one error mapping with the gRPC API. The client going away (a closed connection) cancels the request's task, which
closes the backend's stream: the engine aborts the request, as a cancelled gRPC call does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from minedraft.api import pb
from minedraft.openai_api.protocol import (
    ApiError,
    Kind,
    ParsedRequest,
    ResponseState,
    decode_body,
    encode,
    error_from_status,
    full_response,
    models_list,
    parse_request,
    stream_events,
)

log = logging.getLogger(__name__)

PROTOCOL = "http"
# OpenAI's API has no deadline of its own (SDK timeouts just disconnect); this request header sets one, as a gRPC
# deadline does: past it the request is aborted in the engine and answered 504.
TIMEOUT_HEADER = "minedraft-timeout-seconds"
# The largest request body read (a prompt of a long context is a few hundred KB of JSON).
MAX_BODY_BYTES = 8 * 1024 * 1024


class BackendError(Exception):
    """A request failed behind the front end, with the gRPC status it would have had (and the engine field)."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


class Backend(Protocol):
    """What the HTTP front end needs from the process it runs in."""

    # The exceptions generate() and model_ids() end with (BackendError, or the gateway router's own), and how they
    # read as a BackendError: the stream is the backend's own generator, with no translating layer around it.
    error_types: tuple[type[Exception], ...]

    def backend_error(self, error: Exception) -> BackendError: ...

    def live(self) -> bool: ...

    def refused(self, error: ApiError) -> None:
        """A generation request refused at the HTTP edge (malformed, unsupported, unknown model): for the metrics."""
        ...

    def ready(self) -> bool: ...

    def authorize(self, authorization: str | None, stream: bool) -> bool:
        """Whether the request may proceed; `stream`: a generation request (counted as a stream when refused)."""
        ...

    async def model_ids(self) -> list[str]:
        """The served model ids (GET /v1/models); may wait for an engine."""
        ...

    def known_model_ids(self) -> list[str] | None:
        """The served model ids if known now without waiting (None: do not check the request's model)."""
        ...

    def generate(self, request: pb.GenerateRequest, headers: Mapping[str, str], protocol: str,
                 timeout_seconds: float | None) -> AsyncIterator[pb.GenerateResponse]:
        """The engine's responses for one request; raises one of error_types (DEADLINE_EXCEEDED past
        `timeout_seconds`). Closing it aborts the request."""
        ...


def error_response(error: ApiError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return Response(encode(error.body()), error.status, headers=headers, media_type="application/json")


def _api_error(backend: Backend, exc: Exception, parsed: ParsedRequest | None) -> ApiError:
    error = backend.backend_error(exc)
    return error_from_status(error.code, error.message, error.field, parsed.params if parsed else None)


class _SseResponse(Response):
    """An SSE stream written straight to the ASGI `send` (no per-chunk iterator layers: each layer costs every
    token a few microseconds on the gateway's path). The first response was already received: errors before it
    became plain HTTP errors; an error after it is sent as an OpenAI error event (no [DONE])."""

    def __init__(self, backend: Backend, state: ResponseState, first: pb.GenerateResponse | None,
                 stream: AsyncIterator[pb.GenerateResponse]) -> None:
        self._backend = backend
        # Not Response.__init__: it would add `content-length: 0` for the empty initial body.
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self._state = state
        self._first = first
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        state = self._state
        async with contextlib.aclosing(self._stream):  # type: ignore[type-var]
            try:
                if self._first is not None:
                    await send({"type": "http.response.body", "body": b"".join(stream_events(state, self._first)),
                                "more_body": True})
                async for response in self._stream:
                    await send({"type": "http.response.body", "body": b"".join(stream_events(state, response)),
                                "more_body": True})
            except self._backend.error_types as exc:
                error = _api_error(self._backend, exc, state.parsed)
                await send({"type": "http.response.body", "body": b"data: " + encode(error.body()) + b"\n\n",
                            "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _DisconnectAware:
    """Runs an ASGI response while watching for the client's disconnect: when it goes, the response's task is
    cancelled (closing the backend stream, which aborts the engine request). uvicorn reports a disconnect on
    `receive` once the body has been read; `send` may keep succeeding into a dead socket for a while."""

    def __init__(self, app: Response) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        respond = asyncio.ensure_future(self.app(scope, receive, send))
        watch = asyncio.ensure_future(_until_disconnected(receive))
        try:
            await asyncio.wait({respond, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (respond, watch):
                task.cancel()
            for task in (respond, watch):
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task
        if respond.done() and not respond.cancelled() and respond.exception() is not None:
            raise respond.exception()  # type: ignore[misc]


def _timeout_seconds(request: Request) -> float | None:
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not (seconds > 0 and seconds < float("inf")):  # NaN fails too
        raise ApiError(400, f"{TIMEOUT_HEADER}: must be a positive number of seconds, got {value!r}", TIMEOUT_HEADER)
    return seconds


class OpenAiApp:
    """The routes over one Backend."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.created = int(time.time())
        self.app = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ], exception_handlers={ApiError: self._api_error, 404: self._not_found, 405: self._not_allowed})

    async def _api_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return error_response(ApiError(404, f"no route {request.url.path}", code="not_found"))

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        return error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                                       error_type="invalid_request_error"))

    async def health(self, request: Request) -> Response:
        # Liveness: answered while the process's event loop answers, whatever the engine's state.
        return Response(b'{"status":"ok"}', 200 if self.backend.live() else 503, media_type="application/json")

    async def ready(self, request: Request) -> Response:
        ready = self.backend.ready()
        return Response(b'{"status":"ready"}' if ready else b'{"status":"not ready"}', 200 if ready else 503,
                        media_type="application/json")

    def _authorize(self, request: Request, stream: bool = False) -> None:
        if not self.backend.authorize(request.headers.get("authorization"), stream):
            raise ApiError(401, "a valid bearer token is required (Authorization: Bearer <token>)",
                           code="invalid_api_key")

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        try:
            ids = await self.backend.model_ids()
        except self.backend.error_types as exc:
            raise _api_error(self.backend, exc, None) from exc
        return Response(encode(models_list(ids, self.created)), media_type="application/json")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, Kind.COMPLETION)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, Kind.CHAT)

    async def _read_body(self, request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes", error_type="invalid_request_error")
        chunks = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes",
                               error_type="invalid_request_error")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _generate(self, request: Request, kind: Kind) -> Response:
        self._authorize(request, stream=True)
        try:
            parsed = parse_request(decode_body(await self._read_body(request)), kind)
            known = self.backend.known_model_ids()
            if known is not None and parsed.model not in known:
                raise ApiError(404, f"The model `{parsed.model}` does not exist; GET /v1/models lists {known}",
                               "model", code="model_not_found")
            timeout_seconds = _timeout_seconds(request)
        except ApiError as exc:
            self.backend.refused(exc)
            raise
        stream = self.backend.generate(parsed.request, request.headers, PROTOCOL, timeout_seconds)
        state = ResponseState(parsed)
        if parsed.stream:
            # Wait for the first response before answering 200: an engine's refusal (invalid field, admission,
            # no engine) becomes the HTTP status, as OpenAI answers.
            first = await self._first(stream, parsed)
            return _DisconnectAware(_SseResponse(self.backend, state, first, stream))  # type: ignore[return-value]
        return _DisconnectAware(_FullResponse(self.backend, state, stream))  # type: ignore[return-value]

    async def _first(self, stream: AsyncIterator[pb.GenerateResponse],
                     parsed: ParsedRequest) -> pb.GenerateResponse | None:
        try:
            return await stream.__anext__()
        except StopAsyncIteration:
            return None
        except self.backend.error_types as exc:
            await stream.aclose()  # type: ignore[attr-defined]
            raise _api_error(self.backend, exc, parsed) from exc
        except BaseException:
            await stream.aclose()  # type: ignore[attr-defined]
            raise


class _FullResponse(Response):
    """A non-streamed completion: collected from the backend, then sent as one JSON object."""

    def __init__(self, backend: Backend, state: ResponseState, stream: AsyncIterator[pb.GenerateResponse]) -> None:
        self._backend = backend
        self.status_code = 200
        self.background = None
        self.raw_headers = []
        self._state = state
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self._state
        try:
            async with contextlib.aclosing(self._stream):  # type: ignore[type-var]
                async for response in self._stream:
                    state.absorb(response)
                    state.texts.append(response.text)
                    state.token_ids.extend(response.token_ids)
            status, body = 200, encode(full_response(state, "".join(state.texts)))
        except self._backend.error_types as exc:
            error = _api_error(self._backend, exc, state.parsed)
            status, body = error.status, encode(error.body())
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
