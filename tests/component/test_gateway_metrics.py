"""The gateway's metrics over real gRPC against fake engines (no model): what each counter and gauge says after
retries, admission refusals, failures after tokens and open streams; and `minedraft gateway --metrics-port`."""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.request

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from minedraft.api import pb, pb_grpc
from minedraft.gateway.app import GatewayConfig
from minedraft.testing.fake_engine import FakeBehaviour, FakeEngineServer
from tests.metrics_support import free_port

from .grpc_helpers import wait_for


def request(prompt: str = "abc", tokens: int = 4) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, sampling_params=pb.SamplingParams(max_tokens=tokens))


@pytest.fixture
def gateway_with(fake_stacks):
    async def make(behaviours: list[FakeBehaviour], **config):
        registry = CollectorRegistry()
        made = await fake_stacks.make(behaviours, GatewayConfig(health_retry_seconds=0.05, seed=0, **config),
                                      registry=registry)
        return made.gateway, made.fakes, made.target, registry

    return make


async def stream(target: str, req: pb.GenerateRequest) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(target) as channel:
        try:
            async for _ in pb_grpc.GenerationStub(channel).Generate(req, timeout=10):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_retries_failures_and_codes(gateway_with):
    _, (bad, good), target, registry = await gateway_with(
        [FakeBehaviour(fail_before_first_token=True), FakeBehaviour()], failure_cooldown_seconds=0.0, max_attempts=2)
    codes = [await stream(target, request(f"p{i}")) for i in range(12)]
    assert codes == [grpc.StatusCode.OK] * 12
    retries = sample(registry, "minedraft_gateway_retries_total")
    assert retries == len(bad.record.failed) > 0, "each failed first attempt is one retry"
    assert sample(registry, "minedraft_gateway_route_seconds_count") == 12 + retries
    assert sample(registry, "minedraft_gateway_streams_finished_total", protocol="grpc", code="OK") == 12
    assert sample(registry, "minedraft_gateway_streams_started_total", protocol="grpc") == 12
    assert sample(registry, "minedraft_gateway_time_to_first_response_seconds_count", protocol="grpc") == 12
    # An engine failing after tokens ends the stream UNAVAILABLE: counted as such.
    good.behaviour.fail_after_tokens = 2
    bad.behaviour.fail_before_first_token = False
    bad.behaviour.fail_after_tokens = 2
    assert await stream(target, request("late", 6)) is grpc.StatusCode.UNAVAILABLE
    assert sample(registry, "minedraft_gateway_streams_finished_total", protocol="grpc", code="UNAVAILABLE") == 1


async def test_admission_rejections_and_open_stream_gauges(gateway_with):
    _, (fake,), target, registry = await gateway_with([FakeBehaviour(token_interval_seconds=0.05)],
                                                      max_in_flight=1)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        open_call = stub.Generate(request("long", 100), timeout=30)
        await open_call.read()  # the stream is open at the engine
        assert sample(registry, "minedraft_gateway_streams_in_flight") == 1
        assert sample(registry, "minedraft_gateway_engine_outstanding_streams", engine=fake.address) == 1
        assert sample(registry, "minedraft_gateway_endpoints_ready") == 1
        assert await stream(target, request("refused")) is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert sample(registry, "minedraft_gateway_admission_rejected_total") == 1
        open_call.cancel()
    await wait_for(lambda: sample(registry, "minedraft_gateway_streams_in_flight") == 0, what="the stream to close")
    assert sample(registry, "minedraft_gateway_engine_outstanding_streams", engine=fake.address) == 0
    assert sample(registry, "minedraft_gateway_streams_finished_total", protocol="grpc", code="RESOURCE_EXHAUSTED") == 1
    await wait_for(lambda: sample(registry, "minedraft_gateway_streams_finished_total", protocol="grpc",
                                  code="CANCELLED") == 1,
                   what="the cancelled stream to be counted")
    # An engine going away: known but not ready.
    await fake.set_serving(False)
    await wait_for(lambda: sample(registry, "minedraft_gateway_endpoints_ready") == 0, what="engine not ready")
    assert sample(registry, "minedraft_gateway_endpoints_known") == 1
    assert sample(registry, "minedraft_gateway_engine_ready", engine=fake.address) == 0


async def test_gateway_command_serves_its_metrics():
    fake = await FakeEngineServer("fake-cli").start()
    port, metrics_port = free_port(), free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "minedraft.cli", "--log-level", "WARNING", "gateway", "--port", str(port),
        "--engines", fake.address, "--metrics-port", str(metrics_port), "--grace-seconds", "1",
        stderr=asyncio.subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        families: dict[str, float] = {}
        while families.get("minedraft_gateway_endpoints_ready") != 1:
            assert process.returncode is None, "the gateway exited"
            assert time.monotonic() < deadline, f"no ready engine in the gateway's metrics: {families}"
            try:
                text = await asyncio.to_thread(
                    lambda: urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).read())
                families = {s.name: s.value for f in text_string_to_metric_families(text.decode()) for s in f.samples}
            except OSError:
                pass
            await asyncio.sleep(0.1)
        assert "minedraft_gateway_streams_started_total" in families
        assert not any(name.startswith(("python_", "process_")) for name in families), "a registry of its own"
    finally:
        process.terminate()
        await process.wait()
        await fake.stop(0)
