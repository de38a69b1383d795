"""Scale from zero through a Service (issue 30, defect 1): the first request must reach a gateway.

A client never dials a gateway pod: it reaches the gateway Service, and kube-proxy (or a cloud load balancer) sends
it only to endpoints the EndpointSlice controller marked ready, that is, pods whose readiness probe passes. A
gateway that is ready only with an engine behind it is at zero engines no endpoint at all: the first request is
refused before any gateway sees it, nothing waits, and nothing wakes the engines.

The kubelet, the EndpointSlice controller and kube-proxy do not run here, so the test models each from what the real
one does: the rendered readiness probe runs against the gateway process (started from the rendered container
command, as in test_pod_contract.py) and sets the pod's Ready condition; the gateway Service's EndpointSlice is built
from the pods as the controller builds it (every pod with an IP, `conditions.ready` = the pod's Ready condition,
`serving` the same, `terminating` false; publishNotReadyAddresses is off); the client connects only through an
endpoint whose `ready` is true, as kube-proxy routes. The operator's autoscaler then finds the waiting stream by
scraping the gateway pods listed in that slice (the engines' slice lists none at zero), and the held stream
completes once an engine appears. What only a real cluster shows: kube-proxy's and the load balancer's own timing
(health-check intervals of a cloud load balancer add to the wake-up time) and their idle timeouts, which must
exceed the rendered engine wait for a held HTTP request to survive it.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from kmock import ResourceInfo, Server

from minedraft.api import pb, pb_grpc
from minedraft.operator import kube, render
from minedraft.operator import spec as s
from minedraft.operator.autoscale import observe
from minedraft.operator.autoscale.loop import Autoscaler
from minedraft.testing.fake_engine import FakeEngineServer
from tests.component.kube_emulator import KubeEmulator
from tests.component.test_pod_contract import Prober, endpoint_slice, free_port, local_process, wait_for

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
NS = "serving"


def scale_to_zero_resource() -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "autoscaled.yaml").read_text())
    doc["metadata"].update(name="qwen3-8b", namespace=NS, uid="u")
    doc["spec"]["autoscaling"]["minReplicas"] = 0
    doc["spec"]["autoscaling"].pop("prometheus", None)  # the operator scrapes the pods itself
    return doc


def controller_slice(service: str, pods: list[tuple[str, bool]], ports: dict[str, int]) -> dict[str, Any]:
    """The EndpointSlice the EndpointSlice controller writes for a Service whose selector matches `pods` (IP, Ready
    condition): every pod with an IP is listed, ready and serving as its Ready condition, not terminating."""
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{service}-x7k2p", "namespace": NS,
                         "labels": {"kubernetes.io/service-name": service,
                                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [ip], "conditions": {"ready": ready, "serving": ready, "terminating": False},
                           "targetRef": {"kind": "Pod", "namespace": NS, "name": f"{service}-{i}"}}
                          for i, (ip, ready) in enumerate(pods)],
            "ports": [{"name": name, "port": port, "protocol": "TCP"} for name, port in ports.items()]}


def routable(slice_: dict[str, Any]) -> list[str]:
    """Where kube-proxy sends a new connection: endpoints whose `ready` is true (a terminating-only fallback aside)."""
    return [a for e in slice_["endpoints"] if (e.get("conditions") or {}).get("ready") for a in e["addresses"]]


async def test_first_request_at_zero_engines_reaches_a_gateway_through_its_service(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = scale_to_zero_resource()
    spec = s.parse_spec(doc["spec"])
    manifests = render.render_resource(doc)
    engines = next(m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == "qwen3-8b-engine")
    assert engines["spec"]["replicas"] == 0
    gateway = next(m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == "qwen3-8b-gateway")
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    # A stream waits for a whole cold start, never less than the engine's own startup window.
    command = container["command"]
    wait_s = float(command[command.index("--engine-wait-timeout-s") + 1])
    assert wait_s >= spec.engine.startup_timeout_seconds + render.ENGINE_COLD_START_MARGIN_SECONDS
    grpc_port, metrics_port = free_port(), free_port()
    async with KubeEmulator() as kmock, Server(kmock):
        kmock.resources["discovery.k8s.io/v1/endpointslices"] = ResourceInfo(
            kind="EndpointSlice", namespaced=True, verbs=["get", "list", "watch", "create", "delete"])
        argv, env = local_process(container, tmp_path, {"--port": grpc_port, "--metrics-port": metrics_port,
                                                        "--http-port": free_port()},
                                  ["--kubernetes-api", str(kmock.url).rstrip("/")],
                                  gateway["spec"]["template"]["spec"].get("volumes", []))
        log = tmp_path / "gateway.log"
        process = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=log.open("w"))
        readiness = Prober("readiness", grpc_port, container["readinessProbe"])
        liveness = Prober("liveness", grpc_port, container["livenessProbe"])
        probing = asyncio.gather(readiness.run(), liveness.run())
        engine = FakeEngineServer("qwen3-8b-engine-0")
        channel: grpc.aio.Channel | None = None
        try:
            # The kubelet's readiness probe (periods scaled), a few checks after the process answers: the pod's Ready
            # condition.
            await wait_for("the gateway to answer", lambda: any(ok for _, ok in liveness.history))
            checked = readiness.checks
            await wait_for("three more readiness checks", lambda: readiness.checks >= checked + 3)
            service = controller_slice("qwen3-8b-gateway", [("127.0.0.1", readiness.ready)],
                                       {"grpc": grpc_port, "metrics": metrics_port})
            # kube-proxy: a connection goes only to a ready endpoint. Zero engines: the gateway must still be one.
            targets = routable(service)
            assert targets, ("the gateway Service has no ready endpoint at zero engines: the first request is "
                             "refused before it reaches a gateway\n" + log.read_text()[-2000:])
            channel = grpc.aio.insecure_channel(f"{targets[0]}:{grpc_port}")
            call = pb_grpc.GenerationStub(channel).Generate(
                pb.GenerateRequest(prompt="def main():", sampling_params=pb.SamplingParams(max_tokens=4)), timeout=120)
            first = asyncio.ensure_future(call.read())

            # The operator's autoscaler at zero, scraping the gateway pods its slices list (no Prometheus): it finds
            # the held stream and wakes one engine.
            monkeypatch.setattr(render, "GATEWAY_METRICS_PORT", metrics_port)

            async def slices(namespace: str, name: str) -> dict[str, Any]:
                return {"items": [service]} if name == "qwen3-8b-gateway" else {"items": []}

            async def ready(namespace: str, name: str) -> list[str]:
                return kube.slice_addresses(await slices(namespace, name), ready_only=True)

            async def every(namespace: str, name: str) -> list[str]:
                return kube.slice_addresses(await slices(namespace, name), ready_only=False)

            scaler = Autoscaler(None, ready, gateway_addresses=every)
            meta = s.parse_meta(doc["metadata"])
            async with aiohttp.ClientSession() as session:
                async def waiting() -> float | None:
                    return await observe.scrape_gateway_waiting(session, [f"127.0.0.1:{metrics_port}"])
                for _ in range(200):
                    if await waiting() == 1.0:
                        break
                    await asyncio.sleep(0.05)
                evaluation = await scaler.evaluate(session, spec, meta, None, 0.0)
            assert (evaluation.decision.current, evaluation.decision.desired) == (0, 1), evaluation.decision.reason
            assert not first.done()

            # The woken engine becomes ready and is published in the engines' slice: the held stream is served.
            await engine.start()
            async with aiohttp.ClientSession() as session, session.post(
                    f"{str(kmock.url).rstrip('/')}/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices",
                    json=endpoint_slice(engine.address)) as response:
                assert response.status in (200, 201)
            response = await asyncio.wait_for(first, 60)
            assert response is not grpc.aio.EOF
        finally:
            probing.cancel()
            await asyncio.gather(probing, return_exceptions=True)
            if channel is not None:
                await channel.close()
            if process.poll() is None:
                process.kill()
                process.wait()
            await engine.stop()


def test_gateways_are_scraped_whatever_their_readiness() -> None:
    """The operator lists gateway pods from every endpoint of their Service's slices, ready or not."""
    listing = {"items": [controller_slice("g", [("10.0.0.1", False), ("10.0.0.2", True)], {"metrics": 9401})]}
    assert kube.slice_addresses(listing, ready_only=False) == ["10.0.0.1", "10.0.0.2"]
    assert kube.slice_addresses(listing, ready_only=True) == ["10.0.0.2"]


def test_only_deployments_that_may_reach_zero_are_ready_without_engines() -> None:
    for minimum, expected in ((0, True), (1, False)):
        doc = scale_to_zero_resource()
        doc["spec"]["autoscaling"]["minReplicas"] = minimum
        gateway = next(m for m in render.render_resource(doc) if m["kind"] == "Deployment"
                       and m["metadata"]["name"] == "qwen3-8b-gateway")
        assert ("--ready-without-engines" in gateway["spec"]["template"]["spec"]["containers"][0]["command"]
                ) is expected


def test_a_not_ready_gateway_holding_a_stream_still_wakes_the_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator's autoscaler as run_operator builds it, over a client whose slices list the gateway pod not
    ready (its readiness failed, e.g. an older gateway without --ready-without-engines during a rollout): the pod is
    still scraped, its held stream seen, and one engine woken."""
    from minedraft.operator.handlers import build_autoscaler
    from minedraft.operator.settings import OperatorSettings

    listing = {"items": [controller_slice("qwen3-8b-gateway", [("10.0.0.7", False)], {"metrics": 9401})]}

    class Client:
        async def ready_addresses(self, namespace: str, service: str) -> list[str]:
            return kube.slice_addresses(listing if service.endswith("gateway") else {}, ready_only=True)

        async def all_addresses(self, namespace: str, service: str) -> list[str]:
            return kube.slice_addresses(listing if service.endswith("gateway") else {}, ready_only=False)

    scraped: list[list[str]] = []

    async def scrape(session: Any, addresses: list[str]) -> float | None:
        scraped.append(list(addresses))
        return 1.0 if addresses else None

    monkeypatch.setattr(observe, "scrape_gateway_waiting", scrape)
    scaler = build_autoscaler(OperatorSettings(), Client())  # type: ignore[arg-type]
    doc = scale_to_zero_resource()
    evaluation = asyncio.run(scaler.evaluate(None, s.parse_spec(doc["spec"]), s.parse_meta(doc["metadata"]), None,
                                             0.0))
    assert scraped == [["10.0.0.7:9401"]]
    assert (evaluation.decision.current, evaluation.decision.desired) == (0, 1)
