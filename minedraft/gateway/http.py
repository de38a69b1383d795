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
from minedraft.gateway.policy import bearer_token, token_accepted
from minedraft.gateway.router import RouteError, Router
from minedraft.openai_api.app import PROTOCOL, BackendError, OpenAiApp
from minedraft.openai_api.protocol import ApiError

log = logging.getLogger(__name__)

# Trailing metadata naming the invalid field of an engine's INVALID_ARGUMENT (set by the engine server).
INVALID_FIELD_KEY = "minedraft-invalid-field"
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
        field = dict(error.trailing_metadata).get(INVALID_FIELD_KEY)
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

    async def model_ids(self) -> list[str]:
        if self.served_model_names:  # the MineDraft's names (the engines answer to the same)
            return list(self.served_model_names)
        if self._model_ids is not None and time.monotonic() - self._model_ids_at <= MODEL_IDS_TTL_SECONDS:
            return self._model_ids
        info = await self.router.unary(lambda stub, timeout: stub.GetModelInfo(pb.GetModelInfoRequest(),
                                                                                timeout=timeout))
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
            await self.model_ids()
        except RouteError as exc:
            log.info("model ids not refreshed: %s", exc)

    def generate(self, request: pb.GenerateRequest, headers: Mapping[str, str], protocol: str,
                 timeout_seconds: float | None) -> AsyncIterator[pb.GenerateResponse]:
        # The router's own generator, not a wrapper: each async-generator layer costs every token a few microseconds.
        # The deadline travels to the engine as the gRPC call's.
        return self.router.generate(request, list(headers.items()), timeout_seconds, protocol=protocol)


def gateway_http_app(router: Router, ready: Callable[[], bool], tokens: Sequence[bytes] = (),
                     served_model_names: Sequence[str] = ()) -> OpenAiApp:
    return OpenAiApp(GatewayBackend(router, ready, tokens, served_model_names))
