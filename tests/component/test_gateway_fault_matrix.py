"""Fault matrix: the real `minedraft gateway` process in front of two engine replica processes on loopback, each
fault driven while a bystander stream runs on the other replica. For every case: what the client received (tokens,
status, message) and that nothing else was disturbed.

The replicas are fake engine processes (`python -m minedraft.testing.fake_engine`): they start in a second, so a
replica can be killed, frozen (SIGSTOP) and restarted within the test, and a poison request can be injected. The
giant prompt needs the real server's tokenizer: tests/component/test_server.py covers it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2

from minedraft.api import pb, pb_grpc
from minedraft.api.grpc_policy import LIVENESS_SERVICE
from minedraft.testing.fake_engine import HANG_METADATA_KEY, INTERVAL_METADATA_KEY, fake_token_ids

from .grpc_helpers import health_status, wait_for_health

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
ENV = {**os.environ, "GRPC_VERBOSITY": "ERROR"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def start_fake(port: int, replica_id: str) -> asyncio.subprocess.Process:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "minedraft.testing.fake_engine", "--port", str(port), "--replica-id", replica_id,
        "--token-interval-seconds", "0.02", "--poison-prompt", "poison",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, env=ENV)
    await wait_for_health(f"127.0.0.1:{port}", SERVING, timeout_seconds=60)
    return process


async def stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        with _suppress_lookup():
            process.send_signal(signal.SIGCONT)
            process.kill()
        await process.wait()


class _suppress_lookup:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is ProcessLookupError


@dataclass
class Cluster:
    gateway: asyncio.subprocess.Process
    target: str
    metrics_port: int
    ports: list[int]
    fakes: list[asyncio.subprocess.Process]

    async def restart(self, index: int) -> None:
        await stop(self.fakes[index])
        self.fakes[index] = await start_fake(self.ports[index], f"fake-{index}")


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    ports = [free_port(), free_port()]
    fakes = list(await asyncio.gather(*(start_fake(p, f"fake-{i}") for i, p in enumerate(ports))))
    port, metrics_port = free_port(), free_port()
    gateway = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "minedraft.cli", "gateway", "--port", str(port), "--metrics-port", str(metrics_port),
        "--engines", ",".join(f"127.0.0.1:{p}" for p in ports), "--first-response-timeout-s", "1",
        "--idle-timeout-s", "1", "--grace-seconds", "10", "--engine-wait-timeout-s", "5",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, env=ENV)
    target = f"127.0.0.1:{port}"
    try:
        await wait_for_health(target, SERVING, timeout_seconds=60)
        yield Cluster(gateway, target, metrics_port, ports, fakes)
    finally:
        await stop(gateway)
        for fake in fakes:
            await stop(fake)


def request(prompt: str, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, sampling_params=pb.SamplingParams(max_tokens=max_tokens))


@dataclass
class Outcome:
    tokens: list[int]
    code: grpc.StatusCode
    message: str


class Stream:
    """One client stream through the gateway, read in the background."""

    def __init__(self, target: str, req: pb.GenerateRequest, metadata: tuple[tuple[str, str], ...] = (),
                 read_delay_seconds: float = 0.0) -> None:
        self.request = req
        self.tokens: list[int] = []
        self.first = asyncio.Event()
        self.task = asyncio.create_task(self._run(target, metadata, read_delay_seconds))

    async def _run(self, target: str, metadata: tuple[tuple[str, str], ...], delay: float) -> Outcome:
        async with grpc.aio.insecure_channel(target) as channel:
            call = pb_grpc.GenerationStub(channel).Generate(self.request, timeout=60, metadata=metadata)
            try:
                while (response := await call.read()) is not grpc.aio.EOF:
                    self.tokens.extend(response.token_ids)
                    self.first.set()
                    if delay:
                        await asyncio.sleep(delay)
            except grpc.aio.AioRpcError as exc:
                return Outcome(self.tokens, exc.code(), exc.details() or "")
        return Outcome(self.tokens, grpc.StatusCode.OK, "")

    def expected(self) -> list[int]:
        return fake_token_ids(self.request, self.request.sampling_params.max_tokens)

    async def ok(self) -> None:
        """It completed with every token: it was not disturbed."""
        outcome = await asyncio.wait_for(self.task, 60)
        assert (outcome.code, outcome.tokens) == (grpc.StatusCode.OK, self.expected()), outcome


async def on_replica(cluster: Cluster, index: int, req: pb.GenerateRequest) -> Stream:
    """A stream that went to replica `index` (its pid decides nothing: the gateway picks the less loaded one, so a
    long stream is opened first on each replica to steer it). Returned once it delivered a token."""
    stream = Stream(cluster.target, req)
    await asyncio.wait_for(stream.first.wait(), 30)
    return stream


async def test_fault_matrix(cluster: Cluster) -> None:
    target = cluster.target
    interval = ((INTERVAL_METADATA_KEY, "0.05"),)

    # -- replica killed after the first token: UNAVAILABLE with the count; the bystander on the other finishes. --
    long_a = Stream(target, request("long-a", 400), interval)
    await asyncio.wait_for(long_a.first.wait(), 30)
    victim = await replica_serving(cluster, "long-a")
    bystander = Stream(target, request("bystander-1", 60))  # the other replica: it has fewer streams open
    await asyncio.wait_for(bystander.first.wait(), 30)
    cluster.fakes[victim].kill()
    outcome = await asyncio.wait_for(long_a.task, 30)
    assert outcome.code is grpc.StatusCode.UNAVAILABLE and outcome.tokens
    assert outcome.message == (f"the engine failed after {len(outcome.tokens)} tokens delivered; not retried "
                               "because tokens were already streamed")
    await bystander.ok()

    # -- restarted: the replica comes back on its port and is routed to again. --
    await cluster.fakes[victim].wait()
    await cluster.restart(victim)
    await wait_for_health(target, SERVING)
    streams = [Stream(target, request(f"after-restart-{i}", 30), interval) for i in range(4)]
    for stream in streams:
        await stream.ok()
    assert await busy_replicas_seen(cluster, 2), "both replicas serve again"

    # -- killed before its first token: the stream is retried on the other replica and completes. --
    # Steer: a long stream on one replica, so the hung one goes to the other (the less loaded); only that one hangs.
    steer = Stream(target, request("steer", 400), interval)
    await asyncio.wait_for(steer.first.wait(), 30)
    victim = 1 - await replica_serving(cluster, "steer")
    hung = Stream(target, request("hung", 10), ((HANG_METADATA_KEY, f"fake-{victim}"),))
    for _ in range(500):  # until it reached the victim (which sends nothing)
        if (await open_streams(cluster))[victim] == 1:
            break
        await asyncio.sleep(0.01)
    cluster.fakes[victim].kill()
    # The retry lands on the other replica, whose streams do not hang.
    await hung.ok()
    steer.task.cancel()
    await cluster.fakes[victim].wait()
    await cluster.restart(victim)
    await wait_for_health(target, SERVING)

    # -- frozen (SIGSTOP, TCP open): the first-response timeout moves the stream; the replica leaves rotation
    # until it answers health again (SIGCONT). --
    frozen = 0
    cluster.fakes[frozen].send_signal(signal.SIGSTOP)
    try:
        streams = [Stream(target, request(f"while-frozen-{i}", 10)) for i in range(4)]
        for stream in streams:
            await stream.ok()
        # Out of rotation now (its health watch alone never noticed: a frozen process's stream just stays silent).
        frozen_address = f"127.0.0.1:{cluster.ports[frozen]}"
        assert await gateway_metric(cluster, f'minedraft_gateway_engine_ready{{engine="{frozen_address}"}}') == 0
        assert await gateway_metric(cluster, "minedraft_gateway_endpoints_ready") == 1
    finally:
        cluster.fakes[frozen].send_signal(signal.SIGCONT)
    assert await busy_replicas_seen(cluster, 2, timeout_seconds=15), "the thawed replica is routed to again"

    # -- poison request: its own error, tried once; concurrent streams all complete; health stays SERVING. --
    others = [Stream(target, request(f"poison-bystander-{i}", 20)) for i in range(6)]
    poisoned = await Stream(target, request("poison", 5)).task
    assert (poisoned.code, poisoned.tokens) == (grpc.StatusCode.UNKNOWN, [])
    assert poisoned.message == "the engine could not process this request (UNKNOWN)"
    for stream in others:
        await stream.ok()
    assert await health_status(target) == SERVING
    await Stream(target, request("after-poison", 5)).ok()

    # -- slow client: reads slower than the idle timeout; it gets every token, the replica is not benched. --
    slow = Stream(target, request("slow-reader", 3), read_delay_seconds=1.3)
    await slow.ok()

    # -- gateway SIGTERM mid-stream: readiness NOT_SERVING, liveness SERVING, new streams refused, the open one
    # finishes, exit 0. --
    open_stream = Stream(target, request("through-shutdown", 60), interval)
    await asyncio.wait_for(open_stream.first.wait(), 30)
    cluster.gateway.send_signal(signal.SIGTERM)
    await wait_for_health(target, NOT_SERVING)
    assert await health_status(target, LIVENESS_SERVICE) == SERVING
    refused = await Stream(target, request("too-late", 5)).task
    assert refused.code is grpc.StatusCode.UNAVAILABLE and refused.message == "gateway is shutting down"
    await open_stream.ok()
    assert await asyncio.wait_for(cluster.gateway.wait(), 30) == 0


async def replica_serving(cluster: Cluster, prompt: str) -> int:
    """The index of the replica with streams open now (the fake reports them in GetServerInfo)."""
    for _ in range(300):
        busy = [i for i, n in enumerate(await open_streams(cluster)) if n > 0]
        if len(busy) == 1:
            return busy[0]
        await asyncio.sleep(0.02)
    raise AssertionError(f"could not tell which replica serves {prompt!r}")


async def open_streams(cluster: Cluster) -> list[int]:
    counts = []
    for port in cluster.ports:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                info = await pb_grpc.GenerationStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=1)
                counts.append(info.num_active_streams)
            except grpc.aio.AioRpcError:
                counts.append(-1)
    return counts


async def busy_replicas_seen(cluster: Cluster, wanted: int, timeout_seconds: float = 10) -> bool:
    """Open pairs of slow streams until `wanted` replicas have one each at once."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_seconds
    while loop.time() < deadline:
        pair = [Stream(cluster.target, request(f"probe-{i}", 15), ((INTERVAL_METADATA_KEY, "0.05"),))
                for i in range(2)]
        for stream in pair:
            await asyncio.wait_for(stream.first.wait(), 30)
        counts = await open_streams(cluster)
        for stream in pair:
            await stream.ok()
        if sum(1 for n in counts if n > 0) >= wanted:
            return True
    return False


async def gateway_metric(cluster: Cluster, series: str) -> float:
    import urllib.request

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=10) as response:
            return str(response.read().decode())

    for line in (await asyncio.to_thread(scrape)).splitlines():
        name, _, value = line.rpartition(" ")
        if name == series:
            return float(value)
    raise AssertionError(f"{series} not exported")
