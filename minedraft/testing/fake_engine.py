"""A fake engine replica: an in-process aio gRPC server speaking minedraft.v1 that streams tokens at a fixed rate.

It lets the gateway be tested and measured without a model: failures can be injected before or after the first
token, every stream's fate is recorded (completed, cancelled), and each response's `text` can carry the monotonic
time it was sent (`stamp_text`) so a client on the same machine measures one-way latency per token.
`python -m minedraft.testing.fake_engine --port P` runs one as a process (the benchmark does).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from minedraft import __version__
from minedraft.api import SERVICE_NAME, pb, pb_grpc
from minedraft.api.auth import TokenAuthInterceptor
from minedraft.api.errors import abort_field_error
from minedraft.api.grpc_policy import (
    LIVENESS_SERVICE,
    SERVER_OPTIONS,
    add_generation_servicer,
    enable_reflection,
    reject_undecodable,
)

VOCAB_SIZE = 2048
MAX_MODEL_LEN = 4096
DEFAULT_MAX_TOKENS = 16
# Request metadata that sets this stream's seconds between tokens (a `minedraft-` key: the gateway forwards those).
INTERVAL_METADATA_KEY = "minedraft-fake-token-interval-seconds"
# Request metadata that makes this stream hang before its first token (a stream stuck in an engine's queue).
HANG_METADATA_KEY = "minedraft-fake-hang-before-first-token"


@dataclass
class FakeBehaviour:
    """What the fake does; tests change it between calls."""

    token_interval_seconds: float = 0.0
    # UNAVAILABLE before any token (a replica that is going away) or after this many tokens (one that died).
    fail_before_first_token: bool = False
    fail_after_tokens: int | None = None
    # Put time.perf_counter_ns() at send time into each response's text.
    stamp_text: bool = False
    # A request with this prompt crashes the handler (gRPC answers UNKNOWN): an error the request caused.
    poison_prompt: str | None = None
    # Hang (send nothing, keep the stream open) before the first token, or after this many tokens.
    hang_before_first_token: bool = False
    hang_after_tokens: int | None = None
    # Bytes of padding added to each response's text (fills flow-control windows fast: backpressure tests).
    response_padding_bytes: int = 0


@dataclass
class FakeRecord:
    started: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    # Streams that ended because the caller went away (cancel, deadline, disconnect): the engine's "abort".
    cancelled: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    # Every request as received (to check what the gateway forwards: deadlines, sampling params).
    requests: list[pb.GenerateRequest] = field(default_factory=list)
    deadlines_seconds: list[float | None] = field(default_factory=list)
    # Every request's metadata as received (to check what the gateway forwards).
    metadata: list[tuple[tuple[str, str | bytes], ...]] = field(default_factory=list)
    # Responses handed to gRPC (a write that returned): what a caller that stopped reading let the engine send.
    num_responses_sent: int = 0


def fake_token_ids(request: pb.GenerateRequest, count: int) -> list[int]:
    """Deterministic tokens from the prompt, so a test can tell which stream's tokens it got."""
    base = sum(request.prompt_token_ids) + sum(request.prompt.encode())
    return [(base + i) % VOCAB_SIZE for i in range(count)]


class FakeGenerationServicer(pb_grpc.GenerationServicer):  # type: ignore[misc]
    def __init__(self, replica_id: str, behaviour: FakeBehaviour, record: FakeRecord) -> None:
        self.replica_id = replica_id
        self.behaviour = behaviour
        self.record = record
        self.num_active_streams = 0
        self._ids = itertools.count()

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        await reject_undecodable(request, context, "minedraft.v1.GenerateRequest")
        params = request.sampling_params
        if params.HasField("max_tokens") and params.max_tokens <= 0:
            await abort_field_error(context, "sampling_params.max_tokens",
                                    f"sampling_params.max_tokens: must be positive, got {params.max_tokens}")
        request_id = request.request_id or f"fake-{self.replica_id}-{next(self._ids)}"
        self.record.requests.append(request)
        self.record.deadlines_seconds.append(context.time_remaining())
        self.record.metadata.append(tuple(context.invocation_metadata() or ()))
        behaviour = self.behaviour
        if behaviour.poison_prompt is not None and request.prompt == behaviour.poison_prompt:
            self.record.failed.append(request_id)
            raise RuntimeError(f"fake replica {self.replica_id} crashed on a poison request")
        if behaviour.fail_before_first_token:
            self.record.failed.append(request_id)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"fake replica {self.replica_id} is going away")
        self.record.started.append(request_id)
        count = params.max_tokens if params.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        interval_seconds = behaviour.token_interval_seconds
        hang_first = behaviour.hang_before_first_token
        for key, value in context.invocation_metadata() or ():
            if key == INTERVAL_METADATA_KEY:  # per-request rate (the benchmark varies it; the gateway forwards it)
                interval_seconds = float(value)
            elif key == HANG_METADATA_KEY and value in ("1", self.replica_id):  # all replicas, or only this one
                hang_first = True
        token_ids = fake_token_ids(request, count)
        self.num_active_streams += 1
        finished = False
        try:
            for index, token_id in enumerate(token_ids):
                if behaviour.fail_after_tokens is not None and index >= behaviour.fail_after_tokens:
                    self.record.failed.append(request_id)
                    finished = True
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"fake replica {self.replica_id} died")
                if (hang_first and index == 0) or index == behaviour.hang_after_tokens:
                    await asyncio.Event().wait()  # until the caller goes away
                if interval_seconds:
                    await asyncio.sleep(interval_seconds)
                last = index == len(token_ids) - 1
                text = str(time.perf_counter_ns()) if behaviour.stamp_text else f"<{token_id}>"
                if behaviour.response_padding_bytes:
                    text += " " * behaviour.response_padding_bytes
                response = pb.GenerateResponse(request_id=request_id, token_ids=[token_id], text=text)
                if last:
                    response.finish_reason = "length"
                    response.usage.prompt_tokens = len(request.prompt_token_ids) or len(request.prompt.split())
                    response.usage.completion_tokens = count
                    finished = True
                yield response
                self.record.num_responses_sent += 1
            self.record.completed.append(request_id)
        finally:
            self.num_active_streams -= 1
            if not finished:
                self.record.cancelled.append(request_id)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        return pb.GetModelInfoResponse(model="fake", draft_model="fake-draft", max_model_len=MAX_MODEL_LEN,
                                       vocab_size=VOCAB_SIZE, mode="psd", num_speculative_tokens=3, max_num_seqs=1024)

    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.GetServerInfoResponse:
        return pb.GetServerInfoResponse(version=__version__, replica_id=self.replica_id,
                                        num_running_requests=self.num_active_streams,
                                        num_active_streams=self.num_active_streams, state="serving")


class FakeEngineServer:
    """One fake replica on a loopback port, with grpc.health.v1 (SERVING unless told otherwise) and reflection."""

    def __init__(self, replica_id: str = "fake", behaviour: FakeBehaviour | None = None,
                 tokens: Callable[[], Sequence[bytes]] | None = None) -> None:
        self.replica_id = replica_id
        self.behaviour = behaviour or FakeBehaviour()
        self.record = FakeRecord()
        self.servicer = FakeGenerationServicer(replica_id, self.behaviour, self.record)
        self.health = health.aio.HealthServicer()
        # Bursts of thousands of new streams (the benchmark): past core's default of 1000 calls waiting to be
        # accepted, it cancels the rest. Keepalive: the product's one policy (the gateway's pings are welcome).
        self.server = grpc.aio.server(options=(*SERVER_OPTIONS, ("grpc.server.max_pending_requests", 100_000),
                                               ("grpc.server.max_pending_requests_hard_limit", 100_000)),
                                      # As `minedraft serve --token-file`: callers need a bearer token.
                                      interceptors=[TokenAuthInterceptor(tokens)] if tokens is not None else None)
        add_generation_servicer(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection(self.server, (SERVICE_NAME, "grpc.health.v1.Health"))
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> FakeEngineServer:
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self.set_serving(True)
        await self.server.start()
        return self

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace_seconds: float | None = None) -> None:
        await self.server.stop(grace_seconds)


async def _main(args: argparse.Namespace) -> None:
    server = FakeEngineServer(args.replica_id, FakeBehaviour(token_interval_seconds=args.token_interval_seconds,
                                                             stamp_text=args.stamp_text,
                                                             poison_prompt=args.poison_prompt))
    await server.start(args.port)
    print(f"fake engine on {server.address}", file=sys.stderr, flush=True)
    await server.server.wait_for_termination()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--replica-id", default="fake")
    parser.add_argument("--token-interval-seconds", type=float, default=0.01)
    parser.add_argument("--stamp-text", action="store_true")
    parser.add_argument("--poison-prompt", help="a request with this prompt crashes the handler (UNKNOWN)")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(parser.parse_args()))
