"""The OpenAI HTTP API of the engine server over the shared PSD engine (real vLLM), with the official `openai` client
and raw sockets: the same tokens as the gRPC API, OpenAI's SSE framing byte for byte, 400s naming the parameter,
and a client that goes away aborting the request in the engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
from collections.abc import AsyncIterator

import grpc
import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from minedraft.api import pb, pb_grpc
from minedraft.engine.async_engine import AsyncEngine
from minedraft.gateway.app import Gateway, GatewayConfig
from minedraft.server.app import EngineServer

from .grpc_helpers import wait_for
from .test_server import engine_calls, no_unfinished  # noqa: F401  (fixtures and helpers shared with the gRPC tests)

pytestmark = pytest.mark.engine

MAX_TOKENS = 12
PROMPT = "def parse_args(argv):\n    "


@pytest.fixture
async def http_served(psd, engine_calls):  # noqa: F811
    """(grpc target, http base url, engine): one engine server with both APIs on loopback ports."""
    engine = AsyncEngine(psd)
    server = EngineServer("replica-http", CollectorRegistry())
    await server.start()
    http_port = await server.start_http("127.0.0.1", 0)
    await server.attach(engine)
    yield f"127.0.0.1:{server.port}", f"http://127.0.0.1:{http_port}", engine, server.registry
    await server.stop()
    await engine.shutdown(shutdown_engine=False)


def client(base_url: str, **kwargs) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=kwargs.pop("api_key", "unused"), max_retries=0,
                              **kwargs)


@contextlib.asynccontextmanager
async def gateway_in_front(grpc_target: str) -> AsyncIterator[tuple[Gateway, str]]:
    """A gateway on loopback in front of the engine server, its one engine healthy: (gateway, its HTTP base URL)."""
    gateway = Gateway(GatewayConfig(health_retry_seconds=0.05))
    await gateway.start()
    port = await gateway.start_http("127.0.0.1", 0)
    try:
        gateway.set_engines([grpc_target])
        await wait_for(lambda: any(e.healthy for e in gateway.endpoints), what="engine healthy at the gateway")
        yield gateway, f"http://127.0.0.1:{port}"
    finally:
        await gateway.stop()


async def grpc_generate(target: str, request: pb.GenerateRequest) -> tuple[list[int], str]:
    async with grpc.aio.insecure_channel(target) as channel:
        responses = [r async for r in pb_grpc.GenerationStub(channel).Generate(request, timeout=120)]
    return [t for r in responses for t in r.token_ids], "".join(r.text for r in responses)


async def test_models_completion_and_chat_match_the_grpc_api(http_served):
    grpc_target, base_url, engine, registry = http_served
    api = client(base_url)
    models = await api.models.list()
    assert [m.id for m in models.data] == [engine.settings.model]
    model = models.data[0].id

    tokens, text = await grpc_generate(grpc_target, pb.GenerateRequest(
        prompt=PROMPT, sampling_params=pb.SamplingParams(max_tokens=MAX_TOKENS)))
    completion = await api.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"return_token_ids": True})
    assert completion.choices[0].model_extra["token_ids"] == tokens, "not token-identical to the gRPC API"
    assert completion.choices[0].text == text
    assert completion.usage.completion_tokens == len(tokens) == MAX_TOKENS
    assert completion.choices[0].finish_reason == "length"
    assert completion.model_extra["speculation"]["num_draft_tokens"] > 0, "psd drafted nothing"

    # The same prompt as token ids, streamed: the same text, chunk by chunk.
    prompt_ids = list(engine.engine.tokenizer.encode(PROMPT))
    streamed = await api.completions.create(model=model, prompt=prompt_ids, max_tokens=MAX_TOKENS, stream=True)
    chunks = [chunk async for chunk in streamed]
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"

    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def main():"}]
    chat_tokens, chat_text = await grpc_generate(grpc_target, pb.GenerateRequest(
        messages=[pb.ChatMessage(**m) for m in messages], sampling_params=pb.SamplingParams(max_tokens=MAX_TOKENS)))
    chat = await api.chat.completions.create(model=model, messages=messages, max_completion_tokens=MAX_TOKENS)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == chat_text
    assert chat.usage.completion_tokens == len(chat_tokens)
    assert chat.usage.prompt_tokens == len(engine.engine.tokenizer.encode(
        "# system:\nYou write Python.\n# user:\ndef main():\n# assistant:\n", add_special_tokens=False))

    # The engine's request metrics tell the APIs apart.
    def finished(protocol: str) -> float:
        return sum(registry.get_sample_value("minedraft_engine_requests_finished_total", {
            "model": engine.settings.model, "protocol": protocol, "finish_reason": reason}) or 0.0
            for reason in ("stop", "length"))

    assert finished("http") == 3 and finished("grpc") == 2


async def test_through_the_gateway_greedy_output_matches_the_grpc_api(http_served):
    """openai client -> gateway (HTTP) -> engine server (gRPC) -> PSD engine: the gRPC API's greedy output."""
    grpc_target, _, engine, _ = http_served
    async with gateway_in_front(grpc_target) as (_gateway, gateway_url):
        api = client(gateway_url)
        tokens, text = await grpc_generate(grpc_target, pb.GenerateRequest(
            prompt=PROMPT, sampling_params=pb.SamplingParams(max_tokens=MAX_TOKENS)))
        stream = await api.completions.create(model=engine.settings.model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"return_token_ids": True})
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []] == tokens
        assert chunks[-1].usage.completion_tokens == len(tokens) == MAX_TOKENS
        assert chunks[-1].model_extra["speculation"]["num_draft_tokens"] > 0
        chat = await api.chat.completions.create(model=engine.settings.model, max_tokens=4,
                                                 messages=[{"role": "user", "content": "import sys"}])
        assert chat.usage.completion_tokens == 4 and chat.choices[0].message.content


async def test_seeded_requests_are_reproducible_through_both_apis_streamed_and_not(http_served):
    """Identical seeded requests at temperature 1, sent together with other traffic so their drafts are verified in
    different groupings and at different steps: one output, whichever API, streamed or not (psd with drafts)."""
    grpc_target, base_url, engine, _ = http_served
    api = client(base_url)
    model = engine.settings.model
    seeded = {"temperature": 1.0, "seed": 4321, "max_tokens": 16}
    before = engine.engine.totals().accepted_tokens

    async def full() -> str:
        completion = await api.completions.create(model=model, prompt=PROMPT, **seeded)
        return completion.choices[0].text

    async def streamed() -> str:
        stream = await api.completions.create(model=model, prompt=PROMPT, stream=True, **seeded)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def over_grpc() -> str:
        _, text = await grpc_generate(grpc_target, pb.GenerateRequest(prompt=PROMPT, sampling_params=pb.SamplingParams(
            temperature=1.0, seed=4321, max_tokens=16)))
        return text

    async def other(i: int) -> None:
        await asyncio.sleep(0.05 * i)
        await api.completions.create(model=model, prompt=f"x = {i}\n", max_tokens=24, temperature=0.8)

    texts, _ = await asyncio.gather(
        asyncio.gather(*[make() for make in (full, streamed, over_grpc) for _ in range(4)]),
        asyncio.gather(*[other(i) for i in range(6)]))
    assert engine.engine.totals().accepted_tokens > before, "psd accepted no drafts: the test shows nothing"
    assert len(set(texts)) == 1, f"identical seeded requests gave {len(set(texts))} outputs: {sorted(set(texts))}"
    # And a later one, alone, gives it again.
    assert await full() == texts[0]


async def test_streamed_chat_with_include_usage(http_served):
    _, base_url, engine, _ = http_served
    api = client(base_url)
    stream = await api.chat.completions.create(
        model=engine.settings.model, messages=[{"role": "user", "content": "import os"}], max_tokens=MAX_TOKENS,
        stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1])
    final, usage_chunk = chunks[-2], chunks[-1]
    assert final.choices[0].finish_reason == "length" and final.model_extra["speculation"]["num_draft_tokens"] > 0
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == MAX_TOKENS
    assert usage_chunk.usage.total_tokens == usage_chunk.usage.prompt_tokens + MAX_TOKENS
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


async def test_sse_framing_byte_for_byte(http_served):
    """A raw HTTP/1.1 client: the exact bytes OpenAI sends (`data: <json>\\n\\n` events, `data: [DONE]\\n\\n`)."""
    _, base_url, engine, _ = http_served
    port = int(base_url.rsplit(":", 1)[1])
    body = json.dumps({"model": engine.settings.model, "prompt": PROMPT, "max_tokens": 4, "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 120)
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"content-type: text/event-stream" in head.lower()
    assert b"transfer-encoding: chunked" in head.lower()
    # De-chunk the HTTP/1.1 body.
    data, rest = b"", payload
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        data, rest = data + rest[:size], rest[size + 2:]
    assert data.endswith(b"\n\ndata: [DONE]\n\n")
    events = data.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    for event in events[:-2]:
        assert event.startswith(b"data: {") and b"\n" not in event
        chunk = json.loads(event[len(b"data: "):])
        assert chunk["object"] == "text_completion" and "usage" not in chunk
    last = json.loads(events[-3][len(b"data: "):])
    assert last["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]
    assert set(last["speculation"]) == {"num_draft_tokens", "num_accepted_tokens"}


INVALID = [
    # (endpoint, body changes, param named in the 400)
    ("completions", {"temperature": -1}, "temperature"),
    ("completions", {"temperature": 2.5}, "temperature"),  # vLLM refuses it at request creation: was a 500
    ("completions", {"min_tokens": 3}, "min_tokens"),  # vLLM's extension: was silently ignored
    ("chat/completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("completions", {"top_p": 0}, "top_p"),
    ("completions", {"top_p": 1.5}, "top_p"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"max_tokens": 100_000}, "max_tokens"),
    ("completions", {"seed": -3}, "seed"),
    ("completions", {"n": 17}, "n"),
    ("completions", {"prompt": ["a"] * 8, "n": 9}, "n"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"presence_penalty": 3}, "presence_penalty"),
    ("completions", {"echo": True, "logprobs": 1}, "echo"),
    ("completions", {"echo": True, "prompt": [1, 2]}, "echo"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"logit_bias": {"5": 1}}, "logit_bias"),
    ("completions", {"stop": ["a", ""]}, "stop"),
    ("completions", {"stop": 7}, "stop"),
    ("completions", {"prompt": [1, 2, 99_999]}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": ["a", [1, True]]}, "prompt"),
    ("completions", {"prompt": " word" * 2000}, "prompt"),
    ("completions", {"stop_token_ids": [99_999]}, "stop_token_ids"),
    ("completions", {"top_k": -5}, "top_k"),
    ("completions", {"max_tokens": "8"}, "max_tokens"),
    ("completions", {"stream": "yes"}, "stream"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"model": None}, "model"),
    ("chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat/completions", {"max_completion_tokens": 4, "max_tokens": 4}, "max_completion_tokens"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat/completions", {"messages": [{"role": "user", "content": " word" * 2000}]}, "messages"),
]


async def test_every_invalid_field_is_a_400_naming_the_param_and_touches_no_engine(http_served, engine_calls):  # noqa: F811
    _, base_url, engine, _ = http_served
    bases = {"completions": {"model": engine.settings.model, "prompt": "abc"},
             "chat/completions": {"model": engine.settings.model, "messages": [{"role": "user", "content": "hi"}]}}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        for endpoint, changes, param in INVALID:
            response = await http.post(f"/v1/{endpoint}", json={**bases[endpoint], **changes})
            assert response.status_code == 400, (endpoint, changes, response.text)
            error = response.json()["error"]
            assert error["param"] == param, (endpoint, changes, error)
            assert error["type"] == "invalid_request_error" and error["message"]
        response = await http.post("/v1/completions", content=b"{not json")
        assert response.status_code == 400 and response.json()["error"]["param"] is None
        response = await http.post("/v1/completions", json={**bases["completions"], "model": "other"})
        assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    assert engine_calls["added"] == []

    # The official client surfaces them as BadRequestError with the param.
    with pytest.raises(openai.BadRequestError) as info:
        await client(base_url).completions.create(model=engine.settings.model, prompt="abc", top_p=2)
    assert info.value.body["param"] == "top_p"


async def test_chat_without_a_template_is_a_400_and_completions_still_work(http_served, monkeypatch):
    _, base_url, engine, _ = http_served
    monkeypatch.setattr(engine.engine.tokenizer, "chat_template", None, raising=False)
    api = client(base_url)
    with pytest.raises(openai.BadRequestError) as info:
        await api.chat.completions.create(model=engine.settings.model, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["param"] == "messages" and "chat template" in info.value.body["message"]
    completion = await api.completions.create(model=engine.settings.model, prompt="abc", max_tokens=2)
    assert completion.usage.completion_tokens == 2


async def test_client_disconnect_aborts_the_request_in_the_engine(http_served, engine_calls):  # noqa: F811
    _, base_url, engine, _ = http_served
    # A client gone before any response (the disconnect is watched from the start, as on the gateway): the request
    # is aborted in the engine, not run to its 400 tokens.
    engine_calls["added"].clear()
    body = json.dumps({"model": engine.settings.model, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
                       "stream": True}).encode()
    _, writer = await asyncio.open_connection("127.0.0.1", int(base_url.rsplit(":", 1)[1]))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    await wait_for(lambda: bool(engine_calls["added"]), timeout_seconds=30, what="the engine request")
    writer.close()
    request_id = engine_calls["added"][0]
    await wait_for(lambda: request_id in engine_calls["aborted"], timeout_seconds=30, what="the engine abort")
    for stream in (True, False):
        engine_calls["added"].clear()
        body = {"model": engine.settings.model, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
                "stream": stream}
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            if stream:
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            break  # one chunk received: go away
            else:
                task = asyncio.create_task(http.post("/v1/completions", json=body))
                await wait_for(lambda: bool(engine_calls["added"]), timeout_seconds=30, what="the engine request")
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
        request_id = engine_calls["added"][0]
        await wait_for(lambda rid=request_id: rid in engine_calls["aborted"], timeout_seconds=30,
                       what=f"the engine abort (stream={stream})")
    await no_unfinished(engine)


async def test_deadline_header_is_a_504_and_aborts_in_the_engine(http_served, engine_calls):  # noqa: F811
    _, base_url, engine, _ = http_served
    body = {"model": engine.settings.model, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    # The engine's loop is held (a call blocking it) until the answer is in, so the request cannot finish before its
    # deadline however fast the machine is (unheld, 400 tokens sometimes took under 0.5 s here).
    release = threading.Event()
    held = asyncio.ensure_future(engine.call(lambda _: release.wait(120)))
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            response = await http.post("/v1/completions", json=body, headers={"minedraft-timeout-seconds": "0.5"})
    finally:
        release.set()
        await held
    assert response.status_code == 504, response.text
    assert response.json()["error"]["message"].startswith("deadline exceeded after")
    await wait_for(lambda: bool(engine_calls["added"]), what="the request reached the engine")
    request_id = engine_calls["added"][0]
    await wait_for(lambda: request_id in engine_calls["aborted"], timeout_seconds=30, what="the engine abort")
    await no_unfinished(engine)


async def test_health_and_ready_through_load_and_drain(psd):
    """Liveness (/health) answers from the bind to the end, readiness (/ready) only while serving: not while the
    engine loads, not while draining (an open stream holds the drain; new requests are refused with 503)."""
    engine = AsyncEngine(psd)
    server = EngineServer("replica-probe")
    await server.start()
    port = await server.start_http("127.0.0.1", 0)
    drain: asyncio.Task | None = None
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            assert (await http.get("/health")).status_code == 200
            assert (await http.get("/ready")).status_code == 503
            body = {"model": engine.settings.model, "prompt": PROMPT, "max_tokens": 4}
            assert (await http.post("/v1/completions", json=body)).status_code == 503  # loading
            await server.attach(engine)
            assert (await http.get("/ready")).status_code == 200
            models = (await http.get("/v1/models")).json()
            assert models["object"] == "list" and models["data"][0]["id"] == engine.settings.model
            # A stream held open on a raw connection (an httpx stream left mid-iteration closes its connection).
            held = json.dumps({**body, "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(held)).encode() + b"\r\n\r\n" + held)
            while not (await asyncio.wait_for(reader.readline(), 60)).startswith(b"data: "):
                pass
            drain = asyncio.create_task(server.drain(60))
            await wait_for(lambda: not server.serving, what="readiness off at the drain")
            assert (await http.get("/ready")).status_code == 503
            assert (await http.get("/health")).status_code == 200
            refused = await http.post("/v1/completions", json=body)
            assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
            assert not drain.done(), "the drain did not wait for the open stream"
            writer.close()
            # The held stream is gone (client closed it): the drain completes.
            await asyncio.wait_for(drain, 60)
    finally:
        if drain is None:
            await server.stop()
        await engine.shutdown(shutdown_engine=False)


async def test_n_batch_and_echo_match_the_grpc_api_directly_and_through_the_gateway(http_served):
    """The official client's n > 1, batch of prompts and echo on the real PSD engine, on the engine server's own HTTP
    port (not streamed) and through the gateway (streamed): greedy, every choice is the gRPC API's output for its
    prompt, in OpenAI's choice order."""
    grpc_target, base_url, engine, _ = http_served
    model = engine.settings.model
    prompts = [PROMPT, "import numpy as np\n"]
    expected = [(await grpc_generate(grpc_target, pb.GenerateRequest(
        prompt=p, sampling_params=pb.SamplingParams(max_tokens=MAX_TOKENS))))[1] for p in prompts]
    full = await client(base_url).completions.create(model=model, prompt=prompts, n=2, max_tokens=MAX_TOKENS,
                                                     temperature=0, echo=True)
    assert [(c.index, c.text) for c in full.choices] == [(i, prompts[i // 2] + expected[i // 2]) for i in range(4)]
    assert full.usage.completion_tokens == 4 * MAX_TOKENS

    async with gateway_in_front(grpc_target) as (gateway, gateway_url):
        stream = await client(gateway_url).completions.create(
            model=model, prompt=prompts, n=2, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True})
        texts: dict[int, str] = {}
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
        assert texts == {i: expected[i // 2] for i in range(4)}
        assert chunk.usage.completion_tokens == 4 * MAX_TOKENS
        assert gateway.admission.in_flight == 0
    await no_unfinished(engine)


async def test_a_stream_cut_by_the_drain_ends_with_an_error_event_saying_why(psd):
    """At the end of a drain's grace period an HTTP stream still open is ended by aborting its request in the
    engine: the client reads an OpenAI error event (UNAVAILABLE, why, how many tokens it got) and [DONE], then the
    response's proper end; before, the HTTP server's stop closed the connection bare."""
    engine = AsyncEngine(psd)
    server = EngineServer("replica-http-cut")
    await server.start()
    port = await server.start_http("127.0.0.1", 0)
    try:
        await server.attach(engine)
        held = json.dumps({"model": engine.settings.model, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
                           "stream": True}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(held)).encode() + b"\r\n\r\n" + held)
        while not (await asyncio.wait_for(reader.readline(), 60)).startswith(b"data: "):
            pass
        await asyncio.wait_for(server.drain(0), 60)
        rest = await asyncio.wait_for(reader.read(), 60)  # to the connection's end
        writer.close()
    finally:
        await engine.shutdown(shutdown_engine=False)
    events = re.findall(rb"data: (.*?)\n\n", rest)  # each send is one HTTP chunk holding whole events
    assert events[-1] == b"[DONE]", rest[-500:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "unavailable" and error["message"].startswith(
        "replica replica-http-cut shutting down: stream cut at the end of the drain grace period after ")
    # How far it got: at least the tokens this read saw after the first event (one token per event or more).
    assert int(error["message"].rsplit(" ", 2)[1]) >= len(events) - 2
    assert rest.endswith(b"0\r\n\r\n"), "the chunked response was not ended properly"


async def test_logprobs_and_penalties_with_the_official_client_directly_and_through_the_gateway(http_served):
    """The official client's logprobs (completions: legacy object; chat: content list, streamed through the gateway)
    and presence/frequency penalties on the real PSD engine: the same tokens and log-probabilities as the gRPC API."""
    grpc_target, base_url, engine, _ = http_served
    model = engine.settings.model
    async with grpc.aio.insecure_channel(grpc_target) as channel:
        responses = [r async for r in pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
            prompt=PROMPT, sampling_params=pb.SamplingParams(max_tokens=MAX_TOKENS, logprobs=2)), timeout=120)]
    grpc_logprobs = [e for r in responses for e in r.logprobs]
    assert len(grpc_logprobs) == MAX_TOKENS and all(len(e.top_logprobs) == 2 for e in grpc_logprobs)

    completion = await client(base_url).completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                           logprobs=2, temperature=0)
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens == [e.token for e in grpc_logprobs]
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in grpc_logprobs], abs=1e-5)
    assert all(len(top) >= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)

    penalised = pb.SamplingParams(max_tokens=MAX_TOKENS, presence_penalty=1.5, frequency_penalty=1.0)
    _, penalised_text = await grpc_generate(grpc_target, pb.GenerateRequest(prompt=PROMPT,
                                                                           sampling_params=penalised))
    _, plain_text = await grpc_generate(grpc_target, pb.GenerateRequest(
        prompt=PROMPT, sampling_params=pb.SamplingParams(max_tokens=MAX_TOKENS)))
    assert penalised_text != plain_text, "the penalties change nothing here: the check below would prove nothing"
    penalised_completion = await client(base_url).completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, presence_penalty=1.5, frequency_penalty=1.0)
    assert penalised_completion.choices[0].text == penalised_text

    async with gateway_in_front(grpc_target) as (_gateway, gateway_url):
        stream = await client(gateway_url).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "import sys"}], max_tokens=MAX_TOKENS, stream=True,
            logprobs=True, top_logprobs=2, presence_penalty=0.5, extra_body={"ignore_eos": True})
        content = [entry async for chunk in stream for choice in chunk.choices
                   for entry in (choice.logprobs.content if choice.logprobs else [])]
        assert len(content) == MAX_TOKENS
        assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in content)
        assert all(e.logprob <= 0 for e in content)
