"""A gRPC caller that stops reading (a real grpc client on loopback, its flow-control window left full) is cut after
the stall timeout, as an HTTP one is: at the gateway (its admission slot comes back, the engine call is cancelled)
and at the engine server (its engine request aborted). Reading again, the caller gets what was buffered and then
UNAVAILABLE saying why, never a call left open without a status. And both HTTP ports run the bounded protocol."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from minedraft.api import pb, pb_grpc
from minedraft.engine.requests import OutputDelta
from minedraft.engine.settings import DrafterSettings, EngineSettings
from minedraft.server.app import EngineServer
from minedraft.testing.fake_engine import FakeBehaviour

from .gateway_stack import fast_config
from .grpc_helpers import wait_for

PADDING = 16 * 1024  # per response: fills the windows between the engine and the caller in a few hundred responses
# The caller's channel: gRPC's window growth (BDP probing) off, so its window stays at 64 KiB.
STALLED_CHANNEL_OPTIONS = (("grpc.http2.bdp_probe", 0),)


def request(prompt: str, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, sampling_params=pb.SamplingParams(max_tokens=max_tokens))


async def read_to_the_end(call: Any) -> tuple[int, grpc.StatusCode, str]:
    """(responses read, the call's status, its message) once the caller reads again."""
    count = 0
    try:
        while (await asyncio.wait_for(call.read(), 30)) is not grpc.aio.EOF:
            count += 1
    except grpc.aio.AioRpcError as exc:
        return count, exc.code(), exc.details() or ""
    return count, grpc.StatusCode.OK, ""


async def test_the_gateway_cuts_a_grpc_caller_that_stops_reading_and_its_slot_comes_back(fake_stacks):
    stack = await fake_stacks.make([FakeBehaviour(response_padding_bytes=PADDING)],
                                   fast_config(client_stall_timeout_seconds=0.5, max_in_flight=1))
    gateway, (fake,) = stack.gateway, stack.fakes
    async with grpc.aio.insecure_channel(stack.target, options=STALLED_CHANNEL_OPTIONS) as channel:
        call = pb_grpc.GenerationStub(channel).Generate(request("stalled", 4000))
        assert (await call.read()).token_ids  # streaming; from now on the caller reads nothing
        await wait_for(lambda: len(fake.record.cancelled) == 1, timeout_seconds=30, what="the engine call cancelled")
        await wait_for(lambda: gateway.admission.in_flight == 0, what="the admission slot back")
        # With --max-in-flight 1 the next caller is admitted: the stalled one no longer holds the only slot.
        async with grpc.aio.insecure_channel(stack.target) as other:
            responses = [r async for r in pb_grpc.GenerationStub(other).Generate(request("other", 3), timeout=10)]
        assert sum(len(r.token_ids) for r in responses) == 3
        count, code, message = await read_to_the_end(call)
    assert code is grpc.StatusCode.UNAVAILABLE, (code, message)
    assert "accepted nothing for 0.5 s" in message
    assert count < 4000


class StubEngine:
    """The ServingEngine surface the engine server uses, without a model: large responses as fast as they are taken,
    and a record of the requests that were closed (aborted) before their end."""

    in_process = True

    def __init__(self) -> None:
        self.settings = EngineSettings(model="stub", drafter=DrafterSettings(model="stub-draft"))
        self.tokenizer = None
        self.vocab_size = 1000
        self.max_model_len = 8192
        self.startup_seconds = 0.0
        self.num_in_flight = 0
        self.dead_error = None
        self.aborted: list[str] = []

    async def generate(self, prompt: Any, sampling: Any, request_id: str | None = None) -> AsyncIterator[OutputDelta]:
        try:
            for i in range(sampling.max_tokens):
                await asyncio.sleep(0)
                last = i == sampling.max_tokens - 1
                yield OutputDelta(request_id or "", [i % 1000], "x" * PADDING, "length" if last else None, 1, i + 1)
        except GeneratorExit:
            self.aborted.append(request_id or "")
            raise

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def call(self, fn: Any) -> Any:
        return (0, 0) if fn.__name__ == "load" else fn(self)

    async def shutdown(self, shutdown_engine: bool = True) -> None:
        pass


async def test_the_engine_server_cuts_a_grpc_caller_that_stops_reading():
    server = EngineServer(client_stall_timeout_s=0.5)
    port = await server.start()
    engine = StubEngine()
    await server.attach(engine)  # type: ignore[arg-type]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=STALLED_CHANNEL_OPTIONS) as channel:
            call = pb_grpc.GenerationStub(channel).Generate(
                pb.GenerateRequest(prompt_token_ids=[1, 2], sampling_params=pb.SamplingParams(max_tokens=4000)))
            assert (await call.read()).token_ids
            await wait_for(lambda: len(engine.aborted) == 1, timeout_seconds=30, what="the engine request aborted")
            await wait_for(lambda: server.service.num_active_streams == 0, what="the stream closed")
            count, code, message = await read_to_the_end(call)
        assert code is grpc.StatusCode.UNAVAILABLE, (code, message)
        assert "accepted nothing for 0.5 s" in message
        assert count < 4000
    finally:
        await server.stop()


async def oversized_head_status(port: int) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"x" * (1 << 20) + b"\r\n\r\n")
        await writer.drain()
    except ConnectionError:
        pass  # the server stops reading once it has answered
    line = await asyncio.wait_for(reader.readline(), 30)
    writer.close()
    return int(line.split()[1])


async def test_both_http_ports_refuse_an_oversized_head(fake_stacks):
    """The gateway's and the engine server's HTTP ports both run the bounded protocol (the bounds themselves are
    tested in tests/unit/test_http_limits.py)."""
    stack = await fake_stacks.make([FakeBehaviour()], fast_config(), http=True)
    assert stack.http_url is not None
    assert await oversized_head_status(int(stack.http_url.rsplit(":", 1)[1])) == 431
    server = EngineServer()
    await server.start()
    try:
        assert await oversized_head_status(await server.start_http("127.0.0.1", 0)) == 431
    finally:
        await server.stop()
