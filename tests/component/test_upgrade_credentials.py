"""An upgrade from 0.1.0 keeps serving while old and new pods mix.

0.1.0's gateway presented the clients' token to its engines, which accepted only it; this release's gateway presents
the MineDraft's internal credential, which its engines require. The operator rolls gateways and engines apart, so for
one release each side takes the other's: engines accept both files' tokens (`serve --token-file` twice), and the
gateway offers the clients' token to an engine that refuses the internal one (`--engine-token-file` twice). Shown
with the real parsers, the real engine server's check, the real gateway and fake engine replicas behind the same
interceptor, over loopback.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from minedraft.api import pb, pb_grpc
from minedraft.api.auth import token_files
from minedraft.gateway.app import Gateway
from minedraft.gateway.cli import config_from_args
from minedraft.operator import render
from minedraft.server.app import EngineServer
from minedraft.testing.fake_engine import FakeEngineServer

from .gateway_stack import FAST
from .grpc_helpers import wait_for

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
REQUEST = pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(max_tokens=2))
CALLER = (("authorization", "Bearer client-token-0123456789"),)


def rendered_commands() -> tuple[list[str], list[str]]:
    """The engine's and the gateway's command for a MineDraft with gateway auth on (examples/auth-tls.yaml)."""
    doc = yaml.safe_load((ROOT / "examples" / "auth-tls.yaml").read_text())
    doc["metadata"].update(namespace="serving", uid="u")
    pods = {m["metadata"]["name"]: m["spec"]["template"]["spec"]
            for m in render.render_resource(doc) if m["kind"] == "Deployment"}
    engine = next(p for n, p in pods.items() if n.endswith("-engine"))["containers"][0]["command"]
    gateway = next(p for n, p in pods.items() if n.endswith("-gateway"))["containers"][0]["command"]
    return engine, gateway


def files(tmp_path: Path) -> dict[str, Path]:
    """The two Secrets' files as the pods see them, under tmp_path."""
    internal, client = tmp_path / "internal", tmp_path / "client"
    internal.write_text("internal-credential-0123456789\n")
    client.write_text(CALLER[0][1].removeprefix("Bearer ") + "\n")
    return {render.INTERNAL_TOKEN_PATH: internal, f"{render.AUTH_DIR}/token": client}


def local(command: list[str], flag: str, paths: dict[str, Path]) -> list[str]:
    """The command with its Secret file paths mapped to the test's files."""
    return [str(paths.get(word, word)) if i and command[i - 1] == flag else word for i, word in enumerate(command)]


def gateway_from(command: list[str]) -> Gateway:
    from minedraft.cli import build_parser

    args = build_parser().parse_args(command[1:])
    # The clients' side of the gateway (its own --token-file, TLS) is not what this test is about.
    config = config_from_args(argparse.Namespace(**{**vars(args), "token_file": None, "tls_cert": None,
                                                    "tls_key": None}))
    return Gateway(dataclasses.replace(config, **FAST, engine_wait_timeout_seconds=10.0))


async def stream(target: str) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(target) as channel:
        try:
            async for _ in pb_grpc.GenerationStub(channel).Generate(REQUEST, timeout=30):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def code_of(call: Any) -> grpc.StatusCode | None:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return None


def test_rendered_engines_accept_both_and_the_gateway_offers_both_in_order() -> None:
    from minedraft.cli import build_parser

    engine, gateway = rendered_commands()
    both = [render.INTERNAL_TOKEN_PATH, f"{render.AUTH_DIR}/token"]
    assert build_parser().parse_args(engine[1:]).token_file == both
    assert build_parser().parse_args(gateway[1:]).engine_token_file == both  # the internal credential first


async def test_a_new_engine_accepts_an_old_gateways_credential_and_a_new_ones(tmp_path: Path) -> None:
    from minedraft.cli import build_parser

    paths = files(tmp_path)
    engine, _ = rendered_commands()
    accepted = build_parser().parse_args(local(engine, "--token-file", paths)[1:]).token_file
    server = EngineServer("engine-0", tokens=token_files(accepted))  # what `minedraft serve` builds from them
    port = await server.start("127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            for token in (paths[render.INTERNAL_TOKEN_PATH], paths[f"{render.AUTH_DIR}/token"]):
                metadata = (("authorization", f"Bearer {token.read_text().strip()}"),)
                # Past the check (no model loaded here: "loading").
                assert await code_of(stub.Generate(REQUEST, metadata=metadata)) is grpc.StatusCode.UNAVAILABLE
            assert await code_of(stub.Generate(REQUEST, metadata=(("authorization", "Bearer other"),))) is \
                grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop()


async def test_mixed_fleets_serve_in_both_directions(tmp_path: Path) -> None:
    paths = files(tmp_path)
    internal = paths[render.INTERNAL_TOKEN_PATH].read_text().strip().encode()
    client = paths[f"{render.AUTH_DIR}/token"].read_text().strip().encode()
    engine_command, gateway_command = rendered_commands()
    # 0.1.0's engines accept only the clients' token; this release's take what its rendered command names.
    from minedraft.cli import build_parser

    new_tokens = token_files(build_parser().parse_args(local(engine_command, "--token-file", paths)[1:]).token_file)
    old_engine = await FakeEngineServer("old", tokens=lambda: (client,)).start()
    new_engine = await FakeEngineServer("new", tokens=new_tokens).start()
    assert internal in new_tokens() and client in new_tokens()
    new_gateway = gateway_from(local(gateway_command, "--engine-token-file", paths))
    # 0.1.0's gateway presented the clients' token to engines.
    old_gateway = Gateway(dataclasses.replace(new_gateway.config, engine_token=lambda: client.decode(),
                                              engine_fallback_tokens=()))
    try:
        # A new gateway in front of old engines only (the gateways rolled first): the engine refuses the internal
        # credential once, is offered the clients' token, and serves.
        target = f"127.0.0.1:{await new_gateway.start('127.0.0.1:0')}"
        new_gateway.set_engines([old_engine.address])
        await wait_for(lambda: all(e.healthy for e in new_gateway.endpoints), what="old engine healthy")
        assert [await stream(target) for _ in range(4)] == [grpc.StatusCode.OK] * 4
        assert len(old_engine.record.completed) == 4
        # Then the new engines come up beside the old: both serve.
        new_gateway.set_engines([old_engine.address, new_engine.address])
        await wait_for(lambda: all(e.healthy for e in new_gateway.endpoints), what="both engines healthy")
        assert [await stream(target) for _ in range(8)] == [grpc.StatusCode.OK] * 8
        assert new_engine.record.completed
        # An old gateway in front of new engines (the engines rolled first): they take its credential.
        old_target = f"127.0.0.1:{await old_gateway.start('127.0.0.1:0')}"
        old_gateway.set_engines([new_engine.address])
        await wait_for(lambda: all(e.healthy for e in old_gateway.endpoints), what="new engine healthy")
        assert [await stream(old_target) for _ in range(4)] == [grpc.StatusCode.OK] * 4
    finally:
        await new_gateway.stop()
        await old_gateway.stop()
        await old_engine.stop(0)
        await new_engine.stop(0)
