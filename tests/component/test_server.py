"""The engine server over the shared PSD engine (real vLLM), alone and behind the gateway, and the client CLI.

Each test wraps the session's psd engine in its own AsyncEngine and aio server on a loopback port, and shuts the
AsyncEngine down with shutdown_engine=False so the shared engine survives for the other tests.
"""

from __future__ import annotations

import asyncio
import json
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2

from minedraft.api import pb, pb_grpc
from minedraft.engine.async_engine import AsyncEngine
from minedraft.engine.requests import SamplingSettings
from minedraft.gateway.app import Gateway, GatewayConfig
from minedraft.server.app import EngineServer
from minedraft.server.servicer import INVALID_FIELD_KEY

from .conftest import MAX_MODEL_LEN
from .driver import reference
from .grpc_helpers import wait_for, wait_for_health

pytestmark = pytest.mark.engine

MAX_TOKENS = 24
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def texts(pair_dir) -> list[str]:
    from minedraft.bench.workload import bench_prompts

    return bench_prompts(pair_dir, 2, chars=120)


@pytest.fixture(scope="module")
def references(ar_engine, texts) -> list[list[int]]:
    """The target alone, greedy: what every path through the API must reproduce token for token."""
    return reference(ar_engine, [ar_engine.encode_prompt(t) for t in texts], SamplingSettings(max_tokens=MAX_TOKENS))


@pytest.fixture
def engine_calls(psd, monkeypatch) -> dict[str, list[str]]:
    """Request ids the engine itself was given (add_request) and told to abort (abort)."""
    calls: dict[str, list[str]] = {"added": [], "aborted": []}
    add_request, abort = psd.add_request, psd.abort

    def recording_add(request_id, prompt_token_ids, sampling):
        calls["added"].append(request_id)
        add_request(request_id, prompt_token_ids, sampling)

    def recording_abort(request_ids):
        calls["aborted"].extend(request_ids)
        abort(request_ids)

    monkeypatch.setattr(psd, "add_request", recording_add)
    monkeypatch.setattr(psd, "abort", recording_abort)
    return calls


@pytest.fixture
async def served(psd, engine_calls):
    engine = AsyncEngine(psd)
    server = EngineServer("replica-test")
    await server.start()
    await server.attach(engine)
    yield server, engine, f"127.0.0.1:{server.port}"
    await server.stop()
    await engine.shutdown(shutdown_engine=False)


@pytest.fixture
async def gateway_target(served) -> str:
    _server, _, target = served
    gateway = Gateway(GatewayConfig(health_retry_seconds=0.05))
    await gateway.start()
    gateway.set_engines([target])
    await wait_for(lambda: any(e.healthy for e in gateway.endpoints), what="engine healthy at the gateway")
    yield f"127.0.0.1:{gateway.port}"
    await gateway.stop()


def greedy(text: str, max_tokens: int = MAX_TOKENS, request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=text, request_id=request_id,
                              sampling_params=pb.SamplingParams(max_tokens=max_tokens))


async def no_unfinished(engine: AsyncEngine) -> None:
    for _ in range(3000):
        if not await engine.call(lambda e: e.has_unfinished_requests()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine still has unfinished requests")


async def test_end_to_end_client_gateway_server_matches_the_target_alone(gateway_target, texts, references):
    """client CLI -> gateway -> engine server -> PSD engine: greedy tokens identical to the target's own."""

    async def run_client(text: str) -> list[dict]:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "minedraft.cli", "client", "generate", "--target", gateway_target, "--prompt", text,
            "--max-tokens", str(MAX_TOKENS), "--json", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stdout, stderr = await asyncio.wait_for(process.communicate(), 120)
        assert process.returncode == 0, stderr.decode()[-2000:]
        return [json.loads(line) for line in stdout.decode().splitlines()]

    outputs = await asyncio.gather(*(run_client(t) for t in texts))
    for i, lines in enumerate(outputs):
        tokens = [t for line in lines for t in line["token_ids"]]
        assert tokens == references[i], f"prompt {i} diverged through the API"
        final = lines[-1]
        assert final["finish_reason"] in ("length", "stop")
        assert final["usage"]["completion_tokens"] == len(tokens)
        assert final["speculation"]["num_draft_tokens"] > 0, "psd drafted nothing"
        assert all(line["finish_reason"] == "" for line in lines[:-1])


async def test_streams_deltas_with_final_usage_and_speculation(served, texts, references, psd):
    _, _, target = served
    async with grpc.aio.insecure_channel(target) as channel:
        responses = [r async for r in pb_grpc.GenerationStub(channel).Generate(greedy(texts[0], request_id="s-1"))]
    assert len(responses) > 1, "tokens arrive as a stream"
    assert [t for r in responses for t in r.token_ids] == references[0]
    final = responses[-1]
    assert final.request_id == "s-1" and final.finish_reason in ("length", "stop")
    assert final.usage.prompt_tokens == len(psd.encode_prompt(texts[0]))
    assert final.usage.completion_tokens == len(references[0])
    assert 0 <= final.speculation.num_accepted_tokens <= final.speculation.num_draft_tokens
    assert final.speculation.num_draft_tokens > 0
    assert "".join(r.text for r in responses) == psd.tokenizer.decode(references[0])


async def test_cancel_aborts_the_request_in_the_engine(served, gateway_target, engine_calls, texts):
    _, engine, _ = served
    long = pb.GenerateRequest(prompt=texts[1], request_id="cancel-me",
                              sampling_params=pb.SamplingParams(max_tokens=400, ignore_eos=True))
    async with grpc.aio.insecure_channel(gateway_target) as channel:
        call = pb_grpc.GenerationStub(channel).Generate(long)
        got = 0
        async for response in call:
            got += len(response.token_ids)
            if got >= 3:
                call.cancel()
                break
    await wait_for(lambda: "cancel-me" in engine_calls["aborted"], timeout_seconds=30, what="the engine abort")
    await no_unfinished(engine)


async def test_deadline_expiry_aborts_the_request(served, engine_calls, texts):
    _, engine, target = served
    long = pb.GenerateRequest(prompt=texts[0], request_id="deadline-1",
                              sampling_params=pb.SamplingParams(max_tokens=400, ignore_eos=True))
    async with grpc.aio.insecure_channel(target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in pb_grpc.GenerationStub(channel).Generate(long, timeout=0.3)]
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_for(lambda: "deadline-1" in engine_calls["aborted"], timeout_seconds=30, what="the engine abort")
    await no_unfinished(engine)


TOO_LONG = MAX_MODEL_LEN + 10


@pytest.mark.parametrize(("request_", "field"), [
    (pb.GenerateRequest(), "prompt"),
    (pb.GenerateRequest(prompt="def f():", prompt_token_ids=[1, 2]), "prompt"),
    (pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(max_tokens=0)), "sampling_params.max_tokens"),
    (pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(max_tokens=MAX_MODEL_LEN)),
     "sampling_params.max_tokens"),
    (pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(temperature=-0.5)),
     "sampling_params.temperature"),
    (pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(top_p=0.0)), "sampling_params.top_p"),
    (pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(top_p=1.01)), "sampling_params.top_p"),
    (pb.GenerateRequest(prompt_token_ids=[1, 2, 10**6]), "prompt_token_ids"),
    (pb.GenerateRequest(prompt_token_ids=[5] * TOO_LONG), "prompt_token_ids"),
    (pb.GenerateRequest(prompt="import os\n" * 400), "prompt"),
], ids=["empty", "both", "max-tokens-0", "max-tokens-over-context", "temperature", "top-p-0", "top-p-over-1",
        "oov-token", "token-prompt-too-long", "text-prompt-too-long"])
async def test_invalid_fields_are_named_and_touch_no_engine_state(gateway_target, engine_calls, request_, field):
    """INVALID_ARGUMENT from the engine server, unchanged through the gateway; the engine never sees the request."""
    async with grpc.aio.insecure_channel(gateway_target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in pb_grpc.GenerationStub(channel).Generate(request_, timeout=30)]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (info.value.details() or "").startswith(f"{field}: ")
    assert (INVALID_FIELD_KEY, field) in tuple(info.value.trailing_metadata())
    assert engine_calls["added"] == []


async def test_model_and_server_info(served):
    _server, _, target = served
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        model = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        info = await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert (model.mode, model.max_model_len, model.vocab_size) == ("psd", MAX_MODEL_LEN, 2048)
    assert model.model.endswith("target") and model.draft_model.endswith("draft") and model.num_speculative_tokens == 3
    assert (info.replica_id, info.state, info.num_running_requests, info.num_waiting_requests) == (
        "replica-test", "serving", 0, 0)


async def test_health_through_startup_and_graceful_shutdown(psd, engine_calls, texts):
    server = EngineServer("replica-lifecycle")
    engine = AsyncEngine(psd)
    try:
        await server.start()
        target = f"127.0.0.1:{server.port}"
        # Loading: bound and answering health, NOT_SERVING; Generate refused with UNAVAILABLE (retry elsewhere).
        await wait_for_health(target, NOT_SERVING)
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [r async for r in stub.Generate(greedy(texts[0]), timeout=10)]
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in info.value.details()
            assert (await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)).state == "loading"
            await server.attach(engine)
            await wait_for_health(target, SERVING)
            # Draining: NOT_SERVING at once, new streams refused, the open one runs to its end within the grace.
            open_call = stub.Generate(greedy(texts[0], max_tokens=60, request_id="in-flight"), timeout=60)
            first = await open_call.read()
            drain = asyncio.create_task(server.drain(grace_seconds=60))
            await wait_for_health(target, NOT_SERVING)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [r async for r in stub.Generate(greedy(texts[1]), timeout=10)]
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in info.value.details()
            rest = [first]
            while (response := await open_call.read()) is not grpc.aio.EOF:
                rest.append(response)
            assert rest[-1].finish_reason in ("length", "stop"), "the open stream finished normally"
            await asyncio.wait_for(drain, 30)
            assert "in-flight" not in engine_calls["aborted"]
    finally:
        await server.stop()
        await engine.shutdown(shutdown_engine=False)

    # Grace period over: what is still open is cancelled, which aborts it in the engine.
    server = EngineServer("replica-short-grace")
    engine = AsyncEngine(psd)
    try:
        await server.start()
        await server.attach(engine)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
                prompt=texts[1], request_id="cut-off", sampling_params=pb.SamplingParams(max_tokens=400,
                                                                                          ignore_eos=True)))
            await call.read()
            await server.drain(grace_seconds=0.2)
            with pytest.raises(grpc.aio.AioRpcError):
                while await call.read() is not grpc.aio.EOF:
                    pass
        await wait_for(lambda: "cut-off" in engine_calls["aborted"], timeout_seconds=30, what="the engine abort")
        await no_unfinished(engine)
    finally:
        await server.stop()
        await engine.shutdown(shutdown_engine=False)
