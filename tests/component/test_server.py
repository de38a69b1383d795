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
from google.rpc import code_pb2, error_details_pb2
from grpc_health.v1 import health_pb2
from grpc_status import rpc_status

from minedraft.api import pb, pb_grpc
from minedraft.api.grpc_policy import LIVENESS_SERVICE
from minedraft.engine.async_engine import AsyncEngine
from minedraft.engine.requests import SamplingSettings
from minedraft.gateway.app import Gateway, GatewayConfig
from minedraft.server.app import EngineServer
from minedraft.server.servicer import INVALID_FIELD_KEY

from .conftest import MAX_MODEL_LEN
from .device_checks import on_gpu
from .driver import reference
from .grpc_helpers import health_status, wait_for, wait_for_health

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
    # The engine ran it under an id of its own (ids are per stream, not the client's): that one is aborted.
    await wait_for(lambda: engine_calls["aborted"] == engine_calls["added"] != [], timeout_seconds=30,
                   what="the engine abort")
    assert engine_calls["added"] != ["cancel-me"]
    await no_unfinished(engine)


async def test_deadline_expiry_aborts_the_request(served, engine_calls, texts):
    _, engine, target = served
    long = pb.GenerateRequest(prompt=texts[0], request_id="deadline-1",
                              sampling_params=pb.SamplingParams(max_tokens=400, ignore_eos=True))
    async with grpc.aio.insecure_channel(target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in pb_grpc.GenerationStub(channel).Generate(long, timeout=0.3)]
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_for(lambda: engine_calls["aborted"] == engine_calls["added"] != [], timeout_seconds=30,
                   what="the engine abort")
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
    (pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(stop=["a"] * 20_000)), "sampling_params.stop"),
    (pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(stop=["a" * 100_000])),
     "sampling_params.stop"),
    (pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(stop_token_ids=[1] * 1000)),
     "sampling_params.stop_token_ids"),
], ids=["empty", "both", "max-tokens-0", "max-tokens-over-context", "temperature", "top-p-0", "top-p-over-1",
        "oov-token", "token-prompt-too-long", "text-prompt-too-long", "stop-count", "stop-length",
        "stop-token-ids-count"])
async def test_invalid_fields_are_named_and_touch_no_engine_state(gateway_target, engine_calls, request_, field):
    """INVALID_ARGUMENT from the engine server, unchanged through the gateway; the engine never sees the request."""
    async with grpc.aio.insecure_channel(gateway_target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in pb_grpc.GenerationStub(channel).Generate(request_, timeout=30)]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (info.value.details() or "").startswith(f"{field}: ")
    assert (INVALID_FIELD_KEY, field) in tuple(info.value.trailing_metadata())  # legacy, kept for 0.1.x
    # gRPC's rich error model, read as any grpcio client reads it: a BadRequest naming the field's path.
    status = rpc_status.from_call(info.value)  # type: ignore[arg-type]
    assert status is not None and status.code == code_pb2.INVALID_ARGUMENT
    bad_request = error_details_pb2.BadRequest()
    assert len(status.details) == 1 and status.details[0].Unpack(bad_request)
    assert [v.field for v in bad_request.field_violations] == [field]
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
    assert info.dtype == ("bfloat16" if on_gpu() else "float32")  # the effective dtype, never "auto"


async def test_health_through_startup_and_graceful_shutdown(psd, engine_calls, texts):
    server = EngineServer("replica-lifecycle")
    engine = AsyncEngine(psd)
    try:
        await server.start()
        target = f"127.0.0.1:{server.port}"
        # Loading: bound and answering health, NOT_SERVING; Generate refused with UNAVAILABLE (retry elsewhere).
        # Liveness is SERVING throughout: loading is no reason to restart the process.
        await wait_for_health(target, NOT_SERVING)
        assert await health_status(target, LIVENESS_SERVICE) == SERVING
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [r async for r in stub.Generate(greedy(texts[0]), timeout=10)]
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in info.value.details()
            loading = await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
            assert (loading.state, loading.dtype) == ("loading", "")
            await server.attach(engine)
            await wait_for_health(target, SERVING)
            # Draining: NOT_SERVING at once, new streams refused, the open one runs to its end within the grace.
            open_call = stub.Generate(greedy(texts[0], max_tokens=60, request_id="in-flight"), timeout=60)
            first = await open_call.read()
            drain = asyncio.create_task(server.drain(grace_seconds=60))
            await wait_for_health(target, NOT_SERVING)
            assert await health_status(target, LIVENESS_SERVICE) == SERVING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [r async for r in stub.Generate(greedy(texts[1]), timeout=10)]
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in info.value.details()
            rest = [first]
            while (response := await open_call.read()) is not grpc.aio.EOF:
                rest.append(response)
            assert rest[-1].finish_reason in ("length", "stop"), "the open stream finished normally"
            await asyncio.wait_for(drain, 30)
            assert engine_calls["aborted"] == []
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
            tokens = len((await call.read()).token_ids)
            drain = asyncio.create_task(server.drain(grace_seconds=0.2))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while (response := await call.read()) is not grpc.aio.EOF:
                    tokens += len(response.token_ids)
            await drain
        # The caller learns why and how far it got (not gRPC's "Cancelling all calls").
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details() == ("replica replica-short-grace shutting down: stream cut at the end of the "
                                        f"drain grace period after {tokens} tokens")
        await wait_for(lambda: engine_calls["aborted"] == engine_calls["added"][-1:], timeout_seconds=30,
                       what="the engine abort")
        await no_unfinished(engine)
    finally:
        await server.stop()
        await engine.shutdown(shutdown_engine=False)


async def test_a_giant_prompt_is_refused_at_once_and_disturbs_no_one(served, texts, references):
    """A 3.9 MB prompt (under the 4 MiB message limit) is refused with INVALID_ARGUMENT naming `prompt` before it is
    tokenized; meanwhile a normal stream completes and every health check answers within 1 s."""
    _, _, target = served
    giant = pb.GenerateRequest(prompt="def f(x):\n    return x\n" * 170_000,
                               sampling_params=pb.SamplingParams(max_tokens=4))
    assert 3_800_000 < len(giant.prompt) < 4 * 2**20 - 1000
    health_answers: list[int] = []

    async def probe_health() -> None:
        for _ in range(10):
            health_answers.append(await health_status(target, timeout_seconds=1.0))
            await asyncio.sleep(0.05)

    async with grpc.aio.insecure_channel(target, options=(("grpc.max_send_message_length", 8 * 2**20),)) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def giant_call() -> grpc.aio.AioRpcError:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [r async for r in stub.Generate(giant, timeout=30)]
            return info.value

        async def normal_call() -> list[int]:
            return [t async for r in stub.Generate(greedy(texts[0]), timeout=120) for t in r.token_ids]

        error, tokens, _ = await asyncio.gather(giant_call(), normal_call(), probe_health())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and (error.details() or "").startswith("prompt: is ")
    assert (INVALID_FIELD_KEY, "prompt") in tuple(error.trailing_metadata())
    assert tokens == references[0]
    assert health_answers == [SERVING] * 10


async def test_request_ids_are_per_stream_whatever_the_client_sends(served, engine_calls, texts, references):
    """Two callers using the same request id: both complete, each sees its own id, the engine ran two distinct
    ids (neither learns of the other; a guessed id cannot fail someone else's request)."""
    _, _, target = served
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def run(text: str) -> list[pb.GenerateResponse]:
            return [r async for r in stub.Generate(greedy(text, request_id="dup-1"), timeout=120)]

        first, second = await asyncio.gather(run(texts[0]), run(texts[1]))
    assert [t for r in first for t in r.token_ids] == references[0]
    assert [t for r in second for t in r.token_ids] == references[1]
    assert {r.request_id for r in first + second} == {"dup-1"}
    assert len(set(engine_calls["added"])) == 2 and "dup-1" not in engine_calls["added"]


async def test_garbage_bytes_and_reflection_v1_on_the_engine_server(served):
    from grpc_reflection.v1alpha import reflection_pb2

    _, _, target = served
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_stream("/minedraft.v1.Generation/Generate", request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)(b"\xff\xfe garbage", timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in call]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        reflect = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)(timeout=10)
        await reflect.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        response = await reflect.read()
        await reflect.done_writing()
    assert "minedraft.v1.Generation" in {s.name for s in response.list_services_response.service}


async def test_readiness_follows_the_engine_loop(psd):
    """A replica whose engine loop stops answering (stuck in a step) goes NOT_SERVING, and SERVING again once it
    answers; liveness stays SERVING throughout (the process is alive; a restart would not help a slow step)."""
    import time

    server = EngineServer("replica-stuck", engine_check_interval_seconds=0.1, engine_check_timeout_seconds=0.5)
    engine = AsyncEngine(psd)
    try:
        await server.start()
        await server.attach(engine)
        target = f"127.0.0.1:{server.port}"
        await wait_for_health(target, SERVING)
        stuck = asyncio.ensure_future(engine.call(lambda _: time.sleep(4)))  # the engine thread busy for 4 s
        await wait_for_health(target, NOT_SERVING, timeout_seconds=4)
        assert await health_status(target, LIVENESS_SERVICE) == SERVING
        await stuck
        await wait_for_health(target, SERVING, timeout_seconds=10)
    finally:
        await server.stop()
        await engine.shutdown(shutdown_engine=False)


def test_the_front_ends_own_tokenizer_encodes_and_renders_as_the_engines(psd, texts):
    """An engine process's front end loads the tokenizer itself (load_tokenizer) and encodes prompts before anything
    reaches the engine: ids and chat renderings must be the engine's own, or the engine process would compute on a
    different prompt than the in-process path."""
    from minedraft.engine.engine_process import load_tokenizer

    own = load_tokenizer(psd.settings)
    for text in [*texts[:4], "  leading spaces, ünïcödé and\ttabs\n", "def f(x):\n    return x ** 2\n"]:
        assert own.encode(text) == psd.tokenizer.encode(text), text
    assert own.get_vocab() == psd.tokenizer.get_vocab()
    messages = [{"role": "user", "content": texts[0]}]
    if getattr(psd.tokenizer, "chat_template", None):
        assert (own.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                == psd.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_front_end_detokenisation_and_stop_strings_equal_the_engines(psd, texts):
    """An engine process is asked for token ids only and its front end makes the text and matches stop strings
    (detokenize.py). On the real psd engine (steps that accept several tokens at once), the same greedy request with a
    stop string, once as vLLM runs it in-process and once token ids only through the front end's detokenizer, must
    give the same text, token ids, output count and finish reason."""
    from minedraft.engine.detokenize import StreamDetokenizer

    prompt = psd.encode_prompt(texts[1])
    plain = _run(psd, "plain", prompt, SamplingSettings(max_tokens=40, ignore_eos=True))
    text = "".join(d.text for d in plain)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    # With log-probabilities: the tokens cut after the stop string take theirs with them, in both.
    sampling = SamplingSettings(max_tokens=40, ignore_eos=True, stop=(stop, "\x00never"), logprobs=1)
    in_engine = _run(psd, "in-engine", prompt, sampling)
    detokenizer = StreamDetokenizer(psd.tokenizer, "front-end", prompt, sampling)
    front_end = []
    for delta in _run(psd, "front-end", prompt, sampling, detokenize=False):
        made, stopped_here = detokenizer.apply(delta)
        front_end.append(made)
        if made.finished:
            if stopped_here:
                psd.abort(["front-end"])
            break
    assert in_engine[-1].finish_reason == front_end[-1].finish_reason == "stop"
    assert "".join(d.text for d in front_end) == "".join(d.text for d in in_engine) == text.split(stop)[0]
    assert [t for d in front_end for t in d.token_ids] == [t for d in in_engine for t in d.token_ids]
    assert front_end[-1].num_output_tokens == in_engine[-1].num_output_tokens
    for deltas in (front_end, in_engine):
        assert all(len(d.logprobs) == len(d.token_ids) for d in deltas if d.token_ids)
    assert [e.logprob for d in front_end for e in d.logprobs or ()] == pytest.approx(
        [e.logprob for d in in_engine for e in d.logprobs or ()], abs=1e-4)


def _run(engine, request_id: str, prompt: list[int], sampling: SamplingSettings, detokenize: bool = True) -> list:
    if detokenize:
        engine.add_request(request_id, prompt, sampling)
    else:
        engine.add_request(request_id, prompt, sampling, detokenize=False)
    deltas = []
    for _ in range(2000):
        for delta in engine.step():
            if delta.request_id == request_id:
                deltas.append(delta)
        if deltas and deltas[-1].finished:
            return deltas
    raise AssertionError(f"{request_id} did not finish")
