"""The gateway's OpenAI HTTP API under misbehaving and unusual clients (fake engines on loopback, no model): clients
that leave before their first token, clients that stop reading, a frozen engine, request-specific failures that
must be 4xx with an OpenAI-shaped body (never a 429/5xx the SDKs retry), and OpenAI parity details."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from minedraft.openai_api.app import OpenAiApp
from minedraft.openai_api.server import HttpServer
from minedraft.testing.fake_engine import FakeBehaviour, fake_token_ids

from ..unit.test_openai_app import StubBackend
from .gateway_stack import fast_config
from .grpc_helpers import wait_for


@pytest.fixture
def http_stack(fake_stacks):
    async def make(behaviours: list[FakeBehaviour], **config):
        made = await fake_stacks.make(behaviours, fast_config(**config), True, CollectorRegistry(), http=True)
        return made.gateway, made.fakes, made.http_url

    return make


async def raw_request(base_url: str, body: dict, path: str = "/v1/completions",
                      rcvbuf_bytes: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A POST sent on a raw connection, nothing read yet (the test decides whether and when to read or leave)."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                 f"{len(payload)}\r\n\r\n".encode() + payload)
    await writer.drain()
    return reader, writer


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_gone_before_its_first_token_is_cancelled_at_once(http_stack, stream):
    # The engine holds the request before its first token (queued behind others); first-response timeout at its
    # default (60 s): before the fix the request stayed on its engine until then, holding the only admission slot
    # (everyone else got 429), and was then retried on another engine with the engine blamed.
    gateway, fakes, base_url = await http_stack(
        [FakeBehaviour(hang_before_first_token=True), FakeBehaviour(hang_before_first_token=True)], max_in_flight=1)
    _, writer = await raw_request(base_url, {"model": "fake", "prompt": "x", "max_tokens": 5, "stream": stream})
    await wait_for(lambda: sum(len(f.record.started) for f in fakes) == 1, what="the request on an engine")
    writer.close()
    await wait_for(lambda: sum(len(f.record.cancelled) for f in fakes) == 1, what="the engine saw the abort")
    await wait_for(lambda: gateway.admission.in_flight == 0, what="the admission slot freed")
    # Never taken for a stalled engine: no retry elsewhere, both engines still in rotation.
    assert sum(len(f.record.started) for f in fakes) == 1
    assert all(e.healthy and not e.unresponsive for e in gateway.endpoints)
    for fake in fakes:
        fake.behaviour.hang_before_first_token = False
    completion = await openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0).completions.create(
        model="fake", prompt="y", max_tokens=2)
    assert completion.usage.completion_tokens == 2


async def test_an_sdk_timeout_while_queued_aborts_the_request(http_stack):
    gateway, (fake,), base_url = await http_stack([FakeBehaviour(hang_before_first_token=True)])
    api = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=0.5)
    for stream in (False, True):
        with pytest.raises(openai.APITimeoutError):
            await api.completions.create(model="fake", prompt="x", max_tokens=5, stream=stream)
    await wait_for(lambda: len(fake.record.cancelled) == 2, what="both queued requests aborted in the engine")
    assert fake.record.completed == []
    await wait_for(lambda: gateway.admission.in_flight == 0, what="admission released")


async def test_a_client_that_stops_reading_is_cut_and_others_stream_on(http_stack):
    padding = 16 * 1024
    gateway, (fake,), base_url = await http_stack([FakeBehaviour(response_padding_bytes=padding)],
                                                  client_stall_timeout_seconds=0.5)
    total_tokens = 4000  # 64 MiB of responses: far more than every buffer between the engine and the client
    reader, writer = await raw_request(base_url, {"model": "fake", "prompt": "slow", "max_tokens": total_tokens,
                                                  "stream": True})
    assert (await reader.readline()).startswith(b"HTTP/1.1 200")
    writer.transport.pause_reading()  # reads nothing more: the socket's buffers fill, then the gateway's send blocks
    # Meanwhile another client's stream runs to its end (with padding too).
    api = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    other = await api.completions.create(model="fake", prompt="fast", max_tokens=50)
    assert other.usage.completion_tokens == 50
    # The stalled stream is cut after the configured time: the engine saw the abort, the slot is free.
    await wait_for(lambda: len(fake.record.cancelled) == 1, timeout_seconds=30, what="the stalled stream cut")
    await wait_for(lambda: gateway.admission.in_flight == 0, what="admission released")
    # Backpressure reached the engine: it could hand gRPC only what the buffers between it and the client hold
    # (flow-control windows and the sockets'), not the stream.
    sent_bytes = (fake.record.num_responses_sent - 50) * padding
    assert sent_bytes < total_tokens * padding / 2, sent_bytes
    # The cut closed the stalled client's connection at once, unsent data dropped (a graceful close waited for the
    # client to read its full buffers: the socket, and megabytes of kernel buffer, stayed as long as it was connected).
    await api.close()
    assert gateway.http is not None and gateway.http._server is not None
    connections = gateway.http._server.server_state.connections
    await wait_for(lambda: not connections, what="the stalled client's connection closed")
    writer.close()


async def test_a_stream_read_to_its_done_is_complete_when_the_client_closes_at_once(http_stack):
    # The engine's status comes a moment after its final response: a client that closes as soon as it has read
    # [DONE] (as the official SDKs do) goes before the engine call ended. Counted as CANCELLED before the fix.
    gateway, _, base_url = await http_stack([FakeBehaviour(linger_after_final_seconds=1.0)])
    for _ in range(3):
        reader, writer = await raw_request(base_url, {"model": "fake", "prompt": "x", "max_tokens": 3, "stream": True})
        await asyncio.wait_for(reader.readuntil(b"data: [DONE]"), 30)
        writer.close()
    await wait_for(lambda: gateway.admission.in_flight == 0, what="the streams ended")
    finished = gateway.metrics.finished
    assert finished.labels("http", "OK")._value.get() == 3
    assert finished.labels("http", "CANCELLED")._value.get() == 0


async def test_a_stream_frozen_after_its_first_token_is_cut_at_the_idle_timeout(http_stack):
    # First-response timeout at its default (60 s), idle timeout short: the idle timer must run from the start,
    # not only once the first-response timer has fired.
    gateway, _, base_url = await http_stack([FakeBehaviour(hang_after_tokens=1)], idle_timeout_seconds=0.3)
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        async def lines() -> list[str]:
            async with http.stream("POST", "/v1/completions",
                                   json={"model": "fake", "prompt": "x", "max_tokens": 5, "stream": True}) as r:
                return [line async for line in r.aiter_lines() if line.startswith("data: ")]
        got = await asyncio.wait_for(lines(), 30)  # well before the 60 s first-response timer could fire
    assert "stopped responding after 1 tokens" in got[-2] and got[-1] == "data: [DONE]"
    await wait_for(lambda: gateway.admission.in_flight == 0, what="admission released")


async def test_request_specific_failures_are_4xx_with_an_openai_body(http_stack):
    gateway, (fake,), base_url = await http_stack([FakeBehaviour()])
    body = {"model": "fake", "prompt": "x", "max_tokens": 2}
    nested = '{"model": "fake", "prompt": "x", "metadata": ' + "[" * 1000 + "]" * 1000 + "}"
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        cases = [
            # A 4-8 MiB body: over the engine's gRPC message size (was a 429 carrying gRPC's message).
            (await http.post("/v1/completions", json={**body, "prompt": "y" * (5 * 1024 * 1024)}), 413, "prompt"),
            (await http.post("/v1/completions", json=body, headers={"x-request-id": "caf\u00e9".encode("latin-1")}),
             400, "x-request-id"),
            (await http.post("/v1/completions", json=body, headers={"minedraft-trace-bin": "AAEC"}),
             400, "minedraft-trace-bin"),
            (await http.post("/v1/completions", json=body, headers={"traceparent": "t" * 8000}), 431, None),
            # A header name HTTP allows and gRPC metadata does not (was a 500).
            (await http.post("/v1/completions", json=body, headers={"minedraft-a!b": "v"}), 400, "minedraft-a!b"),
            (await http.post("/v1/completions", content=nested, headers={"content-type": "application/json"}),
             400, None),
            (await http.post("/v1/completions", content=json.dumps(body), headers={"content-type": "text/plain"}),
             415, "content-type"),
        ]
        for response, status, param in cases:
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert error["param"] == param and error["message"] and "Traceback" not in error["message"]
    assert fake.record.requests == []  # none of them reached the engine
    assert gateway.admission.in_flight == 0
    assert all(e.healthy and not e.unresponsive for e in gateway.endpoints)


async def test_request_id_echo_and_model_lookup(http_stack):
    _, (fake,), base_url = await http_stack([FakeBehaviour()])
    async with httpx.AsyncClient(base_url=base_url) as http:
        response = await http.post("/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 2},
                                   headers={"x-request-id": "req-42"})
        assert response.status_code == 200 and response.headers["x-request-id"] == "req-42"
        assert ("x-request-id", "req-42") in fake.record.metadata[-1]  # forwarded to the engine
        assert (await http.get("/v1/models/fake")).json()["id"] == "fake"
        missing = await http.get("/v1/models/other")
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    api = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    assert (await api.models.retrieve("fake")).id == "fake"
    completion = await api.completions.create(model="fake", prompt="p", max_tokens=3)
    assert completion.choices[0].text == "".join(f"<{t}>" for t in fake_token_ids(fake.record.requests[-1], 3))


async def test_heavy_bodies_are_400s_and_other_streams_carry_on(http_stack):
    gateway, (fake,), base_url = await http_stack([FakeBehaviour(token_interval_seconds=0.002)])
    api = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    running = asyncio.create_task(api.completions.create(model="fake", prompt="other", max_tokens=200))
    heavy = [  # ~8 MiB each: millions of small items
        ({"model": "fake", "prompt": [1] * 2_600_000}, "/v1/completions", "prompt"),
        ({"model": "fake", "prompt": "x", "stop_token_ids": [1] * 2_600_000}, "/v1/completions", "stop_token_ids"),
        ({"model": "fake", "messages": [{"role": "u", "content": ""}] * 300_000}, "/v1/chat/completions", "messages"),
    ]
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        for body, path, param in heavy:
            response = await http.post(path, json=body)
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    completion = await running
    assert completion.usage.completion_tokens == 200
    assert [r.prompt for r in fake.record.requests] == ["other"]
    assert gateway.admission.in_flight == 0


class _QueuedBackend(StubBackend):
    """An engine whose requests stay queued (no first token) until cancelled: records both ends."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = 0

    async def generate(self, request, headers, protocol, timeout_seconds):
        self.requests.append(request)
        try:
            await asyncio.Event().wait()
        finally:
            self.cancelled += 1
        yield  # pragma: no cover  (an async generator that never yields)


@pytest.mark.parametrize("stream", [True, False])
async def test_the_engine_port_front_end_cancels_a_queued_request_whose_client_left(stream):
    # The engine server's HTTP port runs the same front end over its own engine: a request still queued (no first
    # token) when its client leaves is cancelled, which aborts it in the engine (before, it was left to be computed).
    backend = _QueuedBackend()
    server = HttpServer(OpenAiApp(backend).app)
    port = await server.start("127.0.0.1", 0)
    try:
        _, writer = await raw_request(f"http://127.0.0.1:{port}", {"model": "m", "prompt": "x", "stream": stream})
        await wait_for(lambda: len(backend.requests) == 1, what="the request queued")
        writer.close()
        await wait_for(lambda: backend.cancelled == 1, what="the queued request cancelled")
    finally:
        await server.stop()


async def test_a_stream_cut_by_the_gateways_drain_ends_with_an_error_event(http_stack):
    """The gateway's drain cuts a stream still open at the end of its grace period by cancelling its engine call (not
    the HTTP handler's task): the client reads an OpenAI error event saying why and how far it got, then [DONE],
    and the engine sees the abort. A fanned-out request (n = 2) is cut as a whole the same way."""
    gateway, (fake,), base_url = await http_stack([FakeBehaviour(token_interval_seconds=0.02)])
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        async def lines(n: int) -> list[str]:
            async with http.stream("POST", "/v1/completions", json={
                    "model": "fake", "prompt": "x", "max_tokens": 5000, "stream": True, "n": n}) as r:
                return [line async for line in r.aiter_lines() if line.startswith("data: ")]
        streams = [asyncio.ensure_future(lines(n)) for n in (1, 2)]
        await wait_for(lambda: fake.record.num_responses_sent >= 9, what="all three choices streaming")
        await asyncio.wait_for(gateway.drain(grace_seconds=0), 30)
        for got in await asyncio.wait_for(asyncio.gather(*streams), 30):
            assert got[-1] == "data: [DONE]"
            error = json.loads(got[-2][len("data: "):])["error"]
            assert error["code"] == "unavailable" and "drain" in error["message"], error
    assert len(fake.record.cancelled) == 3 and fake.record.completed == []


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_gone_cancels_every_choice_of_a_fanned_out_request(http_stack, stream):
    gateway, (fake,), base_url = await http_stack([FakeBehaviour(token_interval_seconds=0.05)])
    _, writer = await raw_request(base_url, {"model": "fake", "prompt": ["a", "b"], "n": 2, "max_tokens": 5000,
                                             "stream": stream})
    await wait_for(lambda: len(fake.record.started) == 4, what="the four choices on the engine")
    writer.close()
    await wait_for(lambda: len(fake.record.cancelled) == 4, what="every choice aborted in the engine")
    await wait_for(lambda: gateway.admission.in_flight == 0, what="every admission slot freed")
    assert fake.record.completed == []
