"""Scale from zero end to end: the real gateway process, a real Prometheus scraping it, the real kopf operator on the
Kubernetes emulator, and a real engine server over the shared engine.

The chain: a MineDraft with minReplicas 0 sits at zero engine replicas; a client's stream arrives at the gateway and
waits there (no engine is ready); the gateway's `minedraft_gateway_streams_waiting` goes to 1; Prometheus scrapes it;
the operator's autoscaler, polling that one signal every tick while at zero, scales the MineDraft 0 -> 1 through
/scale; the engine Deployment follows. The emulator has no kubelet: the test plays it, starting an engine server
when the Deployment asks for a replica and publishing its address in the engine Service's EndpointSlice, which the
gateway watches; the waiting stream is then routed and completes.

Not covered here: a pod's own start (image pull, model load: on this machine an engine loads in ~35-40 s, which a
real cold start adds to the time measured here; the engine is the session's shared one, loaded before the clock
starts, in the target-alone mode), readiness probes (the slice is published ready at once), and scale to zero itself
on a real cluster (the policy's idle window is covered in the simulator and unit tests).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kmock import ResourceInfo, Server

from minedraft.api import pb, pb_grpc
from minedraft.engine.async_engine import AsyncEngine
from minedraft.server.app import EngineServer
from minedraft.testing.fake_engine import FakeBehaviour, FakeEngineServer
from tests.component.kube_emulator import KubeEmulator
from tests.component.test_operator_kmock import (
    BUILTIN,
    NS,
    VERBS,
    Cluster,
    OperatorRun,
    condition,
    declare,
    example,
    free_port,
    wait_for,
)

# The shared engine may have to load first (~40 s alone, minutes on a busy machine).
pytestmark = pytest.mark.timeout(900)

NAME = "zero"
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with KubeEmulator() as kmock, Server(kmock):
        for key, (kind, subresources) in BUILTIN.items():
            declare(kmock, key, kind, subresources)
        declare(kmock, "discovery.k8s.io/v1/endpointslices", "EndpointSlice", set())
        kmock.resources["v1/namespaces"] = ResourceInfo(kind="Namespace", namespaced=False, verbs=VERBS)
        kmock.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = ResourceInfo(
            kind="CustomResourceDefinition", namespaced=False, verbs=VERBS)
        yield Cluster(kmock)


def engine_slice(port: int) -> dict[str, Any]:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{NAME}-engine-a", "labels": {"kubernetes.io/service-name": f"{NAME}-engine"}},
            "addressType": "IPv4", "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}],
            "ports": [{"name": "grpc", "port": port, "protocol": "TCP"}]}


@pytest.mark.parametrize("engine_kind", ["fake", "real"])
async def test_first_request_after_zero_replicas_completes(cluster: Cluster, engine_kind: str, tmp_path: Path,
                                                           request: pytest.FixtureRequest) -> None:
    """engine_kind "real": an EngineServer over the session's vLLM engine; "fake": the gateway tests' model-less
    engine (the same chain, without waiting for a model to load)."""
    from tests.metrics_support import Prometheus

    # Loaded before anything is timed (a pod's model load is not part of what this test measures).
    shared = request.getfixturevalue("ar_engine") if engine_kind == "real" else None
    fake: FakeEngineServer | None = None
    gateway_port, metrics_port = free_port(), free_port()
    gateway = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "minedraft.cli", "gateway", "--port", str(gateway_port),
        "--metrics-port", str(metrics_port), "--kubernetes-service", f"{NS}/{NAME}-engine",
        "--kubernetes-api", str(cluster.kmock.url).rstrip("/"), "--engine-wait-timeout-s", "180",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "GRPC_VERBOSITY": "ERROR"})
    # The gateway's metrics under the job name a plain scrape config would give it: the gateway Service's name.
    prometheus = Prometheus(tmp_path, {f"{NAME}-gateway": f"127.0.0.1:{metrics_port}"}, [])
    run: OperatorRun | None = None
    server: EngineServer | None = None
    engine: AsyncEngine | None = None
    try:
        await asyncio.to_thread(prometheus.wait_ready)
        await wait_for("Prometheus to scrape the gateway's waiting-streams gauge", lambda: prometheus.query(
            "minedraft_gateway_streams_waiting"), timeout=60)
        run = OperatorRun(cluster, prometheus_url=prometheus.url)
        await run.start()
        doc = example("autoscaled")
        doc["metadata"]["name"] = NAME
        doc["spec"]["engine"]["maxNumSeqs"] = 32
        auto = doc["spec"]["autoscaling"]
        auto.update({"minReplicas": 0, "maxReplicas": 2, "intervalSeconds": 60})
        del auto["prometheus"]  # the operator's --prometheus-url
        await cluster.apply_minedraft(doc)
        await wait_for("the engine Deployment at zero replicas", lambda: (
            cluster.obj("Deployment", f"{NAME}-engine") or {}).get("spec", {}).get("replicas") == 0)
        # The autoscaler's first evaluation (its status), not only the reconcile's ScalingReady condition: the
        # operator's periodic pass writes them separately.
        await wait_for("a first evaluation at zero", lambda: condition(
            cluster.minedraft(NAME), "ScalingReady").get("reason")
            and "scaling" in ((cluster.minedraft(NAME) or {}).get("status") or {}))
        md = cluster.minedraft(NAME) or {}
        assert md["spec"].get("replicas", 0) == 0 and md["status"]["scaling"]["decisions"] == []

        # The first request: it waits at the gateway while there is no engine.
        started = time.monotonic()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{gateway_port}")
        call = pb_grpc.GenerationStub(channel).Generate(
            pb.GenerateRequest(prompt="def main():", sampling_params=pb.SamplingParams(max_tokens=8)), timeout=180)
        first: asyncio.Task[Any] = asyncio.ensure_future(call.read())

        # The autoscaler sees the waiting stream (through Prometheus) and scales 0 -> 1 without waiting for its 60 s
        # interval; the engine Deployment follows.
        await wait_for("the Deployment to ask for one engine", lambda: (
            cluster.obj("Deployment", f"{NAME}-engine") or {}).get("spec", {}).get("replicas") == 1, timeout=60)
        scaled_after = time.monotonic() - started
        md = cluster.minedraft(NAME) or {}
        decision = md["status"]["scaling"]["decisions"][-1]
        assert (decision["from"], decision["to"]) == (0, 1) and "waiting at the gateway" in decision["reason"]
        assert not first.done()  # still waiting: no engine yet

        # The kubelet's part: an engine server comes up and its address is published in the Service's slice.
        if engine_kind == "real":
            assert shared is not None
            engine = AsyncEngine(shared)
            server = EngineServer(f"{NAME}-engine-0")
            await server.start()
            await server.attach(engine)
            port = int(server.port or 0)
        else:
            fake = await FakeEngineServer(f"{NAME}-engine-0", FakeBehaviour()).start()
            port = fake.port
        await cluster.call("POST", SLICES, engine_slice(port))

        response = await asyncio.wait_for(first, 120)
        first_token_after = time.monotonic() - started
        assert response is not grpc.aio.EOF
        rest = []
        while (item := await call.read()) is not grpc.aio.EOF:
            rest.append(item)
        assert (rest or [response])[-1].finish_reason == "length"
        await channel.close()
        print(f"\ncold start ({engine_kind} engine, no model load): scaled 0 -> 1 after {scaled_after:.1f} s, "
              f"first token after {first_token_after:.1f} s", file=sys.stderr)
    finally:
        if server is not None:
            await server.stop()
        if fake is not None:
            await fake.stop(0)
        if engine is not None:
            await engine.shutdown(shutdown_engine=False)
        if run is not None:
            await run.stop()
        if prometheus.process.poll() is None:
            prometheus.stop()
        if gateway.returncode is None:
            gateway.terminate()
            await asyncio.wait_for(gateway.wait(), 30)
