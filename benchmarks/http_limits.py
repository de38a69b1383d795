"""Hostile HTTP heads against both HTTP ports (gateway, engine server), bounded (this code) and unbounded (uvicorn's
plain httptools protocol), side by side in one run.

Each server runs in a process of its own: the gateway over a fake engine (minedraft.testing.fake_engine) in the same
process, the engine server (EngineServer, its real HTTP front end) over a stub engine that streams a token every
10 ms. Per server and variant:
- one 1 MiB header: the seconds until the answer (431 when bounded) and the status;
- 16 such requests at once while one SSE stream runs (a token every 10 ms): the stream's longest gap between chunks
  during the burst, against its longest gap in a quiet period just before;
- a half-sent head: the seconds until the server closes the connection (the head timeout, 10 s by default).
The unbounded variant has no head timeout: its half-sent request is given up on after 15 s.

Usage (from the repository root): python benchmarks/http_limits.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

HEADER_BYTES = 1 << 20
BURST = 16
TOKEN_INTERVAL_S = 0.01
HALF_SENT_GIVE_UP_S = 15.0
STREAM_SECONDS = 8.0


# -- the servers (run with --serve) ------------------------------------------------------------------------------

class StubEngine:
    """The ServingEngine surface the engine server uses: a token every TOKEN_INTERVAL_S, no model."""

    in_process = True

    def __init__(self) -> None:
        from minedraft.engine.settings import DrafterSettings, EngineSettings

        self.settings = EngineSettings(model="stub", drafter=DrafterSettings(model="stub-draft"))
        self.tokenizer = None
        self.vocab_size = 1000
        self.max_model_len = 4096
        self.startup_seconds = 0.0
        self.num_in_flight = 0
        self.dead_error = None

    async def generate(self, prompt: Any, sampling: Any, request_id: str | None = None) -> AsyncIterator[Any]:
        from minedraft.engine.requests import OutputDelta

        for i in range(sampling.max_tokens):
            await asyncio.sleep(TOKEN_INTERVAL_S)
            last = i == sampling.max_tokens - 1
            yield OutputDelta(request_id or "", [i % 1000], "t", "length" if last else None, 1, i + 1)

    async def abort(self, request_id: str) -> None:
        pass

    async def call(self, fn: Any) -> Any:
        return fn(self) if fn.__name__ != "load" else (0, 0)

    async def shutdown(self, shutdown_engine: bool = True) -> None:
        pass


async def _serve(kind: str, unbounded: bool) -> None:
    if unbounded:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        from minedraft.openai_api import server as server_module

        server_module.bounded_protocol = lambda limits: HttpToolsProtocol  # type: ignore[assignment,return-value]
    if kind == "gateway":
        from minedraft.gateway.app import Gateway, GatewayConfig
        from minedraft.testing.fake_engine import FakeBehaviour, FakeEngineServer

        engine = await FakeEngineServer(behaviour=FakeBehaviour(token_interval_seconds=TOKEN_INTERVAL_S)).start()
        gateway = Gateway(GatewayConfig())
        gateway.set_engines([engine.address])
        await gateway.start()
        port = await gateway.start_http("127.0.0.1", 0)
    else:
        from minedraft.server.app import EngineServer

        server = EngineServer(served_model_names=("stub",))
        await server.start()
        port = await server.start_http("127.0.0.1", 0)
        await server.attach(StubEngine())  # type: ignore[arg-type]
    print(port, flush=True)
    await asyncio.Event().wait()


# -- the clients ------------------------------------------------------------------------------------------------

def _stream(port: int, seconds: float) -> None:
    """One SSE stream for `seconds`, in a process of its own (the hostile senders' work must not delay its reads);
    prints the monotonic time of every read, as JSON."""
    body = json.dumps({"model": "stub", "prompt": [1, 2, 3], "max_tokens": 3000, "stream": True}).encode()
    marks: list[float] = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        end = time.monotonic() + seconds
        sock.settimeout(1.0)
        while time.monotonic() < end:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                break
            marks.append(time.monotonic())
    print(json.dumps(marks), flush=True)


async def _hostile(port: int) -> tuple[float, int | None]:
    """One 1 MiB header: seconds until the answer (or the connection's end) and its status (None: no answer)."""
    head = b"GET /v1/models HTTP/1.1\r\nHost: b\r\nX-Big: " + b"x" * HEADER_BYTES + b"\r\n\r\n"
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    with contextlib.suppress(ConnectionError):
        writer.write(head)
        await writer.drain()
    status = None
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        line = await asyncio.wait_for(reader.readline(), 30)
        if line:
            status = int(line.split()[1])
    elapsed = time.perf_counter() - started
    writer.close()
    return elapsed, status


async def _half_sent(port: int) -> float:
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: b\r\nX-Slow: ")
    await writer.drain()
    with contextlib.suppress(TimeoutError, ConnectionError):
        await asyncio.wait_for(reader.read(), HALF_SENT_GIVE_UP_S)  # EOF: closed by the server
    writer.close()
    return time.perf_counter() - started


def _max_gap(marks: list[float], start: float, end: float) -> float:
    inside = [m for m in marks if start <= m <= end]
    before = [m for m in marks if m < start]
    points = ([before[-1]] if before else []) + inside
    return max((b - a for a, b in itertools.pairwise(points)), default=float("nan"))


async def _measure(port: int) -> dict[str, Any]:
    reader = subprocess.Popen([sys.executable, __file__, "--stream", str(port)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    await asyncio.sleep(1.5)
    quiet_start = time.monotonic()
    await asyncio.sleep(1.5)
    quiet_end = time.monotonic()
    single_s, single_status = await _hostile(port)
    await asyncio.sleep(0.5)
    burst_start = time.monotonic()
    burst = await asyncio.gather(*(_hostile(port) for _ in range(BURST)))
    burst_end = time.monotonic()
    out, _ = await asyncio.to_thread(reader.communicate)
    marks = json.loads(out)
    half_sent_s = await _half_sent(port)
    return {"single_1mib_header_seconds": round(single_s, 4), "single_status": single_status,
            "burst_statuses": sorted({s for _, s in burst}, key=str),
            "burst_slowest_answer_seconds": round(max(s for s, _ in burst), 4),
            "stream_max_gap_quiet_ms": round(_max_gap(marks, quiet_start, quiet_end) * 1000, 1),
            "stream_max_gap_during_burst_ms": round(_max_gap(marks, burst_start, burst_end) * 1000, 1),
            "half_sent_closed_after_seconds": round(half_sent_s, 2)}


def _start(kind: str, unbounded: bool) -> tuple[subprocess.Popen[str], int]:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    process = subprocess.Popen([sys.executable, __file__, "--serve", kind, *(["--unbounded"] if unbounded else [])],
                               stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout is not None
    return process, int(process.stdout.readline())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--serve", choices=("gateway", "engine"), help=argparse.SUPPRESS)
    parser.add_argument("--unbounded", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stream", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stream:
        _stream(args.stream, STREAM_SECONDS)
        return 0
    if args.serve:
        asyncio.run(_serve(args.serve, args.unbounded))
        return 0
    results: dict[str, Any] = {"host": socket.gethostname(), "cpus": os.cpu_count()}
    for kind in ("gateway", "engine"):
        for unbounded in (False, True):
            process, port = _start(kind, unbounded)
            try:
                result = asyncio.run(_measure(port))
            finally:
                process.kill()
                process.wait()
            name = f"{kind}-{'unbounded' if unbounded else 'bounded'}"
            results[name] = result
            print(name, json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
