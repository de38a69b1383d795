"""The shared drafter service's wire: the session handshake around the drafter's job protocol (protocol.py).

An engine and a drafter service meet over TCP (across pods), so each side proves it holds the same shared token
before any job is taken: a challenge-response with HMAC-SHA256 over both sides' fresh nonces (mutual: the engine
checks the service's proof too, so it never streams its requests' tokens to an impostor). The token itself never
crosses the wire and is never logged. Once authenticated, the connection is a session: the engine's request ids live
in a namespace of their own on the service, and everything else is the local drafter's protocol unchanged (jobs
carry token-id deltas; replies, errors and progress come back), plus heartbeats both ways of liveness and a "busy"
reply for backpressure (protocol.DrafterBusy).

What this does not give: confidentiality. Token ids cross in the clear; on a network where that matters, run the
pods over an encrypted pod network (or a service mesh) — the NetworkPolicy the operator renders admits only engines.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

import msgspec

from minedraft.engine.drafter import protocol
from minedraft.engine.settings import SettingsError

WIRE_VERSION = 1
NONCE_BYTES = 32
# Bounded so an unauthenticated peer cannot make the service allocate without limit (a job of a few thousand
# requests' whole contexts is still far below it).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class Hello(msgspec.Struct, frozen=True, array_like=True, tag="hello"):
    """Engine -> service: open a session."""

    version: int
    engine_name: str
    client_nonce: bytes
    # The engine's longest wait for a job: the service drops (answers busy) jobs that queued longer than this.
    deadline_seconds: float


class Challenge(msgspec.Struct, frozen=True, array_like=True, tag="challenge"):
    server_nonce: bytes


class Auth(msgspec.Struct, frozen=True, array_like=True, tag="auth"):
    mac: bytes


class Welcome(msgspec.Struct, frozen=True, array_like=True, tag="welcome"):
    session_id: str
    # The service's proof that it holds the token too.
    proof: bytes
    model: str
    vocab_size: int
    # The longest context the service's drafter holds (0: no limit it knows of): the engine sends it no request at or
    # past this length, as with a local drafter's Ready.
    max_context_tokens: int = 0


class Rejected(msgspec.Struct, frozen=True, array_like=True, tag="rejected"):
    """The service refuses this peer (failed authentication, wrong version, or a session it does not know: it
    restarted, or dropped the session after a silence). The engine opens a new session."""

    reason: str


class Heartbeat(msgspec.Struct, frozen=True, array_like=True, tag="heartbeat"):
    pass


class HeartbeatAck(msgspec.Struct, frozen=True, array_like=True, tag="heartbeat_ack"):
    queued_jobs: int


class Goodbye(msgspec.Struct, frozen=True, array_like=True, tag="goodbye"):
    """The engine is shutting down: drop its session now instead of after the silence timeout."""


class StatusRequest(msgspec.Struct, frozen=True, array_like=True, tag="status_request"):
    pass


class ServiceStatus(msgspec.Struct, frozen=True, array_like=True, tag="status"):
    sessions: int
    requests_held: int
    queued_jobs: int
    jobs_done: int
    batches: int
    # Batches that carried jobs of more than one session (drafted in one forward).
    shared_batches: int
    busy_replies: int
    sessions_expired: int


ToService = (protocol.DraftJob | protocol.CancelRequests | protocol.CancelJobs | protocol.Shutdown | Hello | Auth
             | Heartbeat | Goodbye | StatusRequest)
FromService = (protocol.DraftReply | protocol.DrafterError | protocol.Progress | protocol.DrafterBusy | Challenge
               | Welcome | Rejected | HeartbeatAck | ServiceStatus)

_encoder = msgspec.msgpack.Encoder()
_to_service = msgspec.msgpack.Decoder(ToService)  # type: ignore[var-annotated]
_from_service = msgspec.msgpack.Decoder(FromService)  # type: ignore[var-annotated]


def encode(message: ToService | FromService) -> bytes:
    return _encoder.encode(message)


def decode_to_service(data: bytes) -> ToService:
    return _to_service.decode(data)  # type: ignore[no-any-return]


def decode_from_service(data: bytes) -> FromService:
    return _from_service.decode(data)  # type: ignore[no-any-return]


# -- authentication ----------------------------------------------------------------------------------------------


class TokenError(SettingsError):
    def __init__(self, message: str) -> None:
        super().__init__("drafter.token_file", message)


def read_token(path: str) -> bytes:
    """The shared token from a file (a mounted Secret in a pod). Errors name the file, never its content."""
    try:
        token = Path(path).read_bytes().strip()
    except OSError as exc:
        raise TokenError(f"{path}: {exc.strerror or exc}") from None
    if len(token) < 16:
        raise TokenError(f"{path}: the token must be at least 16 bytes")
    return token


def read_tokens(path: str) -> tuple[bytes, ...]:
    """Every token of a token file, one per line (blank lines ignored), each at least 16 bytes: the service accepts
    any of them and engines present the first, so a rotation adds the new token before it removes the old one."""
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as exc:
        raise TokenError(f"{path}: {exc.strerror or exc}") from None
    tokens = tuple(line.strip() for line in lines if line.strip())
    if not tokens:
        raise TokenError(f"{path}: holds no token")
    if any(len(token) < 16 for token in tokens):
        raise TokenError(f"{path}: every token must be at least 16 bytes")
    return tokens


class LiveTokens:
    """A token file read again whenever it changes (a mounted Secret is replaced in place by the kubelet at
    rotation): checked on every handshake, so neither the pool nor the engines restart to take a new token. A file
    that turns unreadable or invalid keeps the last good tokens (logged; errors name the file, never a token)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp = self._stat()
        self._tokens = read_tokens(path)  # fails fast at start-up on a bad file

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def accepted(self) -> tuple[bytes, ...]:
        stamp = self._stat()
        if stamp is not None and stamp != self._stamp:
            try:
                self._tokens = read_tokens(self.path)
                self._stamp = stamp
            except TokenError as exc:
                import logging

                logging.getLogger(__name__).warning("keeping the previous drafter tokens: %s", exc)
        return self._tokens

    def presented(self) -> bytes:
        return self.accepted()[0]


def accepted_tokens(token: bytes | LiveTokens) -> tuple[bytes, ...]:
    return token.accepted() if isinstance(token, LiveTokens) else (token,)


def presented_token(token: bytes | LiveTokens) -> bytes:
    return token.presented() if isinstance(token, LiveTokens) else token


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def client_mac(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(token, b"minedraft-drafter/engine\0" + client_nonce + server_nonce, hashlib.sha256).digest()


def server_proof(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    # A different label from client_mac: the service's answer can never be replayed as an engine's, or back.
    return hmac.new(token, b"minedraft-drafter/service\0" + server_nonce + client_nonce, hashlib.sha256).digest()


def verify(expected: bytes, given: bytes) -> bool:
    return hmac.compare_digest(expected, given)

