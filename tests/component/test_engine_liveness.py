"""An engine pod whose engine process is gone is restarted (issue 32's two-process engine pods, seen by a kubelet).

Since `serve` runs the engine core in a process of its own, the container's main process (gRPC, HTTP, health)
outlives its engine process: the kernel's OOM killer picks the largest process of a container (the engine), and an
engine loop can die on its own. A kubelet restarts a container only when its main process exits or liveness fails,
so a liveness that said only "the event loop answers" left such a pod not ready forever, never restarted.

The engine here is a stand-in with the engine process's observable behaviour once its process has died (every call
raises EngineDeadError, `dead_error` holds why): a real one would need a vLLM start to kill. The probes are the ones
the operator renders for the engine container.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import httpx
import yaml
from grpc_health.v1 import health_pb2

from minedraft.api import grpc_policy
from minedraft.engine.requests import EngineDeadError
from minedraft.operator import render
from minedraft.server.app import EngineServer
from tests.component.grpc_helpers import PATIENCE_SECONDS, health_status, wait_for_health
from tests.unit.operator.test_render import ROOT

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _Vocabless:
    def get_vocab(self) -> dict[str, int]:
        raise NotImplementedError


class EngineWhoseProcessDied:
    """What EngineProcess shows once its process is gone (exit seen as EOF on the pipe): calls fail for good."""

    in_process = False
    settings = SimpleNamespace(model="m", mode=SimpleNamespace(value="psd"), dtype="float32")
    tokenizer = _Vocabless()
    vocab_size = 32
    max_model_len = 64
    startup_seconds = 0.0
    num_in_flight = 0

    def __init__(self) -> None:
        self.dead_error: BaseException | None = None

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        if self.dead_error is not None:
            raise EngineDeadError(f"engine is not running: {self.dead_error}")
        return None

    async def shutdown(self, shutdown_engine: bool = True) -> None:
        return None


def rendered_engine_probes() -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
    deployment = next(m for m in render.render_resource(doc)
                      if m["kind"] == "Deployment" and m["metadata"]["name"].endswith("-engine"))
    return deployment["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]


async def test_liveness_fails_once_the_engine_process_is_gone() -> None:
    container = rendered_engine_probes()
    assert container["livenessProbe"]["grpc"]["service"] == grpc_policy.LIVENESS_SERVICE
    assert container["readinessProbe"]["grpc"]["service"] == render.READINESS_SERVICE
    engine = EngineWhoseProcessDied()
    server = EngineServer("replica-oom", engine_check_interval_seconds=0.05, engine_check_timeout_seconds=1)
    try:
        await server.start()
        http_port = await server.start_http("127.0.0.1", 0)
        await server.attach(engine)  # type: ignore[arg-type]
        target = f"127.0.0.1:{server.port}"
        await wait_for_health(target, SERVING)
        assert await health_status(target, grpc_policy.LIVENESS_SERVICE) == SERVING
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}") as http:
            assert (await http.get("/health")).status_code == 200
        engine.dead_error = EngineDeadError("engine process exited (exit code -9)")  # SIGKILL, as the OOM killer
        await wait_for_health(target, NOT_SERVING)
        # Liveness, which the kubelet acts on: NOT_SERVING for good, so the container is restarted once the rendered
        # liveness window (periodSeconds x failureThreshold) has passed.
        deadline = time.monotonic() + PATIENCE_SECONDS
        while await health_status(target, grpc_policy.LIVENESS_SERVICE) != NOT_SERVING:
            assert time.monotonic() < deadline, "liveness still SERVING with the engine gone"
            await asyncio.sleep(0.05)
        # The HTTP port's liveness says the same (a probe over HTTP must restart the container too).
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}") as http:
            assert (await http.get("/health")).status_code == 503
    finally:
        await server.stop()
