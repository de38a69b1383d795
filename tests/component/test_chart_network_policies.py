"""Every connection the system makes, judged against every NetworkPolicy that would be in the cluster: the chart's
(rendered by Helm) and the operator's for each MineDraft (rendered by minedraft.operator.render with the options the
chart's operator flags produce). Needed connections must pass; anything else that the policies could refuse must be
refused. Judged by the evaluator in tests/network_policy.py (its semantics are unit-tested on their own).

Not judged: egress beyond need. The policies restrict ingress only, on purpose: the API server and the model hub
are addresses outside the pod network that differ per cluster (an egress policy would need their CIDRs), so the
required egress connections below are checked to pass, not that nothing else does.
"""

from __future__ import annotations

import argparse
import copy
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from minedraft.operator import render
from minedraft.operator import spec as s
from minedraft.operator.cli import add_subcommands, settings_from_args
from tests.component.test_chart_helm import NAMESPACE, helm_render
from tests.network_policy import Endpoint, External, Node, Pod, allowed, pod_from_template

ROOT = Path(__file__).resolve().parents[2]
TEAM = "team-a"  # where the MineDrafts live (the operator runs in the chart's NAMESPACE)

PROMETHEUS = Pod("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"})
GRAFANA = Pod("grafana", "monitoring", {"app.kubernetes.io/name": "grafana"})  # Prometheus' namespace, not it
NEIGHBOUR = Pod("notebook", TEAM, {"app": "notebook"})  # another workload in the MineDrafts' namespace
CLIENT = Pod("client", "apps", {"app": "chat"})
INTERNET = External("internet-client", "203.0.113.7")
HF_HUB = External("huggingface.co", "18.239.50.1")
API_SERVER = External("kube-apiserver", "172.20.0.10")
DNS = Pod("coredns", "kube-system", {"k8s-app": "kube-dns"}, ports={"dns": (53, "UDP")})
KUBELET = Node()


@functools.cache
def chart(values_json: str) -> list[dict[str, Any]]:
    return list(helm_render(yaml.safe_load(values_json))["docs"])


def minedraft(example: str, name: str | None = None, drop_prometheus: bool = False,
              gateway: bool = True) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / f"{example}.yaml").read_text())
    doc = copy.deepcopy(doc)
    doc["metadata"].update(namespace=TEAM, uid=f"uid-{name or example}")
    if name:
        doc["metadata"]["name"] = name
    if drop_prometheus:
        doc["spec"]["autoscaling"].pop("prometheus", None)
    if not gateway:
        doc["spec"].setdefault("gateway", {})["enabled"] = False
    return doc


# Not autoscaled; autoscaled through a named Prometheus; autoscaled with none (the operator scrapes the pods); no
# gateway (clients call the engines' headless Service).
MINEDRAFTS = [minedraft("minimal"), minedraft("autoscaled"),
              minedraft("autoscaled", name="direct", drop_prometheus=True),
              minedraft("minimal", name="nogw", gateway=False)]


@dataclass(frozen=True)
class Connection:
    source: Endpoint
    destination: Endpoint
    port: int
    protocol: str
    needed: bool
    why: str

    def __str__(self) -> str:
        return f"{self.source.name} -> {self.destination.name}:{self.port}/{self.protocol} ({self.why})"


def _deployment(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)


def _system(values: dict[str, Any]) -> tuple[list[dict[str, Any]], list[Connection], list[Any]]:
    docs = chart(yaml.safe_dump(values))
    operator_dep = next(d for d in docs if d["kind"] == "Deployment")
    operator = pod_from_template("operator", NAMESPACE, operator_dep["spec"]["template"])
    # The operator renders the MineDrafts' objects with the options its chart-given flags mean.
    parser = argparse.ArgumentParser()
    add_subcommands(parser.add_subparsers())
    settings = settings_from_args(parser.parse_args(operator_dep["spec"]["template"]["spec"]["containers"][0]["args"]))
    options = settings.render_options(monitoring_available=False)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    connections = [
        Connection(PROMETHEUS, operator, operator.ports["metrics"][0], "TCP", True, "Prometheus scrapes the operator"),
        Connection(KUBELET, operator, operator.ports["health"][0], "TCP", True, "kubelet probes kopf's /healthz"),
        Connection(PROMETHEUS, operator, operator.ports["health"][0], "TCP", False, "health is the kubelet's"),
        Connection(operator, API_SERVER, 443, "TCP", True, "the operator watches and applies objects"),
        Connection(operator, DNS, 53, "UDP", True, "the operator resolves names"),
    ]
    for stranger in (NEIGHBOUR, CLIENT, GRAFANA):
        connections += [
            Connection(stranger, operator, operator.ports["metrics"][0], "TCP", False, "metrics are Prometheus'"),
            Connection(stranger, operator, operator.ports["health"][0], "TCP", False, "health is the kubelet's"),
        ]
    instances = []
    for resource in MINEDRAFTS:
        manifests = render.render_resource(resource, options)
        policies += [m for m in manifests if m["kind"] == "NetworkPolicy"]
        meta = resource["metadata"]
        engine = pod_from_template(f"{meta['name']}-engine", TEAM,
                                   _deployment(manifests, f"{meta['name']}-engine")["spec"]["template"])
        gateway = (pod_from_template(f"{meta['name']}-gateway", TEAM,
                                     _deployment(manifests, f"{meta['name']}-gateway")["spec"]["template"])
                   if resource["spec"].get("gateway", {}).get("enabled", True) else None)
        instances.append((resource, engine, gateway))
    for resource, engine, gateway in instances:
        autoscaling = resource["spec"].get("autoscaling")
        scraped = bool(autoscaling) and not (autoscaling.get("prometheus") or {}).get("address") \
            and not settings.prometheus_url
        grpc, metrics = engine.ports["grpc"][0], engine.ports["metrics"][0]
        # Behind the gateway nothing listens there by default; the policy must still keep the port number closed.
        http = engine.ports["http"][0] if "http" in engine.ports else s.DEFAULT_ENGINE_HTTP_PORT
        hub = any("huggingFace" in resource["spec"][m]["source"] for m in ("target", "draft"))
        connections += [
            Connection(PROMETHEUS, engine, metrics, "TCP", True, "Prometheus scrapes engines"),
            Connection(KUBELET, engine, grpc, "TCP", True, "kubelet gRPC probes"),
            Connection(engine, DNS, 53, "UDP", True, "the engine resolves names"),
            Connection(operator, engine, metrics, "TCP", scraped,
                       "the autoscaler scrapes engines when it has no Prometheus"),
            Connection(GRAFANA, engine, metrics, "TCP", False, "only Prometheus' pods scrape"),
            Connection(NEIGHBOUR, engine, metrics, "TCP", False, "only Prometheus scrapes"),
        ]
        if hub:
            connections.append(Connection(engine, HF_HUB, 443, "TCP", True, "the engine downloads from the hub"))
        if gateway is None:  # the engines' gRPC port is then open to any client (any pod), nothing more
            connections += [
                Connection(CLIENT, engine, grpc, "TCP", True, "without a gateway clients call the engines"),
                Connection(NEIGHBOUR, engine, grpc, "TCP", True, "without a gateway clients call the engines"),
                Connection(CLIENT, engine, http, "TCP", True,
                           "without a gateway clients call the engines' HTTP API"),
                Connection(PROMETHEUS, engine, http, "TCP", True, "any client may call the engines' HTTP API"),
            ]
            continue
        # Behind the gateway the engines' HTTP port is closed by default (no way around the gateway's auth).
        assert "http" not in engine.ports or (resource["spec"].get("engine") or {}).get("httpPort")
        gw_grpc, gw_metrics = gateway.ports["grpc"][0], gateway.ports["metrics"][0]
        connections += [
            Connection(CLIENT, gateway, gw_grpc, "TCP", True, "clients in other namespaces call the gateway"),
            Connection(NEIGHBOUR, gateway, gw_grpc, "TCP", True, "clients in its namespace call the gateway"),
            Connection(INTERNET, gateway, gw_grpc, "TCP", True, "clients through a LoadBalancer/Ingress"),
            Connection(gateway, engine, grpc, "TCP", True, "the gateway routes streams to its engines"),
            Connection(gateway, API_SERVER, 443, "TCP", True, "the gateway watches EndpointSlices"),
            Connection(gateway, DNS, 53, "UDP", True, "the gateway resolves names"),
            Connection(PROMETHEUS, gateway, gw_metrics, "TCP", True, "Prometheus scrapes gateways"),
            Connection(KUBELET, gateway, gw_grpc, "TCP", True, "kubelet gRPC probes"),
            Connection(operator, gateway, gw_metrics, "TCP", scraped,
                       "the autoscaler reads waiting streams from gateways when it has no Prometheus"),
            Connection(gateway, engine, metrics, "TCP", False, "the gateway only routes"),
            Connection(PROMETHEUS, engine, grpc, "TCP", False, "Prometheus only scrapes"),
            Connection(operator, engine, grpc, "TCP", False, "the operator never calls the engines' API"),
            Connection(NEIGHBOUR, engine, grpc, "TCP", False, "only the gateway reaches engines"),
            Connection(CLIENT, engine, grpc, "TCP", False, "only the gateway reaches engines"),
            Connection(INTERNET, engine, grpc, "TCP", False, "only the gateway reaches engines"),
            Connection(CLIENT, engine, http, "TCP", False, "only the gateway reaches engines"),
            Connection(gateway, engine, http, "TCP", False, "the gateway speaks gRPC to engines"),
            Connection(NEIGHBOUR, gateway, gw_metrics, "TCP", False, "only Prometheus scrapes"),
            Connection(CLIENT, gateway, gw_metrics, "TCP", False, "only Prometheus scrapes"),
        ]
        for other, _, other_gateway in instances:
            if other is not resource and other_gateway is not None:
                connections.append(Connection(other_gateway, engine, grpc, "TCP", False,
                                              "another MineDraft's gateway must not reach these engines"))
    return policies, connections, instances


@pytest.mark.parametrize("values", [{}, {"operator": {"prometheusUrl": "http://prometheus.monitoring:9090"}}],
                         ids=["operator-scrapes", "operator-queries-prometheus"])
def test_network_policies_allow_exactly_the_connections_the_system_makes(values: dict[str, Any]) -> None:
    policies, connections, instances = _system(values)
    wrong = [("BLOCKED but needed: " if c.needed else "OPEN beyond need: ") + str(c) for c in connections
             if allowed(policies, c.source, c.destination, c.port, c.protocol) != c.needed]
    assert not wrong, "\n".join(wrong)
    # The operator's, each MineDraft's engine one, and a gateway one where a gateway runs.
    assert len(policies) == 1 + len(MINEDRAFTS) + sum(1 for _, _, gw in instances if gw is not None)
    assert any(c.needed and c.source.name == "operator" and c.port == render.ENGINE_METRICS_PORT
               for c in connections) == (not values)


def test_without_network_policies_nothing_is_refused() -> None:
    """networkPolicy.enabled false: no policy from the chart nor from the operator (which gets --network-policy=off)."""
    docs = chart(yaml.safe_dump({"networkPolicy": {"enabled": False}}))
    assert not [d for d in docs if d["kind"] == "NetworkPolicy"]
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--network-policy=off" in args


def test_every_serving_port_of_the_gateway_is_open_to_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway policy follows the gateway container's ports: a port added later (e.g. HTTP) is reachable by
    clients without touching the policy, and metrics stays closed."""
    original = render.gateway_deployment

    def with_http(spec: Any, meta: Any) -> dict[str, Any]:
        dep = original(spec, meta)
        dep["spec"]["template"]["spec"]["containers"][0]["ports"].append(
            {"name": "http", "containerPort": 8000, "protocol": "TCP"})
        return dep

    monkeypatch.setattr(render, "gateway_deployment", with_http)
    manifests = render.render_resource(MINEDRAFTS[0])
    policies = [m for m in manifests if m["kind"] == "NetworkPolicy"]
    gateway = pod_from_template("gw", TEAM, _deployment(manifests, "qwen3-8b-gateway")["spec"]["template"])
    assert allowed(policies, CLIENT, gateway, 8000) and allowed(policies, INTERNET, gateway, gateway.ports["grpc"][0])
    assert not allowed(policies, CLIENT, gateway, gateway.ports["metrics"][0])
