"""The gateway under hostile input and half-dead engines (issue items against fake engine replicas on loopback):
request-caused errors, stalled engines, waiting for an engine, liveness, metadata, garbage bytes, reflection v1,
drain cuts, keepalive, unary calls under admission and drain."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from minedraft.api import pb, pb_grpc
from minedraft.api.grpc_policy import LIVENESS_SERVICE
from minedraft.gateway.app import GatewayConfig
from minedraft.gateway.router import RouterConfig
from minedraft.testing.fake_engine import FakeBehaviour, fake_token_ids

from .gateway_stack import fast_config as config
from .grpc_helpers import health_status, wait_for, wait_for_health

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def stack(fake_stacks):
    async def make(behaviours: list[FakeBehaviour], gateway_config: GatewayConfig | None = None,
                   engines: bool = True, registry: CollectorRegistry | None = None):
        made = await fake_stacks.make(behaviours, gateway_config, engines, registry)
        return made.gateway, made.fakes, made.target

    return make


def request(prompt: str = "hello", max_tokens: int = 5) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, sampling_params=pb.SamplingParams(max_tokens=max_tokens))


async def outcome(target: str, req: pb.GenerateRequest, metadata=(), timeout: float = 10
                  ) -> tuple[list[int], grpc.StatusCode, str]:
    """(tokens received, final status, its message) of one stream."""
    tokens: list[int] = []
    async with grpc.aio.insecure_channel(target) as channel:
        try:
            async for response in pb_grpc.GenerationStub(channel).Generate(req, timeout=timeout, metadata=metadata):
                tokens.extend(response.token_ids)
        except grpc.aio.AioRpcError as exc:
            return tokens, exc.code(), exc.details() or ""
    return tokens, grpc.StatusCode.OK, ""


async def test_a_poison_request_is_its_own_error_and_benches_no_engine(stack):
    """Item 2: an error the request caused (the handler crashed: UNKNOWN) is returned as such, tried once, and every
    other stream meanwhile completes on both engines."""
    behaviours = [FakeBehaviour(token_interval_seconds=0.005, poison_prompt="poison") for _ in range(2)]
    gateway, fakes, target = await stack(behaviours)
    poisoned = [outcome(target, request("poison")) for _ in range(4)]
    others = [outcome(target, request(f"ok-{i}", 4)) for i in range(20)]
    results = await asyncio.gather(*poisoned, *others)
    for tokens, code, message in results[:4]:
        assert code is grpc.StatusCode.UNKNOWN and tokens == []
        assert message == "the engine could not process this request (UNKNOWN)", "no exception text to callers"
    for i, (tokens, code, _) in enumerate(results[4:]):
        assert code is grpc.StatusCode.OK and tokens == fake_token_ids(request(f"ok-{i}", 4), 4)
    assert sum(len(f.record.failed) for f in fakes) == 4, "each poison request reached one engine, once"
    assert all(e.cooldown_until_seconds == 0.0 and not e.unresponsive for e in gateway.endpoints), "none benched"
    assert await health_status(target) == SERVING


async def test_a_stalled_engine_is_left_out_and_the_stream_retried_elsewhere(stack):
    """Item 3: an engine that sends nothing within the first-response timeout loses the stream (retried on the
    other engine) and leaves rotation until its health answers; a stream stalled after tokens ends UNAVAILABLE with
    its token count."""
    frozen, healthy = FakeBehaviour(hang_before_first_token=True), FakeBehaviour()
    gateway, (frozen_fake, healthy_fake), target = await stack(
        [frozen, healthy], config(first_response_timeout_seconds=0.3, idle_timeout_seconds=0.3))
    # Route to the frozen one first: make the healthy one look busy.
    gateway.endpoints.acquire(healthy_fake.address)
    tokens, code, _ = await outcome(target, request("stall", 3))
    assert code is grpc.StatusCode.OK and tokens == fake_token_ids(request("stall", 3), 3)
    assert len(frozen_fake.record.cancelled) == 1 and len(healthy_fake.record.completed) == 1
    gateway.endpoints.release(healthy_fake.address)
    # Its health answers SERVING (only streams hang): it is back in rotation at once.
    await wait_for(lambda: not gateway.endpoints.get(frozen_fake.address).unresponsive, what="back in rotation")
    # Stalled after two tokens: not replayed elsewhere, the caller learns how far it got.
    frozen.hang_before_first_token = False
    frozen.hang_after_tokens = 2
    healthy.hang_after_tokens = 2
    tokens, code, message = await outcome(target, request("late", 5))
    assert code is grpc.StatusCode.UNAVAILABLE and len(tokens) == 2
    assert message == ("the engine stopped responding after 2 tokens delivered; not retried because tokens were "
                       "already streamed")


async def test_a_slow_client_is_not_taken_for_a_stalled_engine(stack):
    """The stall watch counts only time spent waiting for the engine, not time spent writing to the caller."""
    _, (fake,), target = await stack([FakeBehaviour()], config(idle_timeout_seconds=0.2,
                                                               first_response_timeout_seconds=0.2))
    async with grpc.aio.insecure_channel(target) as channel:
        call = pb_grpc.GenerationStub(channel).Generate(request("slow", 6), timeout=20)
        tokens = []
        while (response := await call.read()) is not grpc.aio.EOF:
            tokens.extend(response.token_ids)
            await asyncio.sleep(0.3)  # a reader slower than the idle timeout
    assert tokens == fake_token_ids(request("slow", 6), 6)
    assert fake.record.completed and not fake.record.cancelled


async def test_streams_wait_for_an_engine_bounded_and_counted(stack):
    """Contract 2: with no engine ready a stream waits (the gauge counts it) and runs once one is; past the waiting
    bound it is refused at once with the contract's message."""
    registry = CollectorRegistry()
    gateway, (fake,), target = await stack([FakeBehaviour()], config(max_waiting_streams=1), engines=False,
                                           registry=registry)
    waiting = asyncio.create_task(outcome(target, request("first", 3), timeout=30))
    await wait_for(lambda: registry.get_sample_value("minedraft_gateway_streams_waiting") == 1, what="one waiting")
    tokens, code, message = await outcome(target, request("second"))
    assert (code, message) == (grpc.StatusCode.UNAVAILABLE, "too many streams waiting for an engine")
    assert await health_status(target) == NOT_SERVING
    gateway.set_engines([fake.address])
    tokens, code, _ = await waiting
    assert code is grpc.StatusCode.OK and tokens == fake_token_ids(request("first", 3), 3)
    assert registry.get_sample_value("minedraft_gateway_streams_waiting") == 0


async def test_liveness_serves_at_zero_engines_and_while_draining(stack):
    """Contract 1: liveness SERVING with no engine and during a drain, while readiness is NOT_SERVING."""
    gateway, (fake,), target = await stack([FakeBehaviour(token_interval_seconds=0.02)], engines=False)
    assert await health_status(target, LIVENESS_SERVICE) == SERVING
    assert await health_status(target, "") == NOT_SERVING
    gateway.set_engines([fake.address])
    await wait_for_health(target, SERVING)
    async with grpc.aio.insecure_channel(target) as channel:
        open_call = pb_grpc.GenerationStub(channel).Generate(request(max_tokens=40), timeout=30)
        await open_call.read()
        drain = asyncio.create_task(gateway.drain(grace_seconds=30))
        await wait_for_health(target, NOT_SERVING)
        assert await health_status(target, LIVENESS_SERVICE) == SERVING
        while await open_call.read() is not grpc.aio.EOF:
            pass
    await drain


async def test_only_allowlisted_metadata_reaches_engines(stack):
    _, (fake,), target = await stack([FakeBehaviour()])
    metadata = (("x-api-key", "secret"), ("cookie", "a=b"), ("traceparent", "00-abc-def-01"),
                ("minedraft-tenant", "t1"), ("x-request-id", "r-9"))
    assert (await outcome(target, request(), metadata=metadata))[1] is grpc.StatusCode.OK
    forwarded = dict(fake.record.metadata[0])
    assert "x-api-key" not in forwarded and "cookie" not in forwarded
    assert forwarded["traceparent"] == "00-abc-def-01" and forwarded["minedraft-tenant"] == "t1"
    assert forwarded["x-request-id"] == "r-9"


async def test_errors_do_not_show_engine_addresses(stack):
    _, (fake,), target = await stack([FakeBehaviour(fail_after_tokens=2)])
    tokens, code, message = await outcome(target, request(max_tokens=6))
    assert code is grpc.StatusCode.UNAVAILABLE and len(tokens) == 2 and "2 tokens delivered" in message
    assert str(fake.port) not in message and "127.0.0.1" not in message and "fake" not in message


async def _raw_generate(target: str, payload: bytes) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_stream("/minedraft.v1.Generation/Generate", request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)(payload, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in call]
        return info.value


async def test_garbage_request_bytes_are_invalid_argument(stack, caplog):
    _, (fake,), target = await stack([FakeBehaviour()])
    for server in (target, fake.address):  # the gateway and an engine replica share the decoding
        caplog.clear()
        error = await _raw_generate(server, b"\xff\xff\xff\xff garbage")
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == "request: not a valid minedraft.v1.GenerateRequest request message"
        lines = [r for r in caplog.records if "undecodable" in r.getMessage()]
        assert len(lines) == 1 and not any(r.exc_info for r in caplog.records)
    assert fake.record.requests == []


async def test_reflection_v1_and_v1alpha(stack):
    from grpc_reflection.v1alpha import reflection_pb2

    _, (fake,), target = await stack([FakeBehaviour()])
    for server in (target, fake.address):
        for package in ("grpc.reflection.v1", "grpc.reflection.v1alpha"):
            async with grpc.aio.insecure_channel(server) as channel:
                call = channel.stream_stream(
                    f"/{package}.ServerReflection/ServerReflectionInfo",
                    request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                    response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)(timeout=10)
                await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
                response = await call.read()
                await call.done_writing()
            names = {s.name for s in response.list_services_response.service}
            assert "minedraft.v1.Generation" in names and "grpc.reflection.v1.ServerReflection" in names, package
    # Every listed service can be described (`grpcurl describe`): v1's descriptors too, though the library ships
    # only v1alpha's (was NOT_FOUND).
    from google.protobuf import descriptor_pb2

    for server in (target, fake.address):
        async with grpc.aio.insecure_channel(server) as channel:
            call = channel.stream_stream(
                "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)(timeout=10)
            for symbol in ("grpc.reflection.v1.ServerReflection", "minedraft.v1.Generation"):
                await call.write(reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol))
                response = await call.read()
                assert response.WhichOneof("message_response") == "file_descriptor_response", (symbol, response)
                files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                         for raw in response.file_descriptor_response.file_descriptor_proto]
                assert any(symbol.rsplit(".", 1)[1] in {s.name for s in f.service} for f in files), symbol
            await call.done_writing()


async def test_drain_grace_cut_says_why_and_how_far(stack):
    gateway, _, target = await stack([FakeBehaviour(token_interval_seconds=0.05)])
    async with grpc.aio.insecure_channel(target) as channel:
        call = pb_grpc.GenerationStub(channel).Generate(request(max_tokens=1000), timeout=30)
        tokens = list((await call.read()).token_ids)
        drain = asyncio.create_task(gateway.drain(grace_seconds=0.3))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while (response := await call.read()) is not grpc.aio.EOF:
                tokens.extend(response.token_ids)
        await drain
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == ("gateway shutting down: stream cut at the end of the drain grace period after "
                                    f"{len(tokens)} tokens delivered")


async def test_unary_calls_go_through_admission_and_drain(stack):
    gateway, _, target = await stack([FakeBehaviour(token_interval_seconds=0.05)], config(max_in_flight=1))
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        open_call = stub.Generate(request(max_tokens=200), timeout=30)
        await open_call.read()
        for unary in (stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5),
                      stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await unary
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        open_call.cancel()
        await wait_for(lambda: gateway.admission.in_flight == 0, what="slot released")
        assert (await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)).model == "fake"
        gateway.router.draining = True
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE and "shutting down" in info.value.details()


async def test_deadline_exceeded_is_counted_as_such(stack):
    registry = CollectorRegistry()
    _, _, target = await stack([FakeBehaviour(token_interval_seconds=0.05)], registry=registry)
    assert (await outcome(target, request(max_tokens=100), timeout=0.3))[1] is grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_for(lambda: registry.get_sample_value("minedraft_gateway_streams_finished_total",
                                                     {"protocol": "grpc", "code": "DEADLINE_EXCEEDED"}) == 1,
                   what="counted")
    assert registry.get_sample_value("minedraft_gateway_streams_finished_total",
                                     {"protocol": "grpc", "code": "CANCELLED"}) == 0


def test_policy_servers_accept_the_channels_ping_rate():
    """Item 4: one policy; servers accept pings at the rate the product's channels send them (gRPC's default server
    policy allows one ping per 5 minutes and answers the third early one with a too_many_pings GOAWAY)."""
    from minedraft.api import grpc_policy

    server = dict(grpc_policy.SERVER_OPTIONS)
    channel = dict(grpc_policy.CHANNEL_OPTIONS)
    assert server["grpc.http2.min_recv_ping_interval_without_data_ms"] <= channel["grpc.keepalive_time_ms"]
    assert server["grpc.http2.max_ping_strikes"] == 0 and server["grpc.keepalive_permit_without_calls"] == 1


def test_router_config_rejects_nonsense():
    for bad in (dict(max_attempts=0), dict(max_attempts=-1), dict(idle_timeout_seconds=0.0),
                dict(max_waiting_streams=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RouterConfig(**bad)


async def test_idle_timeout_alone_still_watches_between_responses(stack):
    """With the first-response limit off, a stream that stalls after tokens is still cut by the idle limit."""
    _, _, target = await stack([FakeBehaviour(hang_after_tokens=2)],
                               config(first_response_timeout_seconds=None, idle_timeout_seconds=0.3))
    tokens, code, message = await outcome(target, request("idle-only", 5))
    assert code is grpc.StatusCode.UNAVAILABLE and len(tokens) == 2 and "stopped responding" in message


async def test_readiness_does_not_count_an_engine_left_out_for_a_stall(stack):
    gateway, (fake,), target = await stack([FakeBehaviour()])
    await wait_for_health(target, SERVING)
    gateway.endpoints.set_unresponsive(fake.address, True)  # what a stalled call does (before its probe answers)
    gateway._health_changed()
    await wait_for_health(target, NOT_SERVING)
    assert await health_status(target, LIVENESS_SERVICE) == SERVING
