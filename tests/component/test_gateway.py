"""The gateway against fake engine replicas: real aio gRPC servers on loopback ports, no model."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2
from grpc_health.v1 import health_pb2
from grpc_status import rpc_status

from minedraft.api import pb, pb_grpc
from minedraft.gateway.app import Gateway, GatewayConfig, TlsFiles
from minedraft.gateway.discovery import KubernetesApi
from minedraft.testing.fake_engine import FakeBehaviour, FakeEngineServer, fake_token_ids

from .gateway_stack import fast_config
from .grpc_helpers import _self_signed_cert_cryptography, _self_signed_cert_openssl, wait_for, wait_for_health

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def stack(fake_stacks):
    """make(behaviours, config) -> (gateway, fakes, target): fakes started, gateway routing to them and ready."""

    async def make(behaviours: list[FakeBehaviour], config: GatewayConfig | None = None,
                   engines: bool = True) -> tuple[Gateway, list[FakeEngineServer], str]:
        made = await fake_stacks.make(behaviours, config, engines)
        return made.gateway, made.fakes, made.target

    return make


def request(prompt: str = "hello", max_tokens: int = 5) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, sampling_params=pb.SamplingParams(max_tokens=max_tokens))


async def collect(target: str, req: pb.GenerateRequest, **kwargs) -> list[pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(target) as channel:
        return [r async for r in pb_grpc.GenerationStub(channel).Generate(req, **kwargs)]


async def test_streams_tokens_through_and_forwards_the_deadline(stack):
    gateway, (fake,), target = await stack([FakeBehaviour(token_interval_seconds=0.001)])
    responses = await collect(target, request("abc", 6), timeout=30)
    assert [t for r in responses for t in r.token_ids] == fake_token_ids(request("abc", 6), 6)
    assert len(responses) == 6 and responses[-1].finish_reason == "length"
    assert responses[-1].usage.completion_tokens == 6
    assert fake.record.completed and not fake.record.cancelled
    forwarded_deadline = fake.record.deadlines_seconds[0]
    assert forwarded_deadline is not None and 25 < forwarded_deadline <= 30.5  # the wire rounds up
    assert gateway.admission.in_flight == 0 and all(e.outstanding == 0 for e in gateway.endpoints)


async def test_client_cancel_cancels_the_engine_stream(stack):
    gateway, (fake,), target = await stack([FakeBehaviour(token_interval_seconds=0.02)])
    async with grpc.aio.insecure_channel(target) as channel:
        call = pb_grpc.GenerationStub(channel).Generate(request(max_tokens=500))
        received = 0
        async for _ in call:
            received += 1
            if received == 2:
                call.cancel()
                break
    await wait_for(lambda: len(fake.record.cancelled) == 1, what="the engine to see the cancel")
    assert not fake.record.completed
    await wait_for(lambda: gateway.admission.in_flight == 0, what="admission released")


async def test_deadline_expiry_ends_the_stream_and_the_engine_call(stack):
    # The deadline must leave room for the request to reach the engine on a loaded machine (0.5 s did not: the call
    # expired in the gateway); the stream (1,000 tokens at 50 ms) outlasts it by far.
    deadline_seconds = 3.0
    _, (fake,), target = await stack([FakeBehaviour(token_interval_seconds=0.05)])
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(target, request(max_tokens=1000), timeout=deadline_seconds)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The engine sees the client's deadline passed on, not a fresh or a missing one. gRPC core encodes a timeout
    # compactly and may round it up at each hop, so the remaining time read at the engine can exceed the client's
    # deadline a little (0.50003 s of 0.5 s; 3.009 s of 3 s): allowed 2%, far below any fresh deadline.
    assert fake.record.deadlines_seconds, "the request never reached the engine before its deadline"
    assert fake.record.deadlines_seconds[0] is not None
    assert fake.record.deadlines_seconds[0] <= deadline_seconds * 1.02, fake.record.deadlines_seconds
    await wait_for(lambda: len(fake.record.cancelled) == 1, what="the engine stream to end")
    assert not fake.record.completed


async def test_bearer_token_required_when_configured(stack):
    _, (fake,), target = await stack([FakeBehaviour()], fast_config(tokens=(b"s3cret", b"other")))
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [r async for r in stub.Generate(request(), metadata=metadata)]
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetModelInfo(pb.GetModelInfoRequest())
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert fake.record.requests == [], "refused requests never reach an engine"
        responses = [r async for r in stub.Generate(request(), metadata=(("authorization", "Bearer s3cret"),))]
        assert responses[-1].finish_reason == "length"
        info_ok = await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", "Bearer other"),))
        assert info_ok.model == "fake"


@pytest.mark.parametrize("maker", ["openssl", "cryptography"])
async def test_tls_with_a_test_certificate(stack, tmp_path: Path, maker: str):
    if maker == "cryptography":
        pytest.importorskip("cryptography")
    cert, key = (_self_signed_cert_openssl if maker == "openssl" else _self_signed_cert_cryptography)(tmp_path)
    _, _, target = await stack([FakeBehaviour()], fast_config(tls=TlsFiles(cert, key)))
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    async with grpc.aio.secure_channel(target, credentials) as channel:
        responses = [r async for r in pb_grpc.GenerationStub(channel).Generate(request(), timeout=10)]
    assert responses[-1].finish_reason == "length"
    with pytest.raises(grpc.aio.AioRpcError) as info:  # plaintext to a TLS port fails
        await collect(target, request(), timeout=2)
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def test_failover_before_the_first_token(stack):
    _gateway, (bad, good), target = await stack(
        [FakeBehaviour(fail_before_first_token=True), FakeBehaviour()], fast_config(failure_cooldown_seconds=0.0))
    for i in range(30):
        responses = await collect(target, request(f"p{i}", 4), timeout=10)
        assert [t for r in responses for t in r.token_ids] == fake_token_ids(request(f"p{i}", 4), 4)
        if bad.record.failed:
            break
    assert bad.record.failed, "P2C never tried the failing engine in 30 streams"
    assert len(good.record.completed) == i + 1, "every stream completed, the failed attempt retried on the other"


async def test_engine_failure_after_tokens_is_unavailable_with_the_count(stack):
    _, (dying,), target = await stack([FakeBehaviour(fail_after_tokens=3)])
    received: list[int] = []
    async with grpc.aio.insecure_channel(target) as channel:
        call = pb_grpc.GenerationStub(channel).Generate(request(max_tokens=10), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for response in call:
                received.extend(response.token_ids)
    assert len(received) == 3
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "3 tokens delivered" in (info.value.details() or "")
    assert len(dying.record.failed) == 1


async def test_no_retry_once_tokens_were_streamed(stack):
    gateway, (_first, second), target = await stack([FakeBehaviour(fail_after_tokens=2), FakeBehaviour()])
    # Route the stream to `first`: make `second` look busy so P2C prefers `first`.
    gateway.endpoints.acquire(second.address)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(target, request(max_tokens=10), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "2 tokens delivered" in info.value.details()
    assert second.record.requests == [], "a stream that already delivered tokens must not be replayed elsewhere"


async def test_admission_bound_answers_resource_exhausted_at_once(stack):
    gateway, _, target = await stack([FakeBehaviour(token_interval_seconds=0.05)], fast_config(max_in_flight=2))
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        calls = [stub.Generate(request(max_tokens=400)) for _ in range(2)]
        for call in calls:
            await call.read()  # both streams are open and streaming
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in stub.Generate(request(), timeout=10)]
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert loop.time() - started < 1.0, "refused at once, not queued"
        for call in calls:
            call.cancel()
        await wait_for(lambda: gateway.admission.in_flight == 0, what="slots released")
        responses = [r async for r in stub.Generate(request(max_tokens=2), timeout=10)]
        assert responses[-1].finish_reason == "length"


async def test_invalid_argument_passes_through_unchanged_and_is_not_retried(stack):
    _, fakes, target = await stack([FakeBehaviour(), FakeBehaviour()])
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(target, request(max_tokens=0), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "sampling_params.max_tokens: must be positive, got 0"
    # The legacy trailer, kept for 0.1.x (docs/api.md).
    assert ("minedraft-invalid-field", "sampling_params.max_tokens") in tuple(info.value.trailing_metadata())
    assert sum(len(f.record.requests) for f in fakes) == 0  # the fake rejects before recording: and only once
    assert sum(1 for f in fakes for _ in f.record.failed) == 0


def plain_client_status(target: str, req: pb.GenerateRequest) -> tuple[grpc.RpcError, Any]:
    """A plain (synchronous) grpcio client's view of a refused call: the error and grpcio-status's rich status."""
    with grpc.insecure_channel(target) as channel:
        try:
            list(pb_grpc.GenerationStub(channel).Generate(req, timeout=10))
        except grpc.RpcError as error:
            return error, rpc_status.from_call(error)  # type: ignore[arg-type]
    raise AssertionError("the call was not refused")


async def test_a_field_error_carries_a_bad_request_through_the_gateway(stack):
    """What grpcurl, Envoy and the Go/Java/Python status helpers read: google.rpc.Status in grpc-status-details-bin
    with a BadRequest naming the field's path, passed through the gateway unchanged."""
    _, _, target = await stack([FakeBehaviour()])
    error, status = await asyncio.to_thread(plain_client_status, target, request(max_tokens=0))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert status is not None, "no google.rpc.Status in the trailers"
    assert status.code == code_pb2.INVALID_ARGUMENT
    assert status.message == "sampling_params.max_tokens: must be positive, got 0"
    (detail,) = status.details
    bad_request = error_details_pb2.BadRequest()
    assert detail.Unpack(bad_request)
    assert [(v.field, v.description) for v in bad_request.field_violations] == [
        ("sampling_params.max_tokens", "must be positive, got 0")]


async def test_health_follows_engines_and_shutdown(stack):
    gateway, (fake,), target = await stack([FakeBehaviour(token_interval_seconds=0.02)],
                                           fast_config(engine_wait_timeout_seconds=0.3), engines=False)
    await wait_for_health(target, NOT_SERVING)  # no engine known yet
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(target, request(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == "no engine replica became ready within 0.3 s"
    gateway.set_engines([fake.address])
    await wait_for_health(target, SERVING)
    await fake.set_serving(False)  # the replica starts draining: the gateway stops routing to it at once
    await wait_for_health(target, NOT_SERVING)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(target, request(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "became ready" in info.value.details()
    await fake.set_serving(True)
    await wait_for_health(target, SERVING)
    # Gateway shutdown: NOT_SERVING and new streams refused while an open one runs to its end.
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        open_call = stub.Generate(request(max_tokens=20), timeout=10)
        await open_call.read()
        drain = asyncio.create_task(gateway.drain(grace_seconds=10))
        await wait_for_health(target, NOT_SERVING)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in stub.Generate(request(), timeout=5)]
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = []
        while (response := await open_call.read()) is not grpc.aio.EOF:
            rest.append(response)
        assert rest[-1].finish_reason == "length" and len(rest) == 19
    await asyncio.wait_for(drain, 10)


async def test_unary_calls_are_routed(stack):
    _, (_fake,), target = await stack([FakeBehaviour()])
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        assert (await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)).vocab_size == 2048
        assert (await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)).replica_id == "fake-0"


def _slice(name: str, addresses: list[tuple[str, int, bool]]) -> dict:
    port = addresses[0][1] if addresses else 1
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": "serving", "labels": {"kubernetes.io/service-name": "engines"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}} for ip, _, ready in addresses],
            "ports": [{"name": "grpc", "port": port, "protocol": "TCP"}]}


async def test_endpointslice_discovery_is_watched(kmock, stack):  # kmock torn down last
    """Against kmock's Kubernetes emulator: slices added, made unready and deleted are followed without restart."""
    gateway, fakes, target = await stack([FakeBehaviour(), FakeBehaviour()], engines=False)
    base = str(kmock.url).rstrip("/")
    collection = f"{base}/apis/discovery.k8s.io/v1/namespaces/serving/endpointslices"
    await kmock.post(collection, json=_slice("engines-a", [("127.0.0.1", fakes[0].port, True)]))
    # A slice of another Service in the same namespace: ignored.
    other = _slice("unrelated", [("127.0.0.1", 1, True)])
    other["metadata"]["labels"]["kubernetes.io/service-name"] = "other"
    await kmock.post(collection, json=other)
    gateway.watch_kubernetes(KubernetesApi(base), "serving", "engines", "grpc")

    def addresses() -> set[str]:
        return set(gateway.endpoints.addresses)

    await wait_for(lambda: addresses() == {fakes[0].address}, what="the first slice")
    await wait_for_health(target, SERVING)
    assert (await collect(target, request(), timeout=10))[-1].finish_reason == "length"
    await kmock.post(collection, json=_slice("engines-b", [("127.0.0.1", fakes[1].port, True)]))
    await wait_for(lambda: addresses() == {fakes[0].address, fakes[1].address}, what="a second slice")
    await kmock.patch(f"{collection}/engines-a", json={"endpoints": [
        {"addresses": ["127.0.0.1"], "conditions": {"ready": False}}]})
    await wait_for(lambda: addresses() == {fakes[1].address}, what="an endpoint going unready")
    await kmock.delete(f"{collection}/engines-b")
    await wait_for(lambda: addresses() == set(), what="a deleted slice")
    await wait_for_health(target, NOT_SERVING)


def test_benchmark_quick_run_writes_its_report(tmp_path: Path):
    """The gateway benchmark end to end in its small configuration (fake engine and gateway as processes)."""
    import json

    from minedraft.gateway.bench import main

    out = tmp_path / "gateway.json"
    assert main(["--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (level,) = report["latency"]
    assert level["streams"] == 4 and level["direct"]["errors"] == 0 and level["gateway"]["errors"] == 0
    assert level["gateway"]["per_token_ms"]["samples"] > 0 and "p50" in level["added"]["per_token_ms"]
    assert report["max_concurrent_streams_without_error"] == 100
    assert out.with_suffix(".md").read_text().startswith("# Gateway overhead")
    assert out.with_suffix(".png").stat().st_size > 0


async def test_gateway_process_drains_on_sigterm(tmp_path: Path):
    """`minedraft gateway` as a process: SIGTERM -> NOT_SERVING, new streams refused, the open one finishes, exit 0."""
    import os
    import signal
    import socket
    import sys

    fake = await FakeEngineServer("fake-sigterm", FakeBehaviour(token_interval_seconds=0.05)).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "minedraft.cli", "gateway", "--port", str(port), "--engines", fake.address,
        "--grace-seconds", "30", "--metrics-port", "0",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "GRPC_VERBOSITY": "ERROR"})
    target = f"127.0.0.1:{port}"
    try:
        await wait_for_health(target, SERVING, timeout_seconds=30)
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            open_call = stub.Generate(request(max_tokens=30), timeout=30)
            await open_call.read()
            process.send_signal(signal.SIGTERM)
            await wait_for_health(target, NOT_SERVING)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [r async for r in stub.Generate(request(), timeout=5)]
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = []
            while (response := await open_call.read()) is not grpc.aio.EOF:
                rest.append(response)
            assert len(rest) == 29 and rest[-1].finish_reason == "length"
        assert await asyncio.wait_for(process.wait(), 30) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await fake.stop(0)
