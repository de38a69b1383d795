"""uvicorn inside the process's own asyncio loop, beside the gRPC server: bind (port 0 allowed), start, stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Generator
from pathlib import Path
from typing import Any

import uvicorn
from starlette.types import ASGIApp

log = logging.getLogger(__name__)

# Thousands of SSE streams stay open at once; the kernel's default accept backlog would drop a burst of them.
BACKLOG = 4096


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # The process's own SIGTERM handling drains the gRPC and HTTP servers together; uvicorn must not take the
        # signals over.
        yield


class HttpServer:
    """One uvicorn server for `app` in the running loop."""

    def __init__(self, app: ASGIApp, cert_file: Path | None = None, key_file: Path | None = None) -> None:
        self.app = app
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
            http="httptools", ws="none", loop="none", timeout_graceful_shutdown=1,
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
