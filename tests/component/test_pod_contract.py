"""Pod contract: the gateway pod the operator renders, run as the kubelet would run it, probes and all.

The rendered container command runs as a local process (ports, host and in-cluster API mapped to loopback, the
writable volume mounts to temporary folders, the rendered env with those paths); a prober runs the rendered
readiness and liveness probes (gRPC health checks with the rendered service names, thresholds and timeouts; periods
scaled down by PERIOD_SCALE) and counts the restarts a kubelet would make. Engines come and go through EndpointSlices
in the Kubernetes API emulator, served by a fake engine replica.

Shown here: no restart while no engine is ready (engines loading for minutes), ready only once an engine is,
readiness dropping on drain before the process exits. The engine pod's command is checked against the real parser and
settings validation in tests/unit/operator/test_render.py; running it here needs a vLLM engine start (not done: the
drafter-GPU flags the pod carries have no CPU meaning).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kmock import ResourceInfo, Server

from minedraft.operator import render
from minedraft.testing.fake_engine import FakeEngineServer
from tests.component.kube_emulator import KubeEmulator

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
NS = "serving"
PERIOD_SCALE = 0.1  # probe periods run 10x faster than rendered (thresholds and meanings unchanged)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def wait_for(what: str, predicate: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        await asyncio.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


@dataclass
class Prober:
    """One rendered probe, run like the kubelet: every periodSeconds a check with timeoutSeconds; failureThreshold
    consecutive failures (liveness: a restart; readiness: not ready), successThreshold successes (ready)."""

    kind: str
    port: int
    probe: dict[str, Any]
    ready: bool = False
    restarts: int = 0
    checks: int = 0
    history: list[tuple[float, bool]] = field(default_factory=list)

    async def check_once(self) -> bool:
        assert "grpc" in self.probe, self.probe  # no TLS here: gRPC probes
        service = self.probe["grpc"].get("service", "")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as channel:
                response = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=self.probe.get("timeoutSeconds", 1))
            return bool(response.status == health_pb2.HealthCheckResponse.SERVING)
        except grpc.aio.AioRpcError:
            return False

    async def run(self) -> None:
        failures = successes = 0
        period = self.probe.get("periodSeconds", 10) * PERIOD_SCALE
        while True:
            ok = await self.check_once()
            self.checks += 1
            self.history.append((time.monotonic(), ok))
            failures, successes = (0, successes + 1) if ok else (failures + 1, 0)
            if self.kind == "liveness" and failures >= self.probe.get("failureThreshold", 3):
                self.restarts += 1
                failures = 0
            if self.kind == "readiness":
                if ok and successes >= self.probe.get("successThreshold", 1):
                    self.ready = True
                if not ok and failures >= self.probe.get("failureThreshold", 3):
                    self.ready = False
            await asyncio.sleep(period)


# What a Secret-backed volume's files hold here (the kubelet writes the Secret's keys; the operator makes the
# internal credential's Secret, which a rendered Deployment only names).
SECRET_FILE_CONTENT = "pod-contract-test-token\n"


def local_process(container: dict[str, Any], tmp_path: Path, ports: dict[str, int],
                  extra: list[str], volumes: list[dict[str, Any]] | None = None) -> tuple[list[str], dict[str, str]]:
    """The container's command and env for a local process: flags in `ports` get local ports, the host becomes
    loopback, mount paths (in arguments and env) become temporary folders, and the pod's Secret volumes (`volumes`)
    get their files, as the kubelet writes them."""
    mounts = {m["mountPath"]: tmp_path / m["name"] for m in container.get("volumeMounts", [])}
    for folder in mounts.values():
        folder.mkdir(parents=True, exist_ok=True)
    for volume in volumes or []:
        if "secret" in volume and (tmp_path / volume["name"]).is_dir():
            for item in volume["secret"].get("items", []):
                (tmp_path / volume["name"] / item["path"]).write_text(SECRET_FILE_CONTENT)

    def mapped(value: str) -> str:
        for path, folder in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
            if value == path or value.startswith(path + "/"):
                return str(folder) + value[len(path):]
        return value

    command = list(container["command"])
    assert command[0] == "minedraft"
    args = command[1:]
    for i, word in enumerate(args[:-1]):
        if word in ports:
            args[i + 1] = str(ports[word])
        if word == "--host":
            args[i + 1] = "127.0.0.1"
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = mapped(var["value"])
    return [sys.executable, "-m", "minedraft.cli", *(mapped(a) for a in args), *extra], env


def endpoint_slice(address: str) -> dict[str, Any]:
    host, port = address.rsplit(":", 1)
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "qwen3-8b-engine-abc12", "namespace": NS,
                         "labels": {"kubernetes.io/service-name": "qwen3-8b-engine"}},
            "addressType": "IPv4", "endpoints": [{"addresses": [host], "conditions": {"ready": True}}],
            "ports": [{"name": "grpc", "port": int(port), "protocol": "TCP"}]}


async def test_gateway_pod_probes_mean_what_they_say(tmp_path: Path) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
    doc["metadata"].update(namespace=NS, uid="u")
    deployment = next(m for m in render.render_resource(doc)
                      if m["kind"] == "Deployment" and m["metadata"]["name"] == "qwen3-8b-gateway")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "startupProbe" not in container
    grpc_port = free_port()
    async with KubeEmulator() as kmock, Server(kmock):
        kmock.resources["discovery.k8s.io/v1/endpointslices"] = ResourceInfo(
            kind="EndpointSlice", namespaced=True, verbs=["get", "list", "watch", "create", "delete"])
        command, env = local_process(container, tmp_path, {"--port": grpc_port, "--metrics-port": free_port(),
                                                           "--http-port": free_port()},
                                     ["--kubernetes-api", str(kmock.url).rstrip("/")],
                                     deployment["spec"]["template"]["spec"].get("volumes", []))
        log = tmp_path / "gateway.log"
        process = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                                   stderr=log.open("w"))
        liveness = Prober("liveness", grpc_port, container["livenessProbe"])
        readiness = Prober("readiness", grpc_port, container["readinessProbe"])
        tasks = [asyncio.create_task(liveness.run()), asyncio.create_task(readiness.run())]
        engine = FakeEngineServer("engine-0")
        try:
            # No engine yet (they load for minutes): alive, not ready, and never restarted, for several liveness
            # windows (the process needs a few seconds to bind: a kubelet would restart it if that took a window).
            window = (container["livenessProbe"]["periodSeconds"] * container["livenessProbe"]["failureThreshold"]
                      * PERIOD_SCALE)
            await wait_for("the gateway's liveness to answer", lambda: any(ok for _, ok in liveness.history))
            started = time.monotonic()
            await wait_for("three liveness windows", lambda: time.monotonic() - started > 3 * window)
            assert process.poll() is None, log.read_text()[-2000:]
            assert liveness.restarts == 0, log.read_text()[-2000:]
            assert not readiness.ready and readiness.checks > 5
            # An engine becomes ready: so does the gateway.
            await engine.start()
            async with aiohttp.ClientSession() as session, session.post(
                    f"{str(kmock.url).rstrip('/')}/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices",
                    json=endpoint_slice(engine.address)) as response:
                assert response.status in (200, 201)
            await wait_for("the gateway ready once an engine is", lambda: readiness.ready)
            # Drain (SIGTERM, as the kubelet sends on deletion): readiness drops before the process exits. (A
            # kubelet restarts nothing once it has sent SIGTERM: restarts are counted until then.)
            assert liveness.restarts == 0
            process.send_signal(signal.SIGTERM)
            await wait_for("readiness to drop on drain", lambda: not readiness.ready or process.poll() is not None)
            dropped_before_exit = not readiness.ready
            await wait_for("the gateway to exit", lambda: process.poll() is not None,
                           timeout=render.GATEWAY_GRACE_SECONDS + 10)
            assert dropped_before_exit or any(not ok for _, ok in readiness.history[-3:])
            assert process.returncode == 0, log.read_text()[-2000:]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if process.poll() is None:
                process.kill()
                process.wait()
            await engine.stop()


# Flags of the engine pod with no CPU meaning, and what a CPU run uses instead (said, not hidden): the drafter's
# GPU index, and the vLLM drafter (the torch drafter starts in seconds here; the GPU pod's drafter is vLLM's).
CPU_FLAGS = {"--drafter-gpu": None, "--drafter-backend": "torch"}


def shared_compile_caches() -> dict[str, str]:
    """Environment a CPU run uses instead of the pod's cache volume (said, not hidden): the compile caches this
    suite's own engines fill, and no AOT compile (its artifacts fail to load on CPUs: tests/conftest.py). The pod's
    fresh emptyDir made every run compile the model from nothing, 20-50 s of a test about probes during a load."""
    import vllm.envs
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return {"VLLM_CACHE_ROOT": vllm.envs.VLLM_CACHE_ROOT, "TORCHINDUCTOR_CACHE_DIR": default_cache_dir(),
            "VLLM_USE_AOT_COMPILE": os.environ.get("VLLM_USE_AOT_COMPILE", "0")}


@pytest.mark.engine
@pytest.mark.timeout(600)
async def test_engine_pod_is_not_restarted_while_loading_and_drains(tmp_path: Path) -> None:
    """The rendered engine container on the CPU with the local model pair: the startup probe (model loaded, within
    startupTimeoutSeconds) holds liveness off during the load, no restart happens, readiness comes once loaded and
    drops on SIGTERM while liveness keeps answering until the process exits."""
    from minedraft.models.spec import is_complete_pair

    pair = ROOT / "minedraft" / "models" / "data" / "pair-v1"
    if not is_complete_pair(pair):
        pytest.skip("the committed local pair is not present")
    doc = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
    doc["metadata"].update(namespace=NS, uid="u")
    doc["spec"]["target"] = {"source": {"image": {"path": "/models/target"}}}
    doc["spec"]["draft"] = {"source": {"image": {"path": "/models/draft"}}}
    doc["spec"]["engine"] = {"maxNumSeqs": 8, "maxModelLen": 512, "terminationGracePeriodSeconds": 30}
    deployment = next(m for m in render.render_resource(doc)
                      if m["kind"] == "Deployment" and m["metadata"]["name"] == "qwen3-8b-engine")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    grpc_port = free_port()
    command, env = local_process(container, tmp_path, {"--grpc-port": grpc_port, "--metrics-port": free_port(),
                                                       "--http-port": free_port()},
                                 ["--kv-cache-gib", "1"], deployment["spec"]["template"]["spec"].get("volumes", []))
    # The image's model paths, mapped to the local pair; the CPU substitutions above.
    command = [str(pair / "target") if w == "/models/target" else str(pair / "draft") if w == "/models/draft"
               else w for w in command]
    for name, value in CPU_FLAGS.items():
        if name in command:
            i = command.index(name)
            command[i:i + 2] = [] if value is None else [name, value]
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    env.update(shared_compile_caches())
    log = tmp_path / "engine.log"
    process = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    startup = Prober("readiness", grpc_port, container["startupProbe"])
    liveness = Prober("liveness", grpc_port, container["livenessProbe"])
    readiness = Prober("readiness", grpc_port, container["readinessProbe"])
    startup_failures_allowed = container["startupProbe"]["failureThreshold"]
    tasks = [asyncio.create_task(startup.run())]
    try:
        # The kubelet runs only the startup probe until it succeeds; a restart would need failureThreshold
        # consecutive failures (the whole startupTimeoutSeconds).
        await wait_for("the engine to load (startup probe passes)", lambda: startup.ready
                       or process.poll() is not None, timeout=startup_failures_allowed
                       * container["startupProbe"]["periodSeconds"] * PERIOD_SCALE)
        assert process.poll() is None, log.read_text()[-3000:]
        failures_while_loading = sum(1 for _, ok in startup.history if not ok)
        assert failures_while_loading < startup_failures_allowed  # no restart while loading
        tasks[0].cancel()
        tasks += [asyncio.create_task(liveness.run()), asyncio.create_task(readiness.run())]
        await wait_for("ready after loading", lambda: readiness.ready)
        # A kubelet restarts nothing once it has sent SIGTERM (the container is being stopped): count until then.
        assert liveness.restarts == 0, log.read_text()[-3000:]
        process.send_signal(signal.SIGTERM)
        await wait_for("readiness to drop on drain", lambda: not readiness.ready or process.poll() is not None,
                       timeout=30)
        await wait_for("the engine to exit", lambda: process.poll() is not None,
                       timeout=deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] + 30)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if process.poll() is None:
            process.kill()
            process.wait()
