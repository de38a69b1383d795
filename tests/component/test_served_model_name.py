"""Served model names (issue 30, defect 7): clients and routers address a model by a short name.

spec.servedModelNames reaches `minedraft serve --served-model-name` and `minedraft gateway --served-model-name`:
GetModelInfo answers the first name, /v1/models lists the names, and an HTTP request may name any of them (aliases),
at the engine and at the gateway; vLLM's own --served-model-name in extraArgs (accepted and ignored before) is
refused. The engine side runs the real servers with a stand-in for the loaded engine (only its settings and limits
are read on these paths); the gateway side runs the real gateway over a fake engine replica.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import grpc
import pytest
import yaml

from minedraft.api import pb, pb_grpc
from minedraft.engine.settings import DrafterSettings, EngineSettings
from minedraft.gateway.app import Gateway, GatewayConfig
from minedraft.operator import render
from minedraft.operator import spec as s
from minedraft.operator.admission import admit
from minedraft.server.app import EngineServer
from minedraft.server.convert import ModelLimits
from minedraft.server.servicer import ServerState
from minedraft.testing.fake_engine import FakeEngineServer

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]
NAMES = ("qwen3-8b", "qwen")


def resource(**spec: Any) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
    doc["metadata"].update(namespace="serving", uid="u")
    doc["spec"].update(spec)
    return doc


def test_the_names_reach_both_commands() -> None:
    from minedraft.cli import build_parser

    doc = resource(servedModelNames=list(NAMES))
    assert admit(doc) == []
    commands = {m["metadata"]["name"]: m["spec"]["template"]["spec"]["containers"][0]["command"]
                for m in render.render_resource(doc) if m["kind"] == "Deployment"}
    for command in commands.values():
        assert tuple(build_parser().parse_args(command[1:]).served_model_name) == NAMES
    # Without the field: no flag (the engines answer with the model's id, as before).
    for m in render.render_resource(resource()):
        if m["kind"] == "Deployment":
            assert "--served-model-name" not in m["spec"]["template"]["spec"]["containers"][0]["command"]


def test_vllms_own_flag_and_bad_names_are_refused() -> None:
    doc = resource(engine={"extraArgs": ["--served-model-name", "x"]})
    assert any(e.startswith("spec.engine.extraArgs:") for e in admit(doc))
    with pytest.raises(s.SpecError, match="--served-model-name is set by the operator"):
        s.parse_spec(doc["spec"])
    for bad in (["two words"], ["a", "a"], ["--flag"]):
        assert admit(resource(servedModelNames=bad)), bad
        with pytest.raises(s.SpecError, match=r"spec\.servedModelNames"):
            s.parse_spec(resource(servedModelNames=bad)["spec"])


async def test_engine_answers_to_its_served_names() -> None:
    server = EngineServer("engine-0", served_model_names=NAMES)
    port = await server.start("127.0.0.1:0")
    http_port = await server.start_http("127.0.0.1", 0)
    # The loaded engine, as far as these paths read it.
    settings = EngineSettings(model="/models/Qwen3-8B", drafter=DrafterSettings(model="/models/Qwen3-0.6B"))
    server.service.engine = SimpleNamespace(settings=settings)  # type: ignore[assignment]
    server.service.limits = ModelLimits(vocab_size=151936, max_model_len=4096)
    server.service.state = ServerState.SERVING
    server.serving = True
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = await pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest())
        # The draft by its last path components (where it lies on the machine is not the callers' business).
        assert info.model == "qwen3-8b" and info.draft_model == "models/Qwen3-0.6B"
        assert tuple(info.served_model_names) == NAMES
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{http_port}/v1/models") as response:
                assert [m["id"] for m in (await response.json())["data"]] == list(NAMES)
            body = {"model": "/models/Qwen3-8B", "prompt": "x", "max_tokens": 1}
            async with session.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body) as response:
                assert response.status == 404 and (await response.json())["error"]["param"] == "model"
    finally:
        server.service.engine = None
        await server.stop()


async def test_gateway_lists_and_matches_the_served_names() -> None:
    engine = await FakeEngineServer("engine-0").start()
    gateway = Gateway(GatewayConfig(served_model_names=NAMES))
    await gateway.start("127.0.0.1:0")
    http_port = await gateway.start_http("127.0.0.1", 0)
    gateway.set_engines([engine.address])
    try:
        async with aiohttp.ClientSession() as session:
            base = f"http://127.0.0.1:{http_port}"
            async with session.get(f"{base}/v1/models") as response:
                assert [m["id"] for m in (await response.json())["data"]] == list(NAMES)
            for name, status in (("qwen", 200), ("qwen3-8b", 200), ("Qwen/Qwen3-8B", 404)):
                body = {"model": name, "prompt": "def main():", "max_tokens": 2}
                for _ in range(100):  # the engine's health is watched: the first request may find none yet
                    async with session.post(f"{base}/v1/completions", json=body) as response:
                        if response.status != 503:
                            break
                assert response.status == status, (name, await response.text())
    finally:
        await gateway.stop()
        await engine.stop(0)


async def test_gateway_without_names_accepts_the_engines_aliases() -> None:
    """A gateway started without --served-model-name learns the names from the engines (GetModelInfo): requests may
    use the aliases too, and /v1/models lists the first (404 for an alias before the engines told it)."""
    server = EngineServer("engine-0", served_model_names=NAMES)
    port = await server.start("127.0.0.1:0")
    settings = EngineSettings(model="/models/Qwen3-8B", drafter=DrafterSettings(model="/models/Qwen3-0.6B"))
    server.service.engine = SimpleNamespace(settings=settings)  # type: ignore[assignment]
    server.service.limits = ModelLimits(vocab_size=151936, max_model_len=4096)
    server.service.state = ServerState.SERVING
    await server._set_health(1)  # SERVING: routable
    gateway = Gateway(GatewayConfig())
    await gateway.start("127.0.0.1:0")
    http_port = await gateway.start_http("127.0.0.1", 0)
    gateway.set_engines([f"127.0.0.1:{port}"])
    try:
        async with aiohttp.ClientSession() as session:
            base = f"http://127.0.0.1:{http_port}"
            for _ in range(200):  # the engine's health is watched: the first request may find none ready yet
                async with session.get(f"{base}/v1/models") as response:
                    if response.status == 200:
                        assert [m["id"] for m in (await response.json())["data"]] == ["qwen3-8b"]
                        break
            else:
                raise AssertionError("the gateway never listed the engine's model")
            for name, accepted in (("qwen", True), ("qwen3-8b", True), ("Qwen/Qwen3-8B", False)):
                body = {"model": name, "prompt": [1, 2], "max_tokens": 1}
                async with session.post(f"{base}/v1/completions", json=body) as response:
                    error = (await response.json()).get("error") or {}
                    # Past the model check the stand-in engine cannot generate; only the name decides the 404.
                    assert (error.get("param") != "model") is accepted, (name, response.status, error)
    finally:
        server.service.engine = None
        await gateway.stop()
        await server.stop()
