"""The shared HTTP front end (minedraft.openai_api.app) over a stub backend, in process (no sockets): large bodies
are decoded off the event loop, and an unexpected failure is an OpenAI-shaped 500 that tells nothing of it."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Mapping

import grpc
import httpx

from minedraft.api import pb
from minedraft.openai_api import app as app_module
from minedraft.openai_api.app import BackendError, OpenAiApp
from minedraft.openai_api.protocol import ApiError


class StubBackend:
    error_types: tuple[type[Exception], ...] = (BackendError,)

    def __init__(self, failure: Exception | None = None, max_streams: int | None = None) -> None:
        self.failure = failure
        self._max_streams = max_streams
        self.requests: list[pb.GenerateRequest] = []

    def backend_error(self, error: Exception) -> BackendError:
        assert isinstance(error, BackendError)
        return error

    def live(self) -> bool:
        return True

    def refused(self, error: ApiError) -> None:
        pass

    def ready(self) -> bool:
        return True

    def authorize(self, authorization: str | None, stream: bool) -> bool:
        return True

    async def model_ids(self) -> list[str]:
        return ["m"]

    def known_model_ids(self) -> list[str] | None:
        return ["m"]

    def max_streams(self) -> int | None:
        return self._max_streams

    async def generate(self, request: pb.GenerateRequest, headers: Mapping[str, str], protocol: str,
                       timeout_seconds: float | None) -> AsyncIterator[pb.GenerateResponse]:
        self.requests.append(request)
        if self.failure is not None:
            raise self.failure
        yield pb.GenerateResponse(token_ids=[1], text="a", finish_reason="length")


def http(backend: StubBackend) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(OpenAiApp(backend).app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


async def test_a_large_body_is_decoded_off_the_event_loop(monkeypatch):
    threads: list[int] = []
    parse = app_module.parse_request

    def recording_parse(*args, **kwargs):
        threads.append(threading.get_ident())
        return parse(*args, **kwargs)

    monkeypatch.setattr(app_module, "parse_request", recording_parse)
    backend = StubBackend()
    ids = list(range(200_000))  # ~1.3 MB of JSON
    async with http(backend) as client:
        good = await client.post("/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 1})
        bad = await client.post("/v1/completions", json={"model": "m", "prompt": [*ids, -1], "max_tokens": 1})
        small = await client.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 1})
    assert small.status_code == 200
    assert good.status_code == 200 and len(backend.requests[0].prompt_token_ids) == len(ids)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"  # still a 400 naming the param
    loop_thread = threading.get_ident()
    assert threads[0] != loop_thread and threads[1] != loop_thread  # the large bodies: in a thread
    assert threads[2] == loop_thread  # a small body costs no thread hop


async def test_an_unexpected_failure_is_an_openai_500_without_its_text():
    backend = StubBackend(failure=RuntimeError("secret detail of /internal/path"))
    async with http(backend) as client:
        for stream in (False, True):
            response = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": stream})
            assert response.status_code == 500
            error = response.json()["error"]
            assert error["type"] == "server_error" and "secret" not in response.text


async def test_a_backend_refusal_before_the_first_token_is_the_http_status():
    backend = StubBackend(failure=BackendError(grpc.StatusCode.INVALID_ARGUMENT, "top_p: must be in (0, 1]",
                                              "sampling_params.top_p"))
    async with http(backend) as client:
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_p"


async def test_cors_is_off_unless_origins_are_given():
    for origins, allowed in (((), None), (("https://app.example",), "https://app.example")):
        transport = httpx.ASGITransport(OpenAiApp(StubBackend(), cors_origins=origins).app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            preflight = await client.options("/v1/completions", headers={
                "origin": "https://app.example", "access-control-request-method": "POST"})
            response = await client.get("/v1/models", headers={"origin": "https://app.example"})
        assert response.headers.get("access-control-allow-origin") == allowed
        assert (preflight.status_code == 200) == (allowed is not None)


def test_gateway_flags_for_http_clients():
    import argparse

    from minedraft.gateway.cli import add_subcommands, config_from_args

    parser = argparse.ArgumentParser()
    add_subcommands(parser.add_subparsers())
    assert config_from_args(parser.parse_args(["gateway", "--engines", "h:1"])).client_stall_timeout_seconds == 60.0
    config = config_from_args(parser.parse_args(["gateway", "--engines", "h:1", "--client-stall-timeout-s", "0",
                                                 "--cors-origins", "https://a.example, https://b.example"]))
    assert config.client_stall_timeout_seconds is None
    assert config.cors_origins == ("https://a.example", "https://b.example")


class FanStub(StubBackend):
    """Each request answers its own request id's suffix as text, one token per response; `fail_index` fails that
    choice's stream after its first response; every stream's close is recorded (closing aborts in the engine)."""

    def __init__(self, tokens: int = 3, fail_index: int | None = None, refuse_index: int | None = None,
                 start_ticks: Mapping[int, int] | None = None) -> None:
        super().__init__()
        self.tokens = tokens
        self.start_ticks = dict(start_ticks or {})  # choice index -> event-loop turns before its first response
        self.fail_index = fail_index
        self.refuse_index = refuse_index
        self.closed: list[str] = []
        self.finished: list[str] = []

    async def generate(self, request: pb.GenerateRequest, headers: Mapping[str, str], protocol: str,
                       timeout_seconds: float | None) -> AsyncIterator[pb.GenerateResponse]:
        self.requests.append(request)
        index = int(request.request_id.rsplit("-", 1)[1])
        try:
            if index == self.refuse_index:
                raise BackendError(grpc.StatusCode.RESOURCE_EXHAUSTED, "at the limit")
            for _ in range(self.start_ticks.get(index, 0)):
                await asyncio.sleep(0)
            for position in range(self.tokens):
                await asyncio.sleep(0)
                if index == self.fail_index and position == 1:
                    raise BackendError(grpc.StatusCode.UNAVAILABLE, "replica went away")
                last = position == self.tokens - 1
                response = pb.GenerateResponse(request_id=request.request_id, token_ids=[index],
                                               text=f"{index}.", finish_reason="length" if last else "")
                if last:
                    response.usage.prompt_tokens = 2
                    response.usage.completion_tokens = self.tokens
                yield response
            self.finished.append(request.request_id)
        finally:
            self.closed.append(request.request_id)
            if index == self.fail_index or index == self.refuse_index:
                await asyncio.sleep(0)  # the others are still running when this one ends


def sse_payloads(text: str) -> list[dict | str]:
    return [json.loads(e[6:]) if e != "data: [DONE]" else "[DONE]" for e in text.split("\n\n") if e]


async def test_n_and_a_batch_are_merged_into_one_answer():
    backend = FanStub()
    async with http(backend) as client:
        full = (await client.post("/v1/completions", json={
            "model": "m", "prompt": ["a", "b"], "n": 2, "seed": 5, "max_tokens": 3})).json()
        streamed = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "x"}], "n": 3, "stream": True,
            "stream_options": {"include_usage": True}})
    assert [c["index"] for c in full["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in full["choices"]] == ["0.0.0.", "1.1.1.", "2.2.2.", "3.3.3."]
    assert full["usage"] == {"prompt_tokens": 4, "completion_tokens": 12, "total_tokens": 16}
    assert [r.sampling_params.seed for r in backend.requests[:4]] == [5, 6, 5, 6]

    assert streamed.status_code == 200
    events = sse_payloads(streamed.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    content: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            content[choice["index"]] = content.get(choice["index"], "") + (choice["delta"].get("content") or "")
    assert content == {0: "0.0.0.", 1: "1.1.1.", 2: "2.2.2."}
    finals = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(finals) == [0, 1, 2]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9
    assert chunks[-1]["usage"]["prompt_tokens"] == 2  # one prompt, counted once


async def test_one_failing_choice_fails_the_request_and_aborts_the_others():
    for stream in (False, True):
        backend = FanStub(tokens=50, fail_index=1)
        async with http(backend) as client:
            response = await client.post("/v1/completions", json={
                "model": "m", "prompt": "x", "n": 3, "max_tokens": 50, "stream": stream})
        if stream:  # after the 200: an error event, then [DONE]
            events = sse_payloads(response.text)
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "unavailable"
        else:
            assert response.status_code == 503 and response.json()["error"]["code"] == "unavailable"
        # Every stream closed (aborted in the engine), none ran to its end.
        assert sorted(backend.closed) == sorted(r.request_id for r in backend.requests) and len(backend.closed) == 3
        assert backend.finished == []


async def test_a_choice_refused_before_its_first_token_is_the_http_status():
    # Through the gateway each choice takes an admission slot: one refused is the whole request's 429.
    backend = FanStub(tokens=50, refuse_index=2)
    async with http(backend) as client:
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "n": 3,
                                                               "max_tokens": 50, "stream": True})
    assert response.status_code == 429
    assert len(backend.closed) == 3 and backend.finished == []


async def test_more_choices_than_can_ever_be_admitted_is_a_400_naming_the_field():
    # Through the gateway each choice takes one of --max-in-flight slots: a request with more choices than that could
    # never run. Answered 400 naming the field (it was a 429, which the SDKs retry in vain), before any engine work.
    backend = StubBackend(max_streams=4)
    async with http(backend) as client:
        too_many = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "n": 5, "stream": True})
        batch = await client.post("/v1/completions", json={"model": "m", "prompt": ["a"] * 5})
        fits = await client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"], "n": 2})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    assert batch.status_code == 400 and batch.json()["error"]["param"] == "prompt"
    assert fits.status_code == 200 and len(backend.requests) == 4  # only the request that fits reached the backend


def test_the_gateway_bounds_a_request_by_its_admission_limit():
    from types import SimpleNamespace

    from minedraft.gateway.http import GatewayBackend
    from minedraft.gateway.policy import Admission

    router = SimpleNamespace(admission=Admission(3))
    assert GatewayBackend(router, lambda: True).max_streams() == 3  # type: ignore[arg-type]


async def test_a_fanned_out_stream_starts_its_choices_in_index_order():
    # Later choices answer first here. OpenAI's and vLLM's servers send each choice's first chunk in index order, and
    # the official SDK's stream accumulator relies on it: a first chunk of choice 1 raised IndexError there.
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    backend = FanStub(tokens=3, start_ticks={0: 40, 1: 20})
    async with http(backend) as client:
        response = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "x"}], "n": 3, "stream": True,
            "logprobs": True})
    chunks = [e for e in sse_payloads(response.text) if e != "[DONE]"]
    first_seen: list[int] = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] not in first_seen:
                first_seen.append(choice["index"])
    assert first_seen == [0, 1, 2]
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    final = state.current_completion_snapshot  # (get_final_completion refuses a "length" finish: it parses)
    assert [(c.index, c.message.content) for c in final.choices] == [(0, "0.0.0."), (1, "1.1.1."), (2, "2.2.2.")]
