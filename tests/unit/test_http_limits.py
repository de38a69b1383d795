"""The HTTP ports' own bounds (minedraft.openai_api.server.HttpLimits) over a real loopback socket: an oversized head
or too many header fields is a 431, a head or body not sent in time a 408, each before the application runs (so before
auth and any work), and the connection is closed. Well-behaved requests, keep-alive and long streams are untouched."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from minedraft.openai_api.server import ABORT_EXTENSION, HttpLimits, HttpServer

LIMITS = HttpLimits(max_head_bytes=8 * 1024, max_header_count=20, head_timeout_s=0.5, body_timeout_s=0.5,
                    linger_s=0.5)


class RecordingApp:
    """Answers every request with its body's length; records what reached it."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.disconnects = 0
        self.extensions: list[object] = []

    async def __call__(self, scope, receive, send) -> None:
        self.calls.append(scope["path"])
        self.extensions.append(scope.get("extensions", {}).get(ABORT_EXTENSION))
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnects += 1
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            for _ in range(4):
                await asyncio.sleep(0.3)  # longer than the head and body timeouts together
                await send({"type": "http.response.body", "body": b"tick\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        answer = str(len(body)).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})


@pytest.fixture
async def server():
    app = RecordingApp()
    http = HttpServer(app, limits=LIMITS)  # type: ignore[arg-type]
    port = await http.start("127.0.0.1", 0)
    yield app, port
    await http.stop()


async def read_until_closed(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> bytes:
    return await asyncio.wait_for(reader.read(), timeout_s)  # read() returns at EOF


def status_and_body(raw: bytes) -> tuple[int, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def send_ignoring_reset(writer: asyncio.StreamWriter, data: bytes) -> None:
    try:
        writer.write(data)
        await writer.drain()
    except ConnectionError:
        pass  # the server may stop reading once it has answered


async def test_an_oversized_header_is_a_431_before_the_application_runs(server):
    app, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    huge = b"x" * (1 << 20)
    await send_ignoring_reset(writer, b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nX-Big: " + huge +
                              b"\r\nContent-Length: 2\r\n\r\n{}")
    status, body = status_and_body(await read_until_closed(reader))
    writer.close()
    assert status == 431
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"
    assert app.calls == []


async def test_too_many_header_fields_is_a_431(server):
    app, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    fields = b"".join(b"X-F%d: v\r\n" % i for i in range(LIMITS.max_header_count + 1))
    await send_ignoring_reset(writer, b"GET /health HTTP/1.1\r\nHost: a\r\n" + fields + b"\r\n")
    status, _ = status_and_body(await read_until_closed(reader))
    writer.close()
    assert status == 431
    assert app.calls == []


async def test_a_half_sent_head_is_a_408_and_the_connection_closed(server):
    app, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await send_ignoring_reset(writer, b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nX-Slow: ")
    raw = await read_until_closed(reader, timeout_s=LIMITS.head_timeout_s + 3)
    writer.close()
    assert status_and_body(raw)[0] == 408
    assert app.calls == []


async def test_a_connection_that_sends_nothing_is_closed(server):
    _, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    raw = await read_until_closed(reader, timeout_s=LIMITS.head_timeout_s + 3)
    writer.close()
    assert status_and_body(raw)[0] == 408


async def test_a_body_not_sent_in_time_is_a_408_and_the_application_reads_a_disconnect(server):
    app, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await send_ignoring_reset(writer, b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n{")
    raw = await read_until_closed(reader, timeout_s=LIMITS.body_timeout_s + 3)
    writer.close()
    assert status_and_body(raw)[0] == 408
    for _ in range(100):
        if app.disconnects:
            break
        await asyncio.sleep(0.01)
    assert app.disconnects == 1


async def test_well_behaved_requests_keep_alive_and_long_streams_are_untouched(server):
    app, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    just_under = b"X-Fill: " + b"y" * (LIMITS.max_head_bytes - 200) + b"\r\n"
    for _ in range(3):  # the head budget is per request, not per connection
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: a\r\n" + just_under +
                     b"Content-Length: 5\r\n\r\nhello")
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        assert b" 200 " in head.split(b"\r\n", 1)[0]
        assert await reader.readexactly(1) == b"5"
    # Idle between requests for longer than the head timeout: the keep-alive timeout applies there, not the head's.
    await asyncio.sleep(LIMITS.head_timeout_s * 1.5)
    started = time.monotonic()
    writer.write(b"GET /stream HTTP/1.1\r\nHost: a\r\n\r\n")
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n", 1)[0]
    body = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 10)
    assert body.count(b"tick") == 4
    assert time.monotonic() - started > LIMITS.head_timeout_s + LIMITS.body_timeout_s
    writer.close()
    assert app.calls == ["/v1/completions"] * 3 + ["/stream"]
    assert all(callable(ext["abort"]) for ext in app.extensions)  # type: ignore[index]


async def test_a_pipelined_half_sent_head_after_a_complete_request_is_timed_too(server):
    app, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await send_ignoring_reset(writer, b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi"
                                      b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nX-Slow: ")
    raw = await read_until_closed(reader, timeout_s=LIMITS.head_timeout_s + 3)
    writer.close()
    first, _, rest = raw.partition(b"\r\n\r\n2")
    assert b" 200 " in first.split(b"\r\n", 1)[0]
    assert status_and_body(rest)[0] == 408
    assert app.calls == ["/v1/completions"]


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_head_bytes"):
        HttpLimits(max_head_bytes=0)
    with pytest.raises(ValueError, match="head_timeout_s"):
        HttpLimits(head_timeout_s=0)
