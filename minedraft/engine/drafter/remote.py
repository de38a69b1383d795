"""The engine's side of a shared drafter service (`minedraft serve --drafter-address HOST:PORT`).

RemoteDrafterClient stands where DrafterClient stands (link.DrafterLink and the scheduler use either): the
same submit/cancel/receive calls and the same states, over an authenticated TCP session instead of a child process.
Its "start" is a new session: the service then holds none of this engine's tokens, exactly as after a local
drafter's restart, so the scheduler's restart path (full contexts on the next job) applies unchanged.

Liveness: the engine heartbeats the service and expects an answer; a service that answers nothing for
`service_timeout_seconds` (killed, hung, partitioned) is down, and the engine serves without drafts while it
reconnects with back-off. A service that restarted answers "unknown session" and the engine opens a new one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket as std_socket
import time
from collections.abc import Callable

import zmq

from minedraft.engine.drafter import protocol, wire
from minedraft.engine.drafter.client import DrafterState, JobMessages
from minedraft.engine.settings import parse_address

log = logging.getLogger(__name__)


class RemoteDrafterClient(JobMessages):
    """A session with a drafter service over a ZMQ DEALER socket; single-threaded (the scheduler's thread)."""

    def __init__(self, address: str, token: bytes | wire.LiveTokens, engine_name: str | None = None,
                 deadline_seconds: float = 5.0,
                 heartbeat_seconds: float = 1.0, service_timeout_seconds: float = 5.0,
                 connect_timeout_seconds: float = 5.0, max_backoff_seconds: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        host, port = parse_address(address)
        self.address = address
        self._endpoint = f"tcp://{host}:{port}"
        self._tokens = token
        # The token of this session: the file's first, read again at every new session (after a rotation).
        self._token = wire.presented_token(token)
        self.engine_name = engine_name or f"{std_socket.gethostname()}:{os.getpid()}"
        self._deadline_seconds = deadline_seconds
        self._heartbeat_seconds = heartbeat_seconds
        self.service_timeout_seconds = service_timeout_seconds
        self._connect_timeout_seconds = connect_timeout_seconds
        self._max_backoff_seconds = max_backoff_seconds
        self._clock = clock
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._client_nonce = b""
        self._pending_server_nonce = b""
        self._hello_sent = False
        self._next_job_id = 1
        self._connect_started_at = 0.0
        # The service drafter's length limit (its Welcome; 0: none known), read by the scheduler like a local Ready's.
        self.max_context_tokens = 0
        self._last_heard_at = 0.0
        self._last_heartbeat_at = 0.0
        self._consecutive_failures = 0
        self._next_start_at = 0.0
        self._closed = False
        self.state = DrafterState.DOWN
        self.session_id: str | None = None
        self.service_model: str | None = None
        self.num_starts = 0
        self.num_restarts = 0
        self.num_busy = 0
        self.startup_seconds: float | None = None
        self.last_error: str | None = None
        self.last_status: wire.ServiceStatus | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Open a new session (connect and say hello) without waiting for it."""
        self._close_socket()
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        # Queue nothing for a peer that is not connected: a send then fails at once and the engine treats the service
        # as down, instead of piling jobs up for a service that may never come back.
        socket.setsockopt(zmq.IMMEDIATE, 1)
        socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        socket.setsockopt(zmq.RECONNECT_IVL, 100)
        socket.connect(self._endpoint)
        self._socket = socket
        self._client_nonce = wire.new_nonce()
        self._token = wire.presented_token(self._tokens)
        self.num_starts += 1
        self._connect_started_at = self._clock()
        self.state = DrafterState.STARTING
        self.session_id = None
        self._hello_sent = False
        self._send_hello()

    def _send_hello(self) -> None:
        assert self._socket is not None
        try:
            self._socket.send(wire.encode(wire.Hello(wire.WIRE_VERSION, self.engine_name, self._client_nonce,
                                                     self._deadline_seconds)), zmq.NOBLOCK)
            self._hello_sent = True
        except zmq.Again:
            pass  # not connected yet: retried from check_alive

    def wait_ready(self, timeout_seconds: float) -> bool:
        deadline = time.monotonic() + timeout_seconds
        while self.state is not DrafterState.UP and time.monotonic() < deadline:
            self.check_alive()
            for message in self.receive(timeout_seconds=0.1):
                log.debug("unexpected drafter service message while connecting: %r", message)
            if self._socket is None:
                time.sleep(0.1)
        return self.state is DrafterState.UP

    def kill(self, wait: bool = True) -> None:
        """Drop the connection at once (no goodbye): the service times the session out."""
        self._close_socket()
        self.state = DrafterState.DOWN

    def pid(self) -> int | None:
        return None

    def shutdown(self) -> None:
        if self._socket is not None and self.state is DrafterState.UP:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.send(wire.encode(wire.Goodbye()), zmq.NOBLOCK)
        self._closed = True
        self._close_socket()
        self.state = DrafterState.DOWN

    def _close_socket(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    # -- health ------------------------------------------------------------------------------------------------

    def check_alive(self) -> bool:
        """Heartbeat; notice a silent service or a handshake that does not finish; reconnect with back-off."""
        if self._closed:
            return False
        now = self._clock()
        if self._socket is None:
            if now >= self._next_start_at:
                self.num_restarts += self.num_starts > 0
                self.start()
            return False
        if self.state is DrafterState.STARTING:
            if not self._hello_sent:
                self._send_hello()
            if now - self._connect_started_at > self._connect_timeout_seconds:
                self._down(f"no session with the drafter service at {self.address} within "
                           f"{self._connect_timeout_seconds:g}s")
            return False
        if self.state is DrafterState.UP:
            if now - self._last_heartbeat_at > self.service_timeout_seconds:
                # No step checked in for that long (an idle engine steps nothing): the silence is this engine's, not
                # the service's. Ask again before judging it (a service that dropped the session answers so).
                self._last_heard_at = now
            if now - self._last_heard_at > self.service_timeout_seconds:
                self._down(f"drafter service at {self.address} silent for {now - self._last_heard_at:.1f}s")
                return False
            if now - self._last_heartbeat_at >= self._heartbeat_seconds:
                self._last_heartbeat_at = now
                self._send(wire.Heartbeat())
        return self.state is DrafterState.UP

    def _down(self, reason: str) -> None:
        if self.state is not DrafterState.DOWN:
            log.error("%s; serving without drafts", reason)
        self.last_error = reason
        self.state = DrafterState.DOWN
        self._close_socket()
        self._consecutive_failures += 1
        backoff = min(self._max_backoff_seconds, 0.25 * 2.0 ** (self._consecutive_failures - 1))
        self._next_start_at = self._clock() + backoff

    def mark_hung(self, reason: str) -> None:
        self._down(f"drafter service hung ({reason})")
        self.check_alive()

    # -- messages (submit, cancel and cancel_jobs come from JobMessages) ----------------------------------------

    def request_status(self) -> None:
        """Ask the service for its status (answered as last_status)."""
        if self.state is DrafterState.UP:
            self._send(wire.StatusRequest())

    def _send(self, message: wire.ToService) -> bool:
        if self._socket is None:
            return False
        try:
            self._socket.send(wire.encode(message), zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            self._down(f"drafter service at {self.address} not accepting messages")
            return False

    def receive(self, timeout_seconds: float) -> list[protocol.FromDrafter]:
        """The job protocol's messages available within the timeout; session messages are handled here."""
        if self._socket is None:
            if timeout_seconds > 0:
                time.sleep(min(timeout_seconds, 0.05))
            return []
        messages: list[protocol.FromDrafter] = []
        timeout_ms = max(0, int(timeout_seconds * 1000))
        while self._socket is not None and self._socket.poll(timeout_ms if not messages else 0):
            try:
                message = wire.decode_from_service(self._socket.recv())
            except Exception:  # a malformed message is the peer's fault, not a reason to stop
                log.warning("malformed message from the drafter service ignored")
                continue
            self._last_heard_at = self._clock()
            if isinstance(message, wire.Challenge):
                if self.state is DrafterState.STARTING:
                    mac = wire.client_mac(self._token, self._client_nonce, message.server_nonce)
                    self._pending_server_nonce = message.server_nonce
                    self._send(wire.Auth(mac))
            elif isinstance(message, wire.Welcome):
                self._welcome(message)
            elif isinstance(message, wire.Rejected):
                if self.state is DrafterState.UP:
                    # The session is gone on the service's side (it restarted, or dropped this engine after an idle
                    # spell): open a new one at once; the new session starts from whole contexts.
                    log.info("drafter service at %s: %s; opening a new session", self.address, message.reason)
                    self.start()
                    break
                self._down(f"drafter service at {self.address} refused the session: {message.reason}")
            elif isinstance(message, wire.HeartbeatAck):
                pass
            elif isinstance(message, wire.ServiceStatus):
                self.last_status = message
            else:
                if isinstance(message, protocol.DrafterBusy):
                    self.num_busy += 1
                messages.append(message)
            if timeout_ms and not messages and self.state is not DrafterState.UP:
                timeout_ms = 0
        return messages

    def _welcome(self, message: wire.Welcome) -> None:
        if self.state is not DrafterState.STARTING:
            return
        proof = wire.server_proof(self._token, self._client_nonce, self._pending_server_nonce)
        if not wire.verify(proof, message.proof):
            self._down(f"drafter service at {self.address} failed authentication (its token differs)")
            return
        self.state = DrafterState.UP
        self.session_id = message.session_id
        self.service_model = message.model
        self.max_context_tokens = int(message.max_context_tokens)
        self._consecutive_failures = 0
        self._last_heartbeat_at = self._clock()
        self.startup_seconds = self._clock() - self._connect_started_at
        log.info("drafter service at %s: session %s (%s)", self.address, message.session_id, message.model)
