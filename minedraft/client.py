"""`minedraft client generate`: stream a completion from an engine server or the gateway to the terminal.

Speaks only the generated API. Text goes to stdout as it arrives; a summary line goes to stderr. With --json, stdout
holds one JSON object per streamed response instead (the last carries finish_reason, usage and speculation).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

TOKEN_ENV = "MINEDRAFT_TOKEN"


def add_subcommands(sub: Any) -> None:
    client = sub.add_parser("client", help="talk to an engine server or the gateway").add_subparsers(
        dest="client_command", required=True)
    gen = client.add_parser("generate", help="stream one completion")
    gen.add_argument("--target", default="127.0.0.1:50050", help="host:port of the gateway or an engine server")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-token-ids", help="prompt as comma-separated token ids")
    gen.add_argument("--max-tokens", type=int, help="default: the rest of the context")
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--request-id", default="")
    gen.add_argument("--timeout-seconds", type=float, help="deadline for the whole stream")
    gen.add_argument("--json", action="store_true", help="one JSON object per streamed response on stdout")
    gen.add_argument("--token-file", help=f"bearer token file (default: ${TOKEN_ENV} when set)")
    gen.add_argument("--tls-ca", help="CA certificate (PEM) to verify the target's TLS certificate: enables TLS")
    gen.add_argument("--tls-server-name", help="name to verify in the certificate (default: the target's host)")
    gen.set_defaults(func=cmd_generate)

    health = client.add_parser("health", help="grpc.health.v1 status of a server (exit 0 when SERVING)")
    health.add_argument("--target", default="127.0.0.1:50050")
    health.add_argument("--service", default="", help="service to ask about (default: the whole server)")
    health.add_argument("--wait-seconds", type=float, default=0.0, help="keep asking until SERVING or this long")
    health.add_argument("--tls-ca")
    health.add_argument("--tls-server-name")
    health.set_defaults(func=cmd_health)


def build_request(args: argparse.Namespace) -> Any:
    from minedraft.api import pb

    params = pb.SamplingParams(stop=args.stop, ignore_eos=args.ignore_eos)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(params, name, value)
    request = pb.GenerateRequest(request_id=args.request_id, sampling_params=params)
    if args.prompt is not None:
        request.prompt = args.prompt
    else:
        request.prompt_token_ids.extend(parse_token_ids(args.prompt_token_ids))
    return request


class UsageError(ValueError):
    """Bad command-line input: printed as one line naming the flag, exit status 2."""


def parse_token_ids(text: str) -> list[int]:
    token_ids = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            token_id = int(part)
        except ValueError:
            raise UsageError(
                f"prompt-token-ids: {part.strip()!r} is not a token id (comma-separated integers)") from None
        if token_id < 0:
            raise UsageError(f"prompt-token-ids: {token_id} is negative")
        token_ids.append(token_id)
    if not token_ids:
        raise UsageError("prompt-token-ids: no token ids given")
    return token_ids


def _read(flag: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None


def open_channel(target: str, tls_ca: str | None, server_name: str | None = None) -> Any:
    import grpc

    from minedraft.api.grpc_policy import CHANNEL_OPTIONS

    if tls_ca is None:
        return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
    ca = _read("tls-ca", tls_ca)
    if b"-----BEGIN CERTIFICATE-----" not in ca:
        raise UsageError(f"tls-ca: {tls_ca} holds no PEM certificate")
    credentials = grpc.ssl_channel_credentials(root_certificates=ca)
    options = (("grpc.ssl_target_name_override", server_name),) if server_name else ()
    return grpc.aio.secure_channel(target, credentials, options=CHANNEL_OPTIONS + options)


def bearer_metadata(token_file: str | None) -> tuple[tuple[str, str], ...]:
    if token_file:
        lines = [line.strip() for line in _read("token-file", token_file).decode(errors="replace").splitlines()]
        token: str | None = next((line for line in lines if line), None)
        if token is None:
            raise UsageError(f"token-file: {token_file} holds no token")
    else:
        token = os.environ.get(TOKEN_ENV)
    return (("authorization", f"Bearer {token}"),) if token else ()


async def stream_generate(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from minedraft.api import pb_grpc

    request = build_request(args)
    metadata = bearer_metadata(args.token_file)
    started = time.perf_counter()
    first_token_seconds: float | None = None
    final = None
    async with open_channel(args.target, args.tls_ca, args.tls_server_name) as channel:
        stub = pb_grpc.GenerationStub(channel)
        call = stub.Generate(request, timeout=args.timeout_seconds, metadata=metadata)
        try:
            async for response in call:
                if first_token_seconds is None and response.token_ids:
                    first_token_seconds = time.perf_counter() - started
                if args.json:
                    print(json.dumps(MessageToDict(response, preserving_proto_field_name=True,
                                                   always_print_fields_with_no_presence=True)), flush=True)
                else:
                    print(response.text, end="", flush=True)
                final = response
        except grpc.aio.AioRpcError as exc:
            if final is not None and not args.json:
                print()  # end the partial line of text
            print(f"minedraft client: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    elapsed = time.perf_counter() - started
    if not args.json:
        print()
    if final is not None:
        drafted, accepted = final.speculation.num_draft_tokens, final.speculation.num_accepted_tokens
        rate = f" ({accepted / drafted:.0%})" if drafted else ""
        ttft = f", first token {first_token_seconds * 1000:.0f} ms" if first_token_seconds is not None else ""
        print(f"[{final.usage.completion_tokens} tokens in {elapsed:.2f}s{ttft}, finish: {final.finish_reason}, "
              f"drafted {drafted}, accepted {accepted}{rate}]", file=sys.stderr)
    return 0


def _usage_errors(run: Any, args: argparse.Namespace) -> int:
    try:
        return int(asyncio.run(run(args)))
    except UsageError as exc:
        print(f"minedraft client: error: {exc}", file=sys.stderr)
        return 2


def cmd_generate(args: argparse.Namespace) -> int:
    return _usage_errors(stream_generate, args)


async def check_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + args.wait_seconds
    status = "UNREACHABLE"
    async with open_channel(args.target, args.tls_ca, args.tls_server_name) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                response = await stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=2)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
            except grpc.aio.AioRpcError as exc:
                status = exc.code().name
            if status == "SERVING" or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.5)
    print(status)
    return 0 if status == "SERVING" else 1


def cmd_health(args: argparse.Namespace) -> int:
    return _usage_errors(check_health, args)
