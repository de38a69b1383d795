"""Bearer tokens between the gateway and the engines: files re-read when the kubelet updates them, a server
interceptor that makes an engine's gRPC port refuse unauthenticated callers, and a client interceptor with which the
gateway presents its credential on every call.

Without these, only a NetworkPolicy keeps other pods off the engines, and many clusters do not enforce
NetworkPolicy: a gateway's auth could be walked around by calling an engine directly. The engine and the gateway
mount the same Secret; the kubelet updates a mounted Secret in place (an atomic swap of the volume's data
directory), so a token is read again whenever its file changed, never cached for the life of the process.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

# Health (kubelet probes, the gateway's engine watch: no credentials) and reflection stay open: neither serves a
# model.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def bearer_token(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The token of an `authorization: Bearer <token>` header, if any."""
    for key, value in metadata:
        if key.lower() == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def token_accepted(presented: str | None, accepted: Sequence[bytes]) -> bool:
    """Constant-time comparison against every accepted token."""
    if presented is None or not accepted:
        return False
    candidate = presented.encode()
    matched = False
    for token in accepted:
        matched |= hmac.compare_digest(candidate, token)
    return matched


def parse_tokens(text: str, comma_separated: bool = False) -> tuple[bytes, ...]:
    """The tokens of a file (one per line; blank lines and lines starting with # skipped) or of an environment
    variable (`comma_separated`). A token is kept whole: a `#` or `,` inside a file's token is part of it. A token
    with whitespace or a control character in it could never be presented (`Authorization: Bearer <token>`) and is
    refused (ValueError naming the entry), never shortened or split."""
    if comma_separated:
        entries = [(f"entry {i + 1}", part.strip()) for i, part in enumerate(text.split(","))]
    else:
        entries = [(f"line {i + 1}", line.strip()) for i, line in enumerate(text.splitlines())
                   if not line.lstrip().startswith("#")]
    tokens = []
    for where, token in entries:
        if not token:
            continue
        if not all("!" <= c <= "~" for c in token):
            raise ValueError(f"{where}: a token must be printable ASCII without spaces")
        tokens.append(token.encode())
    return tuple(tokens)


def files_signature(*paths: str | Path) -> tuple[tuple[int, int, int], ...] | None:
    """What identifies the current content of files (inode, size, modification time; the kubelet's update of a
    Secret volume swaps in new files); None when one cannot be read (mid-swap)."""
    try:
        return tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in map(os.stat, paths))
    except OSError:
        return None


class LiveTokens(Sequence[bytes]):
    """A token list read anew at each use (from TokenFile.tokens plus fixed ones): where a tuple of tokens was
    taken, this follows rotations of the file."""

    def __init__(self, source: Callable[[], Sequence[bytes]], fixed: Sequence[bytes] = ()) -> None:
        self._source = source
        self._fixed = tuple(fixed)

    def _all(self) -> tuple[bytes, ...]:
        return (*self._source(), *self._fixed)

    def __len__(self) -> int:
        return len(self._all())

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._all())

    def __getitem__(self, index: Any) -> Any:
        return self._all()[index]


class TokenFile:
    """The tokens of a file, read again when the file changed (its inode, size or modification time: the kubelet's
    update of a Secret volume swaps a symlink to a new file). A read that fails or finds no token keeps the last good
    tokens (mid-swap), after a first read that must succeed."""

    def __init__(self, path: str | Path, flag: str = "token-file") -> None:
        self.path = Path(path)
        self.flag = flag
        self._signature: tuple[int, int, int] | None = None
        self._tokens: tuple[bytes, ...] = ()
        if not self._reload():
            raise ValueError(f"{flag}: {self.path} holds no tokens or cannot be read")

    def _reload(self) -> bool:
        try:
            stat = os.stat(self.path)
            signature = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
            if signature == self._signature:
                return True
            tokens = parse_tokens(self.path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("%s: cannot read %s: %s (keeping the previous tokens)", self.flag, self.path, exc)
            return bool(self._tokens)
        if not tokens:
            log.warning("%s: %s holds no tokens (keeping the previous ones)", self.flag, self.path)
            return bool(self._tokens)
        if self._signature is not None:
            log.info("%s: %s changed, tokens reloaded", self.flag, self.path)
        self._signature, self._tokens = signature, tokens
        return True

    def tokens(self) -> tuple[bytes, ...]:
        self._reload()
        return self._tokens

    def first(self) -> str:
        """The token to present as a client (the first of the file)."""
        return self.tokens()[0].decode()


def token_files(paths: Sequence[str | Path], flag: str = "token-file") -> Callable[[], tuple[bytes, ...]]:
    """Every token of several files (each re-read when it changes): a caller presenting any of them is accepted. An
    upgrade's mixed fleet needs two: the new credential and the one the previous release's callers present."""
    files = [TokenFile(path, flag) for path in paths]
    return lambda: tuple(token for file in files for token in file.tokens())


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuse every call but health and reflection without an accepted bearer token (UNAUTHENTICATED)."""

    def __init__(self, tokens: Callable[[], Sequence[bytes]]) -> None:
        self._tokens = tokens

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        method = str(handler_call_details.method or "")
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        if token_accepted(bearer_token(handler_call_details.invocation_metadata or ()), self._tokens()):
            return handler

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid bearer token is required")

        kind = ("unary_stream" if handler.unary_stream else "stream_stream" if handler.stream_stream
                else "stream_unary" if handler.stream_unary else "unary_unary")
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(deny, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


def _with_token(details: Any, token: str) -> Any:
    metadata = [(k, v) for k, v in (details.metadata or ()) if k.lower() != "authorization"]
    metadata.append(("authorization", f"Bearer {token}"))
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: Callable[[], str]) -> None:
        self._token = token

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_token(client_call_details, self._token()), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: Callable[[], str]) -> None:
        self._token = token

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_token(client_call_details, self._token()), request)


def client_interceptors(token: Callable[[], str]) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for a channel that present `token()` (read per call: rotation) as a bearer token."""
    return [_UnaryUnary(token), _UnaryStream(token)]
