"""The OpenAI-compatible HTTP front end (Starlette under uvicorn, the stack vLLM itself serves with).

Thin: every route decodes, calls protocol.py's pure translations and a Backend (the engine server's own engine, or
the gateway's router), and encodes. A backend raises BackendError with a gRPC status code, so both front ends share
one error mapping with the gRPC API. The client going away (a closed connection, watched from the moment the body
is read, before the first token too) cancels the request's task, which closes the backend's stream: the engine aborts
the request, as a cancelled gRPC call does. A client that accepts nothing for a set time is cut the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Protocol

import grpc
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from minedraft.api import pb
from minedraft.openai_api.protocol import (
    SSE_DONE,
    ApiError,
    Kind,
    ParsedRequest,
    ResponseState,
    choice_events,
    choice_states,
    decode_body,
    encode,
    error_from_status,
    full_response,
    merged_full_response,
    merged_speculation,
    merged_usage,
    models_list,
    parse_request,
    stream_events,
    usage_event,
)
from minedraft.openai_api.server import ABORT_EXTENSION

log = logging.getLogger(__name__)

PROTOCOL = "http"
# OpenAI's API has no deadline of its own (SDK timeouts just disconnect); this request header sets one, as a gRPC
# deadline does: past it the request is aborted in the engine and answered 504.
TIMEOUT_HEADER = "minedraft-timeout-seconds"
# The largest request body read (a prompt of a long context is a few hundred KB of JSON).
MAX_BODY_BYTES = 8 * 1024 * 1024
# Bodies larger than this are decoded and checked in a thread, off the event loop.
OFF_LOOP_BODY_BYTES = 64 * 1024
# gRPC's default largest message, which the engine servers receive: a larger engine request is refused here (413).
MAX_ENGINE_REQUEST_BYTES = 4 * 1024 * 1024
# A streamed response whose client accepts no bytes for this long is cut (its engine request aborted).
CLIENT_STALL_TIMEOUT_S = 60.0
REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_HEADER_CHARS = 256


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

    def max_streams(self) -> int | None:
        """The most engine requests one HTTP request can ever have admitted at once (None: no such bound). A fanned-out
        request with more choices could never run: a 400 naming the field, not a 429 the SDKs retry in vain."""
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


class _SendWatch:
    """Cuts a response whose client accepts no bytes for `limit_s` (its socket's buffers full: a client that stopped
    reading). One attribute write around each send; a timer that re-arms itself lazily, as the gateway's stall
    watch does. Without it the stream would hold its engine request and admission slot for as long as the client
    stays connected."""

    __slots__ = ("_handle", "_limit_s", "_task", "expired", "loop", "since")

    def __init__(self, task: asyncio.Future[None], limit_s: float) -> None:
        self.loop = asyncio.get_running_loop()
        self._task = task
        self._limit_s = limit_s
        self.since: float | None = None  # when the send now in progress started (None: not sending)
        self.expired = False
        self._handle: asyncio.TimerHandle | None = self.loop.call_later(limit_s, self._fire)

    def _fire(self) -> None:
        since = self.since
        now = self.loop.time()
        if since is not None and now - since >= self._limit_s:
            self.expired = True
            self._handle = None
            self._task.cancel()
            return
        self._handle = self.loop.call_at((now if since is None else since) + self._limit_s, self._fire)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _GenerationResponse:
    """One generation request's answer, written straight to the ASGI `send` (no per-chunk iterator layers: each
    layer costs every token a few microseconds on the gateway's path).

    The client's disconnect is watched from the start, before the first token too: when it goes, the task is
    cancelled, which closes the backend's stream (the engine aborts the request, the gateway frees its admission
    slot and never blames the engine for a caller that left). A streamed request waits for its first response
    before answering 200, so an engine's refusal (invalid field, admission, no engine) is the HTTP status, as OpenAI
    answers; an error after it is an OpenAI error event followed by [DONE] (as vLLM's server sends)."""

    def __init__(self, backend: Backend, state: ResponseState, stream: AsyncIterator[pb.GenerateResponse],
                 headers: list[tuple[bytes, bytes]], client_stall_timeout_s: float | None) -> None:
        self._backend = backend
        self._state = state
        self._stream = stream
        self._headers = headers
        self._client_stall_timeout_s = client_stall_timeout_s
        self._watch: _SendWatch | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        respond = asyncio.ensure_future(self._respond(send))
        disconnected = asyncio.ensure_future(_until_disconnected(receive))
        limit_s = self._client_stall_timeout_s
        self._watch = _SendWatch(respond, limit_s) if limit_s is not None else None
        gone = False
        try:
            await asyncio.wait({respond, disconnected}, return_when=asyncio.FIRST_COMPLETED)
            gone = disconnected.done() and not respond.done()
        finally:
            if self._watch is not None:
                self._watch.close()
            for task in (respond, disconnected):
                task.cancel()
            for task in (respond, disconnected):
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task
        if self._watch is not None and self._watch.expired:
            # The response is left incomplete. The connection is closed at once, unsent data dropped: a graceful close
            # would wait for the client to read what its full buffers hold, keeping the socket (and megabytes of
            # kernel buffer) for as long as it stays connected.
            abort = scope.get("extensions", {}).get(ABORT_EXTENSION)
            if abort is not None:
                abort["abort"]()
            log.warning("request %s: stream cut, the client accepted nothing for %g s", self._state.id, limit_s)
        elif gone:
            log.debug("request %s: the client went away; request cancelled", self._state.id)
        if respond.done() and not respond.cancelled() and respond.exception() is not None:
            raise respond.exception()  # type: ignore[misc]

    async def _send(self, send: Send, message: Message) -> None:
        watch = self._watch
        if watch is None:
            await send(message)
            return
        watch.since = watch.loop.time()
        await send(message)
        watch.since = None

    async def _respond(self, send: Send) -> None:
        state = self._state
        async with contextlib.aclosing(self._stream):  # type: ignore[type-var]
            if state.parsed.stream:
                await self._respond_streamed(send)
            else:
                await self._respond_full(send)

    async def _send_error(self, send: Send, error: ApiError) -> None:
        body = encode(error.body())
        await self._send(send, {"type": "http.response.start", "status": error.status,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode()), *self._headers]})
        await self._send(send, {"type": "http.response.body", "body": body})

    async def _respond_streamed(self, send: Send) -> None:
        state, stream = self._state, self._stream
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            first = None
        except self._backend.error_types as exc:
            await self._send_error(send, _api_error(self._backend, exc, state.parsed))
            return
        await self._send(send, {"type": "http.response.start", "status": 200,
                                "headers": [*_SSE_HEADERS, *self._headers]})
        try:
            if first is not None:
                await self._send(send, {"type": "http.response.body",
                                        "body": b"".join(stream_events(state, first)), "more_body": True})
            # The per-token loop: the send watch's bookkeeping inline (one coroutine layer less per token).
            watch = self._watch
            if watch is None:
                async for response in stream:
                    await send({"type": "http.response.body", "body": b"".join(stream_events(state, response)),
                                "more_body": True})
            else:
                clock = watch.loop.time
                async for response in stream:
                    message = {"type": "http.response.body", "body": b"".join(stream_events(state, response)),
                               "more_body": True}
                    watch.since = clock()
                    await send(message)
                    watch.since = None
        except self._backend.error_types as exc:
            error = _api_error(self._backend, exc, state.parsed)
            await self._send(send, {"type": "http.response.body",
                                    "body": b"data: " + encode(error.body()) + b"\n\n" + SSE_DONE,
                                    "more_body": True})
        await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})

    async def _respond_full(self, send: Send) -> None:
        state = self._state
        try:
            async for response in self._stream:
                state.collect(response)
        except self._backend.error_types as exc:
            await self._send_error(send, _api_error(self._backend, exc, state.parsed))
            return
        body = encode(full_response(state, "".join(state.texts)))
        await self._send(send, {"type": "http.response.start", "status": 200,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode()), *self._headers]})
        await self._send(send, {"type": "http.response.body", "body": body})


# What a fanned-out request's sub-generations report: (choice index, a response | the error it ended with | None at
# its end).
_Report = tuple[int, pb.GenerateResponse | Exception | None]


class _FanOutResponse(_GenerationResponse):
    """A request fanned out into several generations (n > 1, a batch of prompts), merged into one OpenAI answer.

    Every choice is its own backend stream, all running at once, each read by a pump task into one bounded queue (a
    client that reads slowly holds the pumps, and through them the engines, as a single stream's reader does). A
    streamed answer waits for every choice's first response before its 200, so a refusal of any of them (an invalid
    field, the gateway's admission) is the HTTP status; then chunks go out as they come, each with its choice's
    index; usage (summed) and [DONE] once, after the last choice. One choice failing fails the whole request (an
    error status, or an error event and [DONE] once streaming) and closes the others' streams, which aborts them in
    the engine; the client going away cancels this task, which does the same."""

    def __init__(self, backend: Backend, states: list[ResponseState], streams: list[AsyncIterator[pb.GenerateResponse]],
                 headers: list[tuple[bytes, bytes]], client_stall_timeout_s: float | None) -> None:
        super().__init__(backend, states[0], streams[0], headers, client_stall_timeout_s)
        self._states = states
        self._streams = streams

    async def _pump(self, index: int, stream: AsyncIterator[pb.GenerateResponse],
                    queue: asyncio.Queue[_Report]) -> None:
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            try:
                async for response in stream:
                    await queue.put((index, response))
            except Exception as exc:  # the backend's errors and anything else: the merge decides
                await queue.put((index, exc))
                return
        await queue.put((index, None))

    def _error(self, item: Exception) -> ApiError:
        if isinstance(item, self._backend.error_types):
            return _api_error(self._backend, item, self._state.parsed)
        raise item  # not a backend's answer: the catch-all (a 500, or a cut stream)

    async def _respond(self, send: Send) -> None:
        queue: asyncio.Queue[_Report] = asyncio.Queue(maxsize=len(self._streams))
        pumps = [asyncio.ensure_future(self._pump(index, stream, queue)) for index, stream in enumerate(self._streams)]
        try:
            if self._state.parsed.stream:
                await self._respond_fanned_streamed(send, queue)
            else:
                await self._respond_fanned_full(send, queue)
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def _respond_fanned_full(self, send: Send, queue: asyncio.Queue[_Report]) -> None:
        states = self._states
        ended = 0
        while ended < len(states):
            index, item = await queue.get()
            if item is None:
                ended += 1
            elif isinstance(item, Exception):
                await self._send_error(send, self._error(item))
                return
            else:
                states[index].collect(item)
        body = encode(merged_full_response(states))
        await self._send(send, {"type": "http.response.start", "status": 200,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode()), *self._headers]})
        await self._send(send, {"type": "http.response.body", "body": body})

    async def _respond_fanned_streamed(self, send: Send, queue: asyncio.Queue[_Report]) -> None:
        states = self._states
        # Every choice's first report before the 200 (kept, in arrival order, to go out right after it).
        early: list[_Report] = []
        started = [False] * len(states)
        while not all(started):
            index, item = report = await queue.get()
            if isinstance(item, Exception):
                await self._send_error(send, self._error(item))
                return
            started[index] = True
            early.append(report)
        await self._send(send, {"type": "http.response.start", "status": 200,
                                "headers": [*_SSE_HEADERS, *self._headers]})
        ended = 0
        # The early reports in choice order (each choice's own in arrival order): every choice's first chunk comes
        # after those of the choices before it, as OpenAI's and vLLM's servers send them. The official SDKs' stream
        # accumulators rely on it (the first chunk's choice is put at its index in a list as long as the chunk's
        # choices; a later new choice is appended): a first chunk of choice 1 failed with IndexError there.
        early.sort(key=lambda report: report[0])
        pending = iter(early)
        while ended < len(states):
            buffered = next(pending, None)
            index, item = buffered if buffered is not None else await queue.get()
            if item is None:
                ended += 1
                continue
            if isinstance(item, Exception):
                error = self._error(item)
                await self._send(send, {"type": "http.response.body",
                                        "body": b"data: " + encode(error.body()) + b"\n\n" + SSE_DONE,
                                        "more_body": True})
                break
            events = choice_events(states[index], item)
            if events:
                await self._send(send, {"type": "http.response.body", "body": b"".join(events), "more_body": True})
        else:
            tail = [usage_event(states[0], merged_usage(states), merged_speculation(states))] \
                if self._state.parsed.include_usage else []
            await self._send(send, {"type": "http.response.body", "body": b"".join([*tail, SSE_DONE]),
                                    "more_body": True})
        await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})


_SSE_HEADERS = ((b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"))


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

    def __init__(self, backend: Backend, client_stall_timeout_s: float | None = CLIENT_STALL_TIMEOUT_S,
                 cors_origins: Sequence[str] = ()) -> None:
        self.backend = backend
        self.client_stall_timeout_s = client_stall_timeout_s
        self.created = int(time.time())
        # Optional CORS (browser clients on other origins); off unless origins are given.
        middleware = [Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                                 allow_headers=["*"], expose_headers=[REQUEST_ID_HEADER])] if cors_origins else []
        self.app = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ], middleware=middleware, exception_handlers={
            ApiError: self._api_error, 404: self._not_found, 405: self._not_allowed,
            HTTPException: self._http_error, Exception: self._internal_error})

    async def _api_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(ApiError(exc.status_code, exc.detail or "request refused"))

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        # Never the exception's text or traceback in the answer (they stay in the log, written by the server).
        log.error("%s %s: unhandled %s", request.method, request.url.path, type(exc).__name__)
        return error_response(ApiError(500, "internal server error", code="internal_error"))

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

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        model_id = request.path_params["model_id"]
        try:
            ids = await self.backend.model_ids()
        except self.backend.error_types as exc:
            raise _api_error(self.backend, exc, None) from exc
        if model_id not in ids:
            raise ApiError(404, f"The model `{model_id}` does not exist; GET /v1/models lists {ids}", "model",
                           code="model_not_found")
        return Response(encode(models_list([model_id], self.created)["data"][0]), media_type="application/json")

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
            _check_content_type(request)
            try:
                raw = await self._read_body(request)
            except ClientDisconnect:
                # Gone before its body was in (or cut by the server's body timeout, which answered 408 itself).
                log.debug("%s: the client went away before its body was read", request.url.path)
                return Response(status_code=408)
            if len(raw) > OFF_LOOP_BODY_BYTES:
                # Decoding and checking a large body (millions of token ids, thousands of messages) takes a
                # Python-level pass over every item: in a thread, so other streams and the probes keep being served.
                parsed = await asyncio.to_thread(_parse, raw, kind)
            else:
                parsed = _parse(raw, kind)
            known = self.backend.known_model_ids()
            if known is not None and parsed.model not in known:
                raise ApiError(404, f"The model `{parsed.model}` does not exist; GET /v1/models lists {known}",
                               "model", code="model_not_found")
            _check_stream_bound(parsed, self.backend.max_streams())
            timeout_seconds = _timeout_seconds(request)
            request_id = _request_id_header(request)
            # The backend checks the headers it forwards (raising ApiError) before any work starts. A fanned-out
            # request: one stream per choice (through the gateway, each takes its own admission slot).
            streams = [self.backend.generate(sub, request.headers, PROTOCOL, timeout_seconds)
                       for sub in parsed.requests]
        except ApiError as exc:
            self.backend.refused(exc)
            raise
        if parsed.ignored_fields:
            log.info("request %s: ignored unknown fields %s", parsed.request.request_id, list(parsed.ignored_fields))
        headers = [] if request_id is None else [(REQUEST_ID_HEADER.encode(), request_id.encode())]
        states = choice_states(parsed)
        if parsed.fanned:
            return _FanOutResponse(self.backend, states, streams, headers,  # type: ignore[return-value]
                                   self.client_stall_timeout_s)
        return _GenerationResponse(self.backend, states[0], streams[0], headers,  # type: ignore[return-value]
                                   self.client_stall_timeout_s)


def _parse(raw: bytes, kind: Kind) -> ParsedRequest:
    parsed = parse_request(decode_body(raw), kind)
    # The engine's gRPC API takes messages up to this size: a larger request is the client's (413), never the
    # engine's RESOURCE_EXHAUSTED (a 429 the SDKs retry).
    size_bytes = max(request.ByteSize() for request in parsed.requests)
    if size_bytes > MAX_ENGINE_REQUEST_BYTES:
        param = "messages" if kind is Kind.CHAT else "prompt"
        raise ApiError(413, f"{param}: the request is {size_bytes} bytes as an engine request; at most "
                            f"{MAX_ENGINE_REQUEST_BYTES}", param, code="request_too_large")
    return parsed


def _check_stream_bound(parsed: ParsedRequest, max_streams: int | None) -> None:
    count = len(parsed.requests)
    if max_streams is not None and count > max_streams:
        param = "n" if parsed.n > 1 else "prompt"
        raise ApiError(400, f"{param}: the request is {count} generations (n times the prompts), each an engine stream "
                            f"of its own; this server admits at most {max_streams} streams at once", param,
                       code="too_many_generations")


def _check_content_type(request: Request) -> None:
    content_type = request.headers.get("content-type")
    if content_type is None:
        return  # a body without a declared type is read as JSON
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise ApiError(415, f"content-type: the request body must be application/json, got {media_type!r}",
                       "content-type", code="unsupported_media_type")


def _request_id_header(request: Request) -> str | None:
    """The caller's X-Request-Id (echoed on the response, forwarded to the engine), checked: gRPC metadata values
    are printable ASCII."""
    value = request.headers.get(REQUEST_ID_HEADER)
    if value is None:
        return None
    if not (0 < len(value) <= MAX_REQUEST_ID_HEADER_CHARS and all(" " <= c <= "~" for c in value)):
        raise ApiError(400, f"{REQUEST_ID_HEADER}: must be 1 to {MAX_REQUEST_ID_HEADER_CHARS} printable ASCII "
                            "characters", REQUEST_ID_HEADER)
    return value
