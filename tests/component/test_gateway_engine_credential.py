"""An engine that refuses the gateway's own credential (a token rotated on one side only, a mismatch) is taken out of
rotation with a log line and a metric, its streams go to the engines that accept it, and with none left the caller
gets a 503 / UNAVAILABLE saying so: never the 401 / UNAUTHENTICATED of a caller whose own token was fine. Once the
engine accepts the credential again it is back in rotation."""

from __future__ import annotations

import logging

import grpc
import httpx
from prometheus_client import CollectorRegistry

from minedraft.api import pb, pb_grpc
from minedraft.gateway.app import Gateway
from minedraft.testing.fake_engine import FakeEngineServer

from .gateway_stack import fast_config
from .grpc_helpers import wait_for

CALLER = (("authorization", "Bearer caller-token"),)


def request(prompt: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, sampling_params=pb.SamplingParams(max_tokens=2))


async def outcome(target: str) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(target) as channel:
        try:
            async for _ in pb_grpc.GenerationStub(channel).Generate(request("x"), metadata=CALLER, timeout=20):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def test_an_engine_refusing_the_gateways_credential_leaves_rotation_and_callers_get_503(caplog):
    accepted_by_b = [b"old-engine-token"]
    engine_a = await FakeEngineServer("a", tokens=lambda: (b"engine-token",)).start()
    engine_b = await FakeEngineServer("b", tokens=lambda: tuple(accepted_by_b)).start()
    registry = CollectorRegistry()
    gateway = Gateway(fast_config(tokens=(b"caller-token",), engine_token=lambda: "engine-token",
                                  engine_wait_timeout_seconds=0.5), registry)
    target = f"127.0.0.1:{await gateway.start()}"
    base_url = f"http://127.0.0.1:{await gateway.start_http('127.0.0.1', 0)}"
    try:
        gateway.set_engines([engine_a.address, engine_b.address])
        await wait_for(lambda: all(e.healthy for e in gateway.endpoints), what="both engines healthy")
        with caplog.at_level(logging.ERROR, logger="minedraft.gateway.pool"):
            codes = [await outcome(target) for _ in range(8)]
        assert codes == [grpc.StatusCode.OK] * 8  # a stream that met engine b was retried on engine a
        b = gateway.endpoints.get(engine_b.address)
        assert b is not None and b.credential_refused
        assert registry.get_sample_value("minedraft_gateway_engine_credential_refused_total",
                                         {"engine": engine_b.address}) >= 1
        assert any("refused the gateway's credential" in r.getMessage() for r in caplog.records)
        assert engine_b.record.started == []

        # Only the refusing engine left: the caller, whose own token is fine, is told the service is unavailable.
        gateway.set_engines([engine_b.address])
        await wait_for(lambda: len(gateway.endpoints) == 1, what="engine a gone")
        assert await outcome(target) is grpc.StatusCode.UNAVAILABLE
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
            answer = await http.post("/v1/completions", headers={"authorization": "Bearer caller-token"},
                                     json={"model": "fake", "prompt": "x", "max_tokens": 2})
        assert answer.status_code == 503, answer.text
        assert "refused the gateway's credential" in answer.json()["error"]["message"]

        # The engine's token rotated to the gateway's: back in rotation, streams flow again.
        accepted_by_b.append(b"engine-token")
        await wait_for(lambda: not gateway.endpoints.get(engine_b.address).credential_refused,  # type: ignore[union-attr]
                       what="engine b back in rotation")
        assert await outcome(target) is grpc.StatusCode.OK
        assert engine_b.record.completed
    finally:
        await gateway.stop()
        await engine_a.stop(0)
        await engine_b.stop(0)


async def test_an_engines_refusal_series_goes_when_it_leaves_the_routing_table():
    """Engine addresses are pod IPs, new at every rollout: a series per address kept forever grows without bound."""
    engine_a = await FakeEngineServer("a", tokens=lambda: (b"engine-token",)).start()
    engine_b = await FakeEngineServer("b", tokens=lambda: (b"old-engine-token",)).start()
    registry = CollectorRegistry()
    gateway = Gateway(fast_config(tokens=(b"caller-token",), engine_token=lambda: "engine-token",
                                  engine_wait_timeout_seconds=0.5), registry)
    target = f"127.0.0.1:{await gateway.start()}"

    def refusals(engine: FakeEngineServer) -> float | None:
        return registry.get_sample_value("minedraft_gateway_engine_credential_refused_total",
                                         {"engine": engine.address})

    try:
        gateway.set_engines([engine_a.address, engine_b.address])
        await wait_for(lambda: all(e.healthy for e in gateway.endpoints), what="both engines healthy")
        for _ in range(8):
            await outcome(target)
        assert refusals(engine_b) is not None and refusals(engine_b) >= 1
        gateway.set_engines([engine_a.address])  # engine b's pod went away
        assert refusals(engine_b) is None
        # A refusal reported for it afterwards (a call still in flight when it left) brings no series back.
        gateway.router._credential_refused(engine_b.address)
        assert refusals(engine_b) is None
        assert await outcome(target) is grpc.StatusCode.OK
    finally:
        await gateway.stop()
        await engine_a.stop(0)
        await engine_b.stop(0)
