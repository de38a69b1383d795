"""Protocol-neutral routing of Generation calls across engine replicas.

`Router.generate` is an async generator over one pb.GenerateRequest: it admits the stream, waits (bounded) for an
engine when none is ready, picks the least-loaded engine, forwards, watches the engine for a stall, retries on
another engine only before the first response, and ends with `RouteError` (a gRPC status code and a message safe to
show the caller). The gRPC servicer and the HTTP front end are thin adapters that map RouteError to their own status
codes. Engine addresses and engine exception text stay in the logs, never in what a caller is told.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from minedraft.api import pb, pb_grpc
from minedraft.api.errors import STATUS_DETAILS_KEY, Trailers, rich_status, status_matches
from minedraft.gateway.metrics import GatewayMetrics
from minedraft.gateway.policy import Admission, FailureAction, classify_failure, pick
from minedraft.gateway.pool import EnginePool

log = logging.getLogger(__name__)

T = TypeVar("T")

# Request metadata forwarded to engines: tracing and request correlation, and the project's own `minedraft-*` keys.
# Everything else (API keys, cookies, auth of this hop) stays at the gateway.
FORWARDED_METADATA_KEYS = frozenset({"traceparent", "tracestate", "baggage", "grpc-trace-bin", "x-request-id"})
FORWARDED_METADATA_PREFIX = "minedraft-"
# Trailing metadata of an engine's answer passed on to the caller (e.g. the legacy invalid-field trailer); gRPC's
# rich status goes too (caller_trailers).
FORWARDED_TRAILER_PREFIX = "minedraft-"
# Engine answers whose message is written for the caller (about the request); other codes' messages may carry
# exception text and stay in the logs.
CALLER_FACING_CODES = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
})
# Ends the caller brought about (its deadline, its cancel): not worth a warning.
_CALLER_CAUSED = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})
# What a caller is told when the engines refused the gateway's own credential (a 503, not a 401: the caller's
# credential was fine).
CREDENTIAL_REFUSED = "the engine refused the gateway's credential"
# How often a stream waiting for an engine re-checks without an event (a failure cool-down ends silently).
_WAIT_RECHECK_SECONDS = 0.5


class RouteError(Exception):
    """How a routed call ended when not with success: a gRPC status code and a message fit for the caller."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 trailing_metadata: Trailers = ()) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.trailing_metadata = trailing_metadata


@dataclass(frozen=True)
class RouterConfig:
    # Engines tried per call (only before its first response).
    max_attempts: int = 3
    # An engine that sends nothing for this long after the call (first response) or between responses is taken as
    # stalled (a frozen process keeps its TCP connection open): the call is cut and the engine taken out of rotation
    # until its health answers again. None disables the check.
    first_response_timeout_seconds: float | None = 60.0
    idle_timeout_seconds: float | None = 30.0
    # With no engine ready, a call waits this long for one (scale from zero, a rollout), at most this many at once.
    engine_wait_timeout_seconds: float = 300.0
    max_waiting_streams: int = 1024

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts: must be >= 1, got {self.max_attempts}")
        for name in ("first_response_timeout_seconds", "idle_timeout_seconds"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}: must be > 0 (or None to disable), got {value}")
        if self.engine_wait_timeout_seconds < 0:
            raise ValueError(f"engine_wait_timeout_seconds: must be >= 0, got {self.engine_wait_timeout_seconds}")
        if self.max_waiting_streams < 0:
            raise ValueError(f"max_waiting_streams: must be >= 0, got {self.max_waiting_streams}")


def forwarded_metadata(metadata: Sequence[tuple[str, Any]] | None) -> tuple[tuple[str, Any], ...]:
    """The allowlisted part of a caller's metadata, to be sent on to the engine."""
    return tuple((k, v) for k, v in (metadata or ())
                 if k.lower() in FORWARDED_METADATA_KEYS or k.lower().startswith(FORWARDED_METADATA_PREFIX))


def caller_trailers(error: grpc.aio.AioRpcError, message: str) -> Trailers:
    """The engine's trailers the caller gets: the project's own `minedraft-*` ones, and gRPC's rich status (the
    google.rpc.BadRequest of a field error) when the caller's message is the engine's, as a rich status must agree
    with the call's code and message (clients refuse one that does not)."""
    trailers = error.trailing_metadata() or ()
    kept: list[tuple[str, str | bytes]] = [(k, v) for k, v in trailers
                                           if isinstance(v, str) and k.startswith(FORWARDED_TRAILER_PREFIX)]
    status = rich_status(trailers)
    if status is not None and status_matches(status, error.code(), message):
        kept.append((STATUS_DETAILS_KEY, status.SerializeToString()))
    return tuple(kept)


def engine_answer(error: grpc.aio.AioRpcError) -> RouteError:
    """An engine's error about the request, as the caller sees it: code kept; message kept only where it is about
    the request, else a generic one (the engine's text is logged)."""
    code = error.code()
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return RouteError(code, "deadline exceeded")
    if code is grpc.StatusCode.CANCELLED:
        return RouteError(code, "cancelled")
    if code in CALLER_FACING_CODES:
        message = error.details() or code.name.lower()
        return RouteError(code, message, caller_trailers(error, message))
    message = f"the engine could not process this request ({code.name})"
    return RouteError(code, message, caller_trailers(error, message))


class _StallWatch:
    """Cuts an engine call that sends nothing in time; costs one attribute write per response, a timer per limit.

    The timer fires lazily: it re-arms itself while reads keep arriving, and only a read that has waited longer than
    its limit cancels the call. Time spent writing to a slow caller is not counted against the engine.
    """

    __slots__ = ("_call", "_first_s", "_handle", "_idle_s", "_loop", "cut", "expired", "got_response",
                 "read_started")

    def __init__(self, call: grpc.aio.Call, first_s: float | None, idle_s: float | None) -> None:
        self._loop = asyncio.get_running_loop()
        self._call = call
        self._first_s = first_s
        self._idle_s = idle_s
        self.expired = False
        # Set when the gateway cuts the call at the end of its drain grace period.
        self.cut = False
        self.got_response = False
        self.read_started: float | None = None
        self._handle: asyncio.TimerHandle | None = None
        # Armed at the sooner of the two limits, so each is honoured on its own from the start: armed only at the
        # first-response limit, a stream frozen after its first token was cut only when that (longer) timer fired.
        limits = [limit for limit in (first_s, idle_s) if limit is not None]
        if limits:
            self._handle = self._loop.call_later(min(limits), self._fire)

    def _limit(self) -> float | None:
        return self._idle_s if self.got_response else self._first_s

    def _fire(self) -> None:
        now = self._loop.time()
        limit = self._limit()
        if limit is None:
            if not self.got_response and self._idle_s is not None:  # no first-response limit: look again later
                self._handle = self._loop.call_at(now + self._idle_s, self._fire)
            else:
                self._handle = None
            return
        # Looked at again no later than the sooner limit (the first response may arrive before the next look).
        soonest = min(lim for lim in (self._first_s, self._idle_s, limit) if lim is not None)
        if self.read_started is None:  # writing to the caller: not the engine's time
            self._handle = self._loop.call_at(now + soonest, self._fire)
            return
        due = self.read_started + limit
        if now >= due:
            self.expired = True
            self._handle = None
            self._call.cancel()
        else:
            self._handle = self._loop.call_at(min(due, now + soonest), self._fire)

    def cut_call(self) -> None:
        self.cut = True
        self._call.cancel()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class Router:
    def __init__(self, pool: EnginePool, admission: Admission, config: RouterConfig | None = None,
                 rng: random.Random | None = None, metrics: GatewayMetrics | None = None) -> None:
        self.pool = pool
        self.admission = admission
        self.config = config or RouterConfig()
        self.rng = rng or random.Random()
        self.metrics = metrics or GatewayMetrics()
        self.draining = False
        # Calls waiting for any engine to become ready (the autoscaler's scale-from-zero signal).
        self.num_waiting = 0
        self._engines_changed = asyncio.Event()
        self._open_calls: set[_StallWatch] = set()

    def cut_all(self) -> None:
        """End every open stream now with UNAVAILABLE and its token count (the end of a drain's grace period)."""
        for watch in list(self._open_calls):
            watch.cut_call()

    def engines_changed(self) -> None:
        """Wake calls waiting for an engine (the pool calls this on any health or membership change)."""
        self._engines_changed.set()
        self._engines_changed = asyncio.Event()

    def _next_engine(self, tried: set[str]) -> tuple[str, pb_grpc.GenerationStub] | None:
        """The next engine to try (least loaded of those not tried yet), added to `tried`; None when none is left."""
        endpoint = pick(self.pool.endpoints, self.rng, time.monotonic(), exclude=tried)
        stub = self.pool.stub(endpoint.address) if endpoint is not None else None
        if endpoint is None or stub is None:
            return None
        tried.add(endpoint.address)
        return endpoint.address, stub

    async def _wait_for_engine(self, deadline: float | None) -> tuple[str, pb_grpc.GenerationStub]:
        """Bounded wait for any ready engine (none is ready now)."""
        config = self.config
        if self.num_waiting >= config.max_waiting_streams:
            raise RouteError(grpc.StatusCode.UNAVAILABLE, "too many streams waiting for an engine")
        loop = asyncio.get_running_loop()
        give_up = loop.time() + config.engine_wait_timeout_seconds
        self.num_waiting += 1
        try:
            while True:
                if self.draining:
                    raise RouteError(grpc.StatusCode.UNAVAILABLE, "gateway is shutting down")
                engine = self._next_engine(set())
                if engine is not None:
                    return engine
                now = loop.time()
                if deadline is not None and now >= deadline:
                    raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded waiting for an engine")
                if now >= give_up:
                    refusing = sum(e.credential_refused for e in self.pool.endpoints)
                    raise RouteError(grpc.StatusCode.UNAVAILABLE,
                                     f"no engine replica became ready within {config.engine_wait_timeout_seconds:g} s"
                                     + (f" ({refusing} refused the gateway's credential)" if refusing else ""))
                until = min(give_up, deadline) if deadline is not None else give_up
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._engines_changed.wait(), min(_WAIT_RECHECK_SECONDS, until - now))
        finally:
            self.num_waiting -= 1

    async def _first_engine(self, tried: set[str], deadline: float | None) -> tuple[str, pb_grpc.GenerationStub]:
        engine = self._next_engine(tried)
        if engine is None:
            engine = await self._wait_for_engine(deadline)
            tried.add(engine[0])
        return engine

    def _credential_refused(self, address: str) -> None:
        if self.pool.endpoints.get(address) is None:
            return  # a call to an engine already out of the routing table: no series comes back for it
        self.pool.report_credential_refused(address)
        self.metrics.credential_refused(address)

    def _admit(self) -> None:
        if self.draining:
            raise RouteError(grpc.StatusCode.UNAVAILABLE, "gateway is shutting down")
        if not self.admission.try_acquire():
            self.metrics.admission_rejected()
            raise RouteError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"gateway at its limit of {self.admission.max_in_flight} streams in flight")

    @staticmethod
    def _remaining(deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())

    async def generate(self, request: pb.GenerateRequest, metadata: Sequence[tuple[str, Any]] = (),
                       timeout_seconds: float | None = None,
                       protocol: str = "grpc") -> AsyncIterator[pb.GenerateResponse]:
        """Stream one request's responses from an engine. `metadata` is the caller's (filtered here),
        `timeout_seconds` what is left of the caller's deadline (None: none), `protocol` the front end's metric
        label."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_seconds is None else loop.time() + timeout_seconds
        config = self.config
        # One generator with the metrics as a context manager, not generators wrapping generators: the inner loop
        # runs once per forwarded token, and each layer would add to every token's latency.
        with self.metrics.stream(deadline, protocol) as observed:
            arrived = time.perf_counter()
            self._admit()
            try:
                forwarded = forwarded_metadata(metadata)
                tried: set[str] = set()
                tokens_sent = 0
                responded = False
                last_failure = ""
                engine: tuple[str, pb_grpc.GenerationStub] | None = await self._first_engine(tried, deadline)
                while engine is not None:
                    address, stub = engine
                    self.pool.endpoints.acquire(address)
                    # The caller's deadline travels on: the engine stops work the caller can no longer use.
                    call = stub.Generate(request, timeout=self._remaining(deadline), metadata=forwarded)
                    self.metrics.engine_called(time.perf_counter() - arrived, len(tried))
                    watch = _StallWatch(call, config.first_response_timeout_seconds, config.idle_timeout_seconds)
                    self._open_calls.add(watch)
                    try:
                        while True:
                            watch.read_started = loop.time()
                            try:
                                response = await call.read()
                            except asyncio.CancelledError:
                                current = asyncio.current_task()
                                if current is not None and current.cancelling():
                                    raise
                                if watch.cut:
                                    raise RouteError(grpc.StatusCode.UNAVAILABLE,
                                                     "gateway shutting down: stream cut at the end of the drain "
                                                     f"grace period after {tokens_sent} tokens delivered") from None
                                if not watch.expired:
                                    raise
                                # The stall watch cut the call: the engine is frozen (or far too slow) for it.
                                self.pool.report_unresponsive(address)
                                log.warning("engine %s sent no %s response in time: out of rotation until its "
                                            "health answers", address, "next" if responded else "first")
                                if responded:
                                    raise RouteError(grpc.StatusCode.UNAVAILABLE,
                                                     f"the engine stopped responding after {tokens_sent} tokens "
                                                     "delivered; not retried because tokens were already streamed"
                                                     ) from None
                                last_failure = "engine stalled"
                                break
                            watch.read_started = None
                            if response is grpc.aio.EOF:
                                return
                            if not responded:
                                responded = True
                                watch.got_response = True
                                observed.responded()
                            tokens_sent += len(response.token_ids)
                            if response.finish_reason:
                                observed.delivered()
                            yield response
                    except grpc.aio.AioRpcError as exc:
                        action = classify_failure(exc.code(), int(responded))
                        if action is FailureAction.CREDENTIAL_REFUSED:
                            self._credential_refused(address)
                            last_failure = CREDENTIAL_REFUSED
                            if responded:
                                raise RouteError(grpc.StatusCode.UNAVAILABLE, f"the engine failed after {tokens_sent} "
                                                 "tokens delivered: it refused the gateway's credential") from None
                        elif action is FailureAction.PASS_THROUGH:
                            if exc.code() not in CALLER_FACING_CODES and exc.code() not in _CALLER_CAUSED:
                                log.warning("engine %s: %s: %s", address, exc.code().name, exc.details())
                            raise engine_answer(exc) from None
                        else:
                            self.pool.report_failure(address)
                            log.info("engine %s failed (%s: %s) after %d tokens", address, exc.code().name,
                                     exc.details(), tokens_sent)
                            if action is FailureAction.UNAVAILABLE_AFTER_TOKENS:
                                # Never a silent truncation: the caller learns the stream broke and how far it got.
                                raise RouteError(grpc.StatusCode.UNAVAILABLE,
                                                 f"the engine failed after {tokens_sent} tokens delivered; not "
                                                 "retried because tokens were already streamed") from None
                            last_failure = exc.code().name
                    finally:
                        watch.close()
                        self._open_calls.discard(watch)
                        # A no-op when the call ended; when the caller went away (cancel, deadline), cancels upstream.
                        call.cancel()
                        self.pool.endpoints.release(address)
                    engine = self._next_engine(tried) if len(tried) < config.max_attempts else None
                raise RouteError(grpc.StatusCode.UNAVAILABLE,
                                 f"no ready engine after {len(tried)} attempt(s); last: {last_failure or 'none'}")
            finally:
                self.admission.release()

    async def unary(self, invoke: Callable[[pb_grpc.GenerationStub, float | None], Awaitable[T]],
                    timeout_seconds: float | None = None, admitted: bool = True) -> T:
        """One unary call (model or server info) under the same admission, drain and engine choice as streams.
        `admitted=False`: the gateway's own call (a refresh of the model ids), which takes no caller's slot."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_seconds is None else loop.time() + timeout_seconds
        if admitted:
            self._admit()
        elif self.draining:
            raise RouteError(grpc.StatusCode.UNAVAILABLE, "gateway is shutting down")
        try:
            tried: set[str] = set()
            last_failure = ""
            engine: tuple[str, pb_grpc.GenerationStub] | None = await self._first_engine(tried, deadline)
            while engine is not None:
                address, stub = engine
                remaining = self._remaining(deadline)
                limit = self.config.first_response_timeout_seconds
                if limit is not None:
                    remaining = limit if remaining is None else min(remaining, limit)
                try:
                    return await invoke(stub, remaining)
                except grpc.aio.AioRpcError as exc:
                    stalled = exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED and (
                        deadline is None or loop.time() < deadline)
                    action = classify_failure(exc.code(), 0)
                    if stalled:
                        self.pool.report_unresponsive(address)
                    elif action is FailureAction.CREDENTIAL_REFUSED:
                        self._credential_refused(address)
                    elif action is not FailureAction.RETRY:
                        raise engine_answer(exc) from None
                    else:
                        self.pool.report_failure(address)
                    log.info("engine %s failed a unary call (%s: %s)", address, exc.code().name, exc.details())
                    last_failure = ("engine stalled" if stalled else CREDENTIAL_REFUSED
                                    if action is FailureAction.CREDENTIAL_REFUSED else exc.code().name)
                engine = self._next_engine(tried) if len(tried) < self.config.max_attempts else None
            raise RouteError(grpc.StatusCode.UNAVAILABLE,
                             f"no ready engine after {len(tried)} attempt(s); last: {last_failure or 'none'}")
        finally:
            if admitted:
                self.admission.release()
