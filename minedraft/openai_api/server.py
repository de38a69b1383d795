"""uvicorn inside the process's own asyncio loop, beside the gRPC server: bind (port 0 allowed), start, stop.

The HTTP/1.1 protocol is uvicorn's httptools one with bounds of its own (`HttpLimits`): a request head (request
line and headers) over `max_head_bytes` or with more than `max_header_count` fields is answered 431, a head not
complete within `head_timeout_s` or a body not complete within `body_timeout_s` is answered 408, each before the
application (and so auth, parsing or routing) runs or goes on, and the connection is closed. uvicorn itself bounds
none of these with httptools (its h11 protocol bounds the head's size only, answering 400), and httptools buffers
a header of any size, at a cost that grows faster than its size.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httptools
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

# Thousands of SSE streams stay open at once; the kernel's default accept backlog would drop a burst of them.
BACKLOG = 4096


# The scope extension through which the application closes its connection at once (`transport.abort`), unsent data
# and all: a response cut because its client stopped reading would otherwise keep the socket (and its kernel buffer)
# until the client reads, since a graceful close waits for the buffer to drain.
ABORT_EXTENSION = "minedraft.abort_connection"


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Bounds on what a client may send before the application sees a request (one object for both HTTP ports)."""

    # Request line plus header fields, in bytes (Node's default is 16 KiB, nginx's up to 32 KiB).
    max_head_bytes: int = 32 * 1024
    max_header_count: int = 100
    # From the connection (or a keep-alive request's first byte) to the end of the head.
    head_timeout_s: float = 10.0
    # From the end of the head to the end of the body (at most 8 MiB is read).
    body_timeout_s: float = 60.0
    # After a refusal, what the client still sends is read and dropped this long at most, so that it reads the
    # answer (closing with unread data makes the kernel reset the connection, and the client may lose the answer).
    linger_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("max_head_bytes", "max_header_count", "head_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.linger_s < 0:
            raise ValueError(f"linger_s: must be >= 0, got {self.linger_s}")


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
_CODES = {400: "invalid_request", 408: "request_timeout", 431: "request_header_fields_too_large"}


def refusal_bytes(status: int, message: str) -> bytes:
    """A complete HTTP/1.1 answer with an OpenAI error body, closing the connection."""
    from minedraft.openai_api.protocol import ApiError, encode

    body = encode(ApiError(status, message, code=_CODES[status]).body())
    return b"".join([b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status]), b"content-type: application/json\r\n",
                     b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body])


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with `HttpLimits` (a subclass per server binds them: `bounded_protocol`).

    A head is held to `max_head_bytes` twice over: what the parser has parsed of it (the URL and each header field,
    counted in the parser's callbacks, exact wherever the head began: a pipelined head arrives in the same read as the
    end of the request before it), and the raw bytes fed while a head is being received, at most `max_head_bytes` at
    a time, so an oversized head costs its first bytes, never a buffered megabyte.

    One timer runs while a head or a body is being received, and it belongs to that request: a request pipelined
    behind another's response gets its body timer when the server turns to it, and a refusal of a request whose
    head is still arriving while an earlier response runs waits until that response is complete (the response is
    another request's: never cut, never interleaved with a refusal)."""

    limits = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0  # raw bytes fed while receiving this head
        self._parsed_head_bytes = 0  # this head's URL and header fields, as parsed
        self._header_count = 0
        self._refused = False
        self._timer: asyncio.TimerHandle | None = None
        # The request whose body is being received, from its head's end to its message's end.
        self._body_cycle: Any = None
        # A refusal held back until the response under way (an earlier request's) is complete.
        self._deferred: tuple[int, str] | None = None

    # -- timers ---------------------------------------------------------------------------------------------------

    def _arm(self, seconds: float, status: int, message: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._refuse, status, message)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._arm(self.limits.head_timeout_s, 408,
                  f"the request head was not received within {self.limits.head_timeout_s:g} s")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:  # type: ignore[override]
        if self._refused and self._deferred is None:
            self.transport.close()  # the client is done sending: the answer is out, close now
        return None

    # -- parsing --------------------------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering after a refusal: dropped
        self._unset_keepalive_if_required()
        view = memoryview(data)
        while view:
            if not self._in_head:
                self._feed(view)
                return
            if self._timer is None:  # a keep-alive connection's next request begins
                self._arm_head_timer()
            room = self.limits.max_head_bytes - self._head_bytes
            if room <= 0:
                self._refuse(431, f"the request head is over {self.limits.max_head_bytes} bytes")
                return
            part, view = view[:room], view[room:]
            self._head_bytes += len(part)
            if not self._feed(part):
                return

    def _feed(self, data: memoryview) -> bool:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            refusal = exc.__context__
            if isinstance(refusal, _Refused):
                self._refuse(refusal.status, refusal.message)
            else:
                self.logger.warning("Invalid HTTP request received.")
                self._refuse(400, "invalid HTTP request")
            return False
        except httptools.HttpParserError:
            self._refuse(400, "invalid HTTP request")
            return False
        except httptools.HttpParserUpgrade:
            self._unsupported_upgrade_warning()  # no protocol upgrades are served (ws="none")
            return False
        return not self._refused

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._parsed_head_bytes = 0
        self._header_count = 0
        if self._timer is None:  # a pipelined request, begun in the same data as the end of the one before
            self._arm_head_timer()

    def _count_head(self, size: int) -> None:
        self._parsed_head_bytes += size
        if self._parsed_head_bytes > self.limits.max_head_bytes:
            raise _Refused(431, f"the request head is over {self.limits.max_head_bytes} bytes")

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))  # called once per piece of the URL a read holds
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_header_count:
            raise _Refused(431, f"the request has over {self.limits.max_header_count} header fields")
        self._count_head(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        super().on_headers_complete()
        self._body_cycle = self.cycle
        if not self._queued(self.cycle):
            self._arm_body_timer()
        # else: pipelined behind a response under way; its body timer starts when the server turns to it.
        # The application can close this connection at once (ABORT_EXTENSION).
        self.scope.setdefault("extensions", {})[ABORT_EXTENSION] = {"abort": self.transport.abort}  # type: ignore[index]

    def _queued(self, cycle: Any) -> bool:
        return any(queued is cycle for queued, _ in self.pipeline)

    def _arm_body_timer(self) -> None:
        self._arm(self.limits.body_timeout_s, 408,
                  f"the request body was not received within {self.limits.body_timeout_s:g} s")

    def on_message_complete(self) -> None:
        self._disarm()
        self._body_cycle = None
        self._in_head = True
        self._head_bytes = 0
        self._parsed_head_bytes = 0
        self._header_count = 0
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts the next pipelined request, if any
        if self.transport.is_closing():
            return
        if self._deferred is not None:
            status, message = self._deferred
            self._deferred, self._refused = None, False
            self._refuse(status, message)  # held back again if another response is under way now
        elif self._body_cycle is not None and self._timer is None and not self._queued(self._body_cycle):
            self._arm_body_timer()  # the server turned to a pipelined request whose body is still to come

    # -- refusals -------------------------------------------------------------------------------------------------

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` (unless a response is under way: then just close) and close the connection."""
        self._disarm()
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        cycle = self.cycle
        if self._in_head and cycle is not None and not cycle.response_complete:
            # The head of a pipelined request is refused while an earlier request's response is under way: that
            # response runs to its end; this answer follows it (on_response_complete). Nothing more is read.
            self._deferred = (status, message)
            self.flow.pause_reading()
            return
        if cycle is not None and not cycle.response_complete:
            # The application is waiting for this body: it reads a disconnect, and its answer goes nowhere.
            cycle.disconnected = True
            cycle.message_event.set()
            if cycle.response_started:
                self.transport.abort()
                return
        elif not self._in_head:
            # The request was answered before its body arrived (a 401, a 413): nothing more to say.
            self.transport.close()
            return
        log.info("HTTP request from %s refused (%d): %s", self.client, status, message)
        self.transport.write(refusal_bytes(status, message))
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the answer is complete: the client reads it and then the end
        self.flow.resume_reading()
        if self.limits.linger_s > 0:
            self.loop.call_later(self.limits.linger_s, self.transport.close)
        else:
            self.transport.close()


def bounded_protocol(limits: HttpLimits) -> type[BoundedHttpToolsProtocol]:
    """The protocol class uvicorn builds per connection, bound to `limits`."""
    return type("BoundedHttpToolsProtocol", (BoundedHttpToolsProtocol,), {"limits": limits})


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # The process's own SIGTERM handling drains the gRPC and HTTP servers together; uvicorn must not take the
        # signals over.
        yield


class HttpServer:
    """One uvicorn server for `app` in the running loop."""

    def __init__(self, app: ASGIApp, cert_file: Path | None = None, key_file: Path | None = None,
                 limits: HttpLimits | None = None) -> None:
        self.app = app
        self.limits = limits or HttpLimits()
        self.cert_file = cert_file
        self.key_file = key_file
        self.port: int | None = None
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int) -> int:
        """Bind host:port (0: any free port) and serve; returns the bound port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.set_inheritable(True)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, lifespan="off", log_level="warning", access_log=False, backlog=BACKLOG,
            http=bounded_protocol(self.limits), ws="none", loop="none", timeout_graceful_shutdown=1,
            ssl_certfile=str(self.cert_file) if self.cert_file else None,
            ssl_keyfile=str(self.key_file) if self.key_file else None,
            # Streams are idle between tokens for as long as the engine takes: keep-alive applies between requests.
            timeout_keep_alive=30)
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name=f"http :{self.port}")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # startup failed: raise its error
                raise OSError(f"HTTP server on {host}:{port} stopped while starting")
            await asyncio.sleep(0.01)
        if self._server.config.ssl is not None:
            self._follow_certificate_files(self._server.config.ssl)
        log.info("HTTP (OpenAI API) on %s:%d (%s)", host, self.port, "TLS" if self.cert_file else "plaintext")
        return self.port

    def _follow_certificate_files(self, context: ssl.SSLContext) -> None:
        """Serve a renewed certificate when its files change (a mounted Secret updated by the kubelet): checked at
        each handshake (a stat of two files), in effect from that handshake on (the connection moves to a context
        with the new pair, made as uvicorn makes its own)."""
        from minedraft.api.auth import files_signature

        assert self.cert_file is not None and self.key_file is not None and self._server is not None
        cert, key, config = self.cert_file, self.key_file, self._server.config
        signature = files_signature(cert, key)
        current = context

        def on_hello(sock: Any, server_name: str | None, _: ssl.SSLContext) -> None:
            nonlocal signature, current
            now = files_signature(cert, key)
            if now is not None and now != signature:
                try:
                    renewed = ssl.SSLContext(config.ssl_version)
                    renewed.load_cert_chain(cert, key)
                    renewed.verify_mode = ssl.VerifyMode(config.ssl_cert_reqs)
                    if config.ssl_ciphers:
                        renewed.set_ciphers(config.ssl_ciphers)
                except (OSError, ssl.SSLError) as exc:
                    log.warning("TLS files changed but do not load (keeping the previous pair): %s", exc)
                else:
                    signature, current = now, renewed
                    log.info("TLS certificate reloaded from %s", cert)
            if current is not context:
                sock.context = current

        context.sni_callback = on_hello

    async def stop(self) -> None:
        """Stop accepting, close connections (open streams are cancelled after a second), wait for the server."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._server = None
