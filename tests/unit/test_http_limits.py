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


@pytest.mark.parametrize("where", ["header", "url"])
async def test_a_pipelined_head_over_the_limit_is_a_431_even_when_it_arrives_with_the_request_before(server, where):
    """The head budget counts the parsed head itself, not each socket read: a head that begins in the same read as
    the end of the request before it is held to the same limit (it used to get up to one more read's worth)."""
    app, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    fill = b"y" * (LIMITS.max_head_bytes + 2048)  # over the limit, well under one read of 64 KiB
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nX-Fill: " + fill + b"\r\n" if where == "header" else
            b"POST /v1/completions?q=" + fill + b" HTTP/1.1\r\nHost: a\r\n")
    await send_ignoring_reset(writer, b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi"
                                      + head + b"Content-Length: 5\r\n\r\nhello")
    raw = await read_until_closed(reader)
    writer.close()
    first, _, rest = raw.partition(b"\r\n\r\n2")
    assert b" 200 " in first.split(b"\r\n", 1)[0]
    assert status_and_body(rest)[0] == 431
    assert app.calls == ["/v1/completions"]


def chunks_of(stream: bytes) -> tuple[bytes, bytes]:
    """A chunked response body's data and what follows its last chunk."""
    data = b""
    while True:
        size_line, _, stream = stream.partition(b"\r\n")
        size = int(size_line, 16)
        data, stream = data + stream[:size], stream[size + 2:]
        if size == 0:
            return data, stream


async def test_a_pipelined_requests_body_timer_runs_only_once_it_is_read_and_never_cuts_the_stream_before(server):
    """A request pipelined behind a stream is served once the stream ends: its body timer starts then (when the
    server turns to it), so it never fires into the stream before it, and its body may come meanwhile."""
    app, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /stream HTTP/1.1\r\nHost: a\r\n\r\n"
                 b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\n")
    await writer.drain()
    # The body comes after the body timeout but before the stream (1.2 s) ends: the request waits its turn anyway.
    await asyncio.sleep(LIMITS.body_timeout_s + 0.2)
    writer.write(b"hello")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert b" 200 " in head.split(b"\r\n", 1)[0]
    rest = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 10)
    data, _ = chunks_of(rest)
    assert data == b"tick\n" * 4  # the stream ran to its end, uncut
    second = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert b" 200 " in second.split(b"\r\n", 1)[0], second
    assert await asyncio.wait_for(reader.readexactly(1), 5) == b"5"
    writer.close()
    assert app.calls == ["/stream", "/v1/completions"]


async def test_a_pipelined_half_sent_head_behind_a_stream_is_answered_408_after_the_stream_not_into_it(server):
    """The head timer of a request pipelined behind a running stream fires while that stream runs: the stream is
    another request's response and runs to its end; the 408 follows it, then the connection closes."""
    app, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await send_ignoring_reset(writer, b"GET /stream HTTP/1.1\r\nHost: a\r\n\r\n"
                                      b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nX-Slow: ")
    raw = await read_until_closed(reader, timeout_s=10)
    writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n", 1)[0]
    data, after = chunks_of(rest)
    assert data == b"tick\n" * 4
    assert status_and_body(after)[0] == 408
    assert app.calls == ["/stream"]
