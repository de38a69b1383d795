"""The gateway's OpenAI HTTP API against fake engine replicas (real aio gRPC servers on loopback, no model), with the
official `openai` client: routing and retries, bearer tokens (401), admission (429), no engine (503), an engine's
INVALID_ARGUMENT as a 400 naming the param, a client going away cancelling the engine stream, TLS, metrics."""

from __future__ import annotations

import asyncio
import json
import ssl

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from minedraft.api import pb
from minedraft.gateway.app import TlsFiles
from minedraft.testing.fake_engine import FakeBehaviour, fake_token_ids

from .gateway_stack import fast_config
from .grpc_helpers import _self_signed_cert_cryptography, wait_for


@pytest.fixture
def http_stack(fake_stacks):
    """make(behaviours, **config) -> (gateway, fakes, base_url, registry): the gateway's HTTP port routing to fakes."""

    async def make(behaviours: list[FakeBehaviour], engines: bool = True, scheme: str = "http", **config):
        registry = CollectorRegistry()
        made = await fake_stacks.make(behaviours, fast_config(**config), engines, registry, http=True, scheme=scheme)
        return made.gateway, made.fakes, made.http_url, registry

    return make


def client(base_url: str, api_key: str = "unused", **kwargs) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, **kwargs)


def fake_text(prompt: str, count: int) -> str:
    return "".join(f"<{t}>" for t in fake_token_ids(pb.GenerateRequest(prompt=prompt), count))


async def hold_stream(base_url: str, body: dict) -> asyncio.StreamWriter:
    """An SSE stream held open on a raw connection until the returned writer is closed (an httpx or SDK stream left
    mid-iteration closes its connection as soon as its iterator is collected)."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    while not (await asyncio.wait_for(reader.readline(), 30)).startswith(b"data: "):
        pass
    return writer


async def test_completions_and_chat_route_through_with_a_retry_before_the_first_chunk(http_stack):
    gateway, (bad, good), base_url, registry = await http_stack(
        [FakeBehaviour(fail_before_first_token=True), FakeBehaviour(token_interval_seconds=0.001)],
        failure_cooldown_seconds=0.0)
    api = client(base_url)
    assert [m.id for m in (await api.models.list()).data] == ["fake"]
    for i in range(4):  # least-outstanding routing tries the failing fake too: retried on the good one
        completion = await api.completions.create(model="fake", prompt=f"p{i}", max_tokens=5)
        assert completion.choices[0].text == fake_text(f"p{i}", 5)
        assert completion.usage.completion_tokens == 5
    stream = await api.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    forwarded = good.record.requests[-1]
    assert [(m.role, m.content) for m in forwarded.messages] == [("user", "hi")]
    assert forwarded.sampling_params.max_tokens == 3
    assert bad.record.failed, "the failing engine was never tried"
    assert registry.get_sample_value("minedraft_gateway_streams_finished_total",
                                     {"protocol": "http", "code": "OK"}) == 5
    assert registry.get_sample_value("minedraft_gateway_streams_started_total", {"protocol": "grpc"}) == 0
    assert gateway.admission.in_flight == 0


async def test_bearer_tokens(http_stack):
    _, (fake,), base_url, registry = await http_stack([FakeBehaviour()], tokens=(b"s3cret",))
    with pytest.raises(openai.AuthenticationError) as info:
        await client(base_url, api_key="wrong").completions.create(model="fake", prompt="x", max_tokens=2)
    assert info.value.status_code == 401 and info.value.body["type"] == "authentication_error"
    async with httpx.AsyncClient(base_url=base_url) as http:
        response = await http.get("/v1/models")
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        # Probes need no token.
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/ready")).status_code == 200
    completion = await client(base_url, api_key="s3cret").completions.create(model="fake", prompt="x", max_tokens=2)
    assert completion.usage.completion_tokens == 2
    assert registry.get_sample_value("minedraft_gateway_streams_finished_total",
                                     {"protocol": "http", "code": "UNAUTHENTICATED"}) == 1
    assert len(fake.record.requests) == 1


async def test_admission_429_and_no_engine_503(http_stack):
    gateway, _fakes, base_url, _ = await http_stack([FakeBehaviour(token_interval_seconds=0.05)], max_in_flight=1,
                                                     engine_wait_timeout_seconds=0.2)
    api = client(base_url)
    held = await hold_stream(base_url, {"model": "fake", "prompt": "long", "max_tokens": 200, "stream": True})
    with pytest.raises(openai.RateLimitError) as info:  # one stream holds the only slot
        await api.completions.create(model="fake", prompt="x", max_tokens=2)
    assert info.value.status_code == 429 and "limit" in info.value.body["message"]
    held.close()
    await wait_for(lambda: gateway.admission.in_flight == 0, what="the held stream to end")
    gateway.set_engines([])
    async with httpx.AsyncClient(base_url=base_url) as http:
        assert (await http.get("/ready")).status_code == 503
        assert (await http.get("/health")).status_code == 200
        for stream in (False, True):
            response = await http.post("/v1/completions", json={"model": "fake", "prompt": "x", "stream": stream})
            assert response.status_code == 503, response.text
            assert "no engine replica became ready within 0.2 s" in response.json()["error"]["message"]


async def test_engine_invalid_argument_is_a_400_naming_the_param(http_stack):
    _, (fake,), base_url, registry = await http_stack([FakeBehaviour()])
    api = client(base_url)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            await api.completions.create(model="fake", prompt="x", max_tokens=-1, stream=stream)
        assert info.value.body["param"] == "max_tokens"
        assert info.value.body["message"].startswith("max_tokens: must be positive")
    with pytest.raises(openai.BadRequestError) as info:
        await api.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                          max_completion_tokens=-1)
    assert info.value.body["param"] == "max_completion_tokens"
    # Refused at the gateway's HTTP edge: never forwarded.
    with pytest.raises(openai.BadRequestError):
        await api.completions.create(model="fake", prompt="x", n=17)
    assert all(r.sampling_params.max_tokens == -1 for r in fake.record.requests)
    # Refused by the engine (3) or at the HTTP edge (1): all counted as HTTP streams ended with INVALID_ARGUMENT.
    assert registry.get_sample_value("minedraft_gateway_streams_finished_total",
                                     {"protocol": "http", "code": "INVALID_ARGUMENT"}) == 4


async def test_client_disconnect_cancels_the_engine_stream(http_stack):
    gateway, (fake,), base_url, _ = await http_stack([FakeBehaviour(token_interval_seconds=0.02)])
    async with httpx.AsyncClient(base_url=base_url) as http:
        async with http.stream("POST", "/v1/completions",
                               json={"model": "fake", "prompt": "x", "max_tokens": 1000, "stream": True}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break
        task = asyncio.create_task(http.post("/v1/chat/completions", json={
            "model": "fake", "messages": [{"role": "user", "content": "y"}], "max_tokens": 1000}))
        await wait_for(lambda: len(fake.record.started) == 2, what="the second engine stream")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await wait_for(lambda: len(fake.record.cancelled) == 2, what="both engine streams cancelled")
    await wait_for(lambda: gateway.admission.in_flight == 0, what="admission released")


async def test_tls(http_stack, tmp_path):
    cert, key = _self_signed_cert_cryptography(tmp_path)
    _, _, base_url, _ = await http_stack([FakeBehaviour()], scheme="https", tls=TlsFiles(cert, key))
    context = ssl.create_default_context(cafile=str(cert))
    api = client(base_url.replace("127.0.0.1", "localhost"), http_client=httpx.AsyncClient(verify=context))
    completion = await api.completions.create(model="fake", prompt="x", max_tokens=2)
    assert completion.usage.completion_tokens == 2
    async with httpx.AsyncClient(verify=False) as plain:
        with pytest.raises(httpx.HTTPError):
            await plain.get(base_url.replace("https", "http") + "/health")


async def test_deadline_header_is_a_504_and_cancels_the_engine_stream(http_stack):
    gateway, (fake,), base_url, _ = await http_stack([FakeBehaviour(token_interval_seconds=0.05)])
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        body = {"model": "fake", "prompt": "x", "max_tokens": 1000}
        response = await http.post("/v1/completions", json=body, headers={"minedraft-timeout-seconds": "0.3"})
        assert response.status_code == 504, response.text
        assert response.json()["error"]["type"] == "timeout"
        # Streamed: the deadline passes after the 200 and some chunks: an error event, no [DONE].
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True},
                               headers={"minedraft-timeout-seconds": "0.3"}) as streamed:
            assert streamed.status_code == 200
            lines = [line async for line in streamed.aiter_lines() if line.startswith("data: ")]
        assert '"finish_reason":null' in lines[0]
        assert lines[-2].startswith('data: {"error"') and lines[-1] == "data: [DONE]"
        bad = await http.post("/v1/completions", json=body, headers={"minedraft-timeout-seconds": "soon"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "minedraft-timeout-seconds"
    assert 0.25 < fake.record.deadlines_seconds[0] <= 0.31  # the deadline went on to the engine
    await wait_for(lambda: len(fake.record.cancelled) == 2, what="both engine streams ended by the deadline")
    await wait_for(lambda: gateway.admission.in_flight == 0, what="admission released")


async def test_n_and_a_batch_through_the_gateway_one_admission_slot_per_choice(http_stack):
    """The official client's n > 1 and batch of prompts through the gateway: each choice its own engine stream and
    admission slot; past the free slots the whole request is a 429 and the choices admitted are aborted."""
    gateway, (fake,), base_url, _ = await http_stack([FakeBehaviour(token_interval_seconds=0.001)], max_in_flight=4)
    api = client(base_url)
    completion = await api.completions.create(model="fake", prompt=["a", "bb"], n=2, max_tokens=3)
    assert [(c.index, c.text) for c in completion.choices] == [
        (0, fake_text("a", 3)), (1, fake_text("a", 3)), (2, fake_text("bb", 3)), (3, fake_text("bb", 3))]
    assert completion.usage.completion_tokens == 12
    assert len(fake.record.requests) == 4
    stream = await api.completions.create(model="fake", prompt="echo me", n=2, max_tokens=3, stream=True, echo=True,
                                          stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {0: "echo me" + fake_text("echo me", 3), 1: "echo me" + fake_text("echo me", 3)}
    assert chunks[-1].usage.completion_tokens == 6
    assert gateway.admission.in_flight == 0

    # Five choices, four slots in all: it could never be admitted, a 400 naming n (not a 429 the SDK retries in
    # vain), and no engine stream started.
    started = len(fake.record.requests)
    for stream_flag in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            await api.completions.create(model="fake", prompt="x", n=5, max_tokens=50, stream=stream_flag)
        assert info.value.body["param"] == "n"
    assert len(fake.record.requests) == started

    # Four choices while another stream holds one of the four slots: refused as a whole (the SDK's RateLimitError),
    # every admitted choice aborted.
    fake.behaviour.token_interval_seconds = 0.05
    completed = len(fake.record.completed)
    for stream_flag in (False, True):
        held = await hold_stream(base_url, {"model": "fake", "prompt": "long", "max_tokens": 400, "stream": True})
        with pytest.raises(openai.RateLimitError):
            await api.completions.create(model="fake", prompt="x", n=4, max_tokens=50, stream=stream_flag)
        held.close()
        await wait_for(lambda: gateway.admission.in_flight == 0, what="every admitted choice released")
    # Whatever of the admitted choices reached the engine was aborted there, none ran to its end.
    record = fake.record
    await wait_for(lambda: len(record.started) == len(record.completed) + len(record.cancelled) + len(record.failed),
                   what="every stream the engine started ended")
    assert len(record.completed) == completed and not record.failed
