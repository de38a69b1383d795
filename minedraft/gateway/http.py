"""The gateway's OpenAI HTTP API: the shared front end (minedraft.openai_api) over the gateway's Router.

The same admission, engine choice, retries before the first response, stall watch, bearer tokens and TLS as the
gateway's gRPC side; the engines are spoken to in gRPC. A RouteError becomes the HTTP status OpenAI uses (400 with
the parameter for an engine's INVALID_ARGUMENT, 429 for admission, 503 without a ready engine, 504 past a
deadline).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

import grpc

from minedraft.api import pb
from minedraft.api.auth import bearer_token, token_accepted
from minedraft.api.errors import invalid_field
from minedraft.gateway.router import RouteError, Router, forwarded_metadata
from minedraft.openai_api.app import CLIENT_STALL_TIMEOUT_S, PROTOCOL, BackendError, OpenAiApp
from minedraft.openai_api.protocol import ApiError

log = logging.getLogger(__name__)

# The forwarded headers' budget: gRPC's default metadata limit (8 KiB) less room for the call's own headers.
MAX_FORWARDED_HEADER_BYTES = 4096
# The served model ids are refreshed from an engine this often at most (a rollout may change the model).
MODEL_IDS_TTL_SECONDS = 30.0


class GatewayBackend:
    error_types: tuple[type[Exception], ...] = (RouteError, BackendError)

    def __init__(self, router: Router, ready: Callable[[], bool], tokens: Sequence[bytes] = (),
                 served_model_names: Sequence[str] = ()) -> None:
        self.router = router
        self._ready = ready
        self.served_model_names = tuple(served_model_names)
        self.tokens = tokens  # not copied: a LiveTokens follows its file's rotations
        self._model_ids: list[str] | None = None
        self._model_ids_at = 0.0
        self._refresh: asyncio.Task[None] | None = None

    def backend_error(self, error: Exception) -> BackendError:
        if isinstance(error, BackendError):
            return error
        assert isinstance(error, RouteError)
        field = invalid_field(error.trailing_metadata)
        return BackendError(error.code, error.message, field)

    def live(self) -> bool:
        return True

    def refused(self, error: ApiError) -> None:
        # Counted like the gRPC side's streams refused for the same reasons (the status panel shows both APIs).
        code = grpc.StatusCode.NOT_FOUND if error.status == 404 else grpc.StatusCode.INVALID_ARGUMENT
        self.router.metrics.refused(code, PROTOCOL)

    def ready(self) -> bool:
        return self._ready()

    def authorize(self, authorization: str | None, stream: bool) -> bool:
        if not self.tokens:
            return True
        accepted = token_accepted(bearer_token((("authorization", authorization or ""),)), self.tokens)
        if not accepted and stream:
            self.router.metrics.refused(grpc.StatusCode.UNAUTHENTICATED, PROTOCOL)
        return accepted

    async def model_ids(self, admitted: bool = True) -> list[str]:
        if self.served_model_names:  # the MineDraft's names (the engines answer to the same)
            return list(self.served_model_names)
        if self._model_ids is not None and time.monotonic() - self._model_ids_at <= MODEL_IDS_TTL_SECONDS:
            return self._model_ids
        info = await self.router.unary(lambda stub, timeout: stub.GetModelInfo(pb.GetModelInfoRequest(),
                                                                                timeout=timeout), admitted=admitted)
        self._model_ids = [info.model]
        self._model_ids_at = time.monotonic()
        return self._model_ids

    def known_model_ids(self) -> list[str] | None:
        if self.served_model_names:
            return list(self.served_model_names)
        """The cached ids; refreshed in the background when old, never waited for on a request's path (before the
        first answer from any engine, requests' model names go unchecked)."""
        stale = time.monotonic() - self._model_ids_at > MODEL_IDS_TTL_SECONDS
        if (self._model_ids is None or stale) and (self._refresh is None or self._refresh.done()) and self.ready():
            self._refresh = asyncio.get_running_loop().create_task(self._refresh_model_ids())
        return self._model_ids

    async def _refresh_model_ids(self) -> None:
        try:
            await self.model_ids(admitted=False)  # the gateway's own refresh: never a caller's admission slot
        except RouteError as exc:
            log.info("model ids not refreshed: %s", exc)

    def max_streams(self) -> int | None:
        # Every choice takes its own admission slot (what it costs the engines); more than --max-in-flight choices
        # could never all be admitted.
        return self.router.admission.max_in_flight

    def generate(self, request: pb.GenerateRequest, headers: Mapping[str, str], protocol: str,
                 timeout_seconds: float | None) -> AsyncIterator[pb.GenerateResponse]:
        # The router's own generator, not a wrapper: each async-generator layer costs every token a few microseconds.
        # The deadline travels to the engine as the gRPC call's.
        metadata = list(headers.items())
        check_forwarded_headers(forwarded_metadata(metadata))
        return self.router.generate(request, metadata, timeout_seconds, protocol=protocol)


def check_forwarded_headers(forwarded: Sequence[tuple[str, str]]) -> None:
    """The HTTP headers the gateway forwards to the engine as gRPC metadata must be valid metadata: a header gRPC
    would refuse is the caller's error (400, 431), never an engine failure."""
    size_bytes = 0
    for key, value in forwarded:
        if key.endswith("-bin"):
            raise ApiError(400, f"{key}: binary (-bin) headers are not accepted over HTTP", key)
        if not all(" " <= c <= "~" for c in value):
            raise ApiError(400, f"{key}: must be printable ASCII", key)
        # HPACK's accounting (name + value + 32 per entry), as gRPC's metadata size limit counts.
        size_bytes += len(key) + len(value) + 32
    if size_bytes > MAX_FORWARDED_HEADER_BYTES:
        raise ApiError(431, f"the forwarded headers (tracing, x-request-id, minedraft-*) are {size_bytes} bytes; at "
                            f"most {MAX_FORWARDED_HEADER_BYTES}", code="request_header_fields_too_large")


def gateway_http_app(router: Router, ready: Callable[[], bool], tokens: Sequence[bytes] = (),
                     served_model_names: Sequence[str] = (),
                     client_stall_timeout_s: float | None = CLIENT_STALL_TIMEOUT_S,
                     cors_origins: Sequence[str] = ()) -> OpenAiApp:
    return OpenAiApp(GatewayBackend(router, ready, tokens, served_model_names), client_stall_timeout_s, cors_origins)
