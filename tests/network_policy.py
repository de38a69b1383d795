"""A small evaluator of Kubernetes NetworkPolicies (networking.k8s.io/v1): may this endpoint open that connection?

Pure: policies (as rendered dicts) + the two endpoints + port/protocol -> allowed. It follows the API's documented
semantics, which the unit tests in tests/unit/test_network_policy_semantics.py pin down:
- A pod no policy selects (for a direction) is not isolated in that direction: everything is allowed.
- A pod selected by at least one policy of a direction admits only what some rule of some such policy allows
  (policies are additive, never subtractive). A connection needs the source's egress AND the destination's
  ingress to allow it.
- policyTypes absent: Ingress, plus Egress when the policy has an `egress` section.
- A policy selects pods of its own namespace only; `podSelector: {}` selects all of them.
- A rule without `from`/`to` (or with an empty list) matches every peer; without `ports` every port.
- A peer with only podSelector means pods in the policy's namespace; only namespaceSelector, every pod in the
  matching namespaces; both in ONE peer, pods matching both (AND); separate peers are alternatives (OR).
- ipBlock matches endpoints outside the pod network by IP (cidr minus except). Whether it matches pod IPs is left
  to the network plugin by the API; this evaluator never matches pods with it (the portable reading).
- Ports: protocol defaults to TCP; a port absent means every port of that protocol; a number with endPort a range;
  a name is resolved against the destination pod's named container ports.
- Traffic from or to the pod's own node (the kubelet's probes) is always allowed, and a pod can always reach itself.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Policy = Mapping[str, Any]


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: Mapping[str, str]
    namespace_labels: Mapping[str, str] = field(default_factory=dict)
    # Named container ports: name -> (number, protocol).
    ports: Mapping[str, tuple[int, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Kubernetes sets this label on every namespace (1.21+); selectors by namespace name rely on it.
        if "kubernetes.io/metadata.name" not in self.namespace_labels:
            object.__setattr__(self, "namespace_labels",
                               {**self.namespace_labels, "kubernetes.io/metadata.name": self.namespace})


@dataclass(frozen=True)
class External:
    """An address outside the pod network: a client on the internet, the model hub, the API server's endpoint."""

    name: str
    ip: str


@dataclass(frozen=True)
class Node:
    """The node a pod runs on (its kubelet, host-network processes)."""

    name: str = "node"


Endpoint = Pod | External | Node


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A metav1.LabelSelector: matchLabels AND every matchExpression; an empty selector matches everything."""
    if selector is None:
        return True
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], list(expr.get("values") or [])
        if op == "In":
            ok = key in labels and labels[key] in values
        elif op == "NotIn":
            ok = key not in labels or labels[key] not in values
        elif op == "Exists":
            ok = key in labels
        elif op == "DoesNotExist":
            ok = key not in labels
        else:
            raise ValueError(f"unknown label selector operator {op!r}")
        if not ok:
            return False
    return True


def policy_types(policy: Policy) -> list[str]:
    spec = policy.get("spec") or {}
    if spec.get("policyTypes"):
        return list(spec["policyTypes"])
    return ["Ingress"] + (["Egress"] if "egress" in spec else [])


def _namespace(policy: Policy) -> str:
    namespace = (policy.get("metadata") or {}).get("namespace")
    if not namespace:
        raise ValueError(f"NetworkPolicy {(policy.get('metadata') or {}).get('name')!r} has no namespace")
    return str(namespace)


def selects(policy: Policy, pod: Pod) -> bool:
    return _namespace(policy) == pod.namespace and selector_matches(policy["spec"].get("podSelector") or {},
                                                                     pod.labels)


def _peer_matches(peer: Mapping[str, Any], endpoint: Endpoint, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        if not isinstance(endpoint, External):
            return False
        ip = ipaddress.ip_address(endpoint.ip)
        block = peer["ipBlock"]
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(e) for e in block.get("except") or [])
    if not isinstance(endpoint, Pod):
        return False
    pod_selector, ns_selector = peer.get("podSelector"), peer.get("namespaceSelector")
    if pod_selector is None and ns_selector is None:
        raise ValueError(f"a NetworkPolicy peer needs podSelector, namespaceSelector or ipBlock: {peer}")
    if ns_selector is None and endpoint.namespace != policy_namespace:
        return False
    return (selector_matches(ns_selector, endpoint.namespace_labels) if ns_selector is not None else True) and (
        selector_matches(pod_selector, endpoint.labels) if pod_selector is not None else True)


def _port_matches(entry: Mapping[str, Any], destination: Endpoint, port: int, protocol: str) -> bool:
    if entry.get("protocol", "TCP") != protocol:
        return False
    if "port" not in entry:
        return True
    wanted = entry["port"]
    if isinstance(wanted, str):
        named = destination.ports.get(wanted) if isinstance(destination, Pod) else None
        return named == (port, protocol)
    end = entry.get("endPort", wanted)
    return int(wanted) <= port <= int(end)


def _rules_allow(rules: Iterable[Mapping[str, Any]], peers_key: str, peer: Endpoint, destination: Endpoint,
                 port: int, protocol: str, namespace: str) -> bool:
    for rule in rules:
        peers = rule.get(peers_key) or []
        ports = rule.get("ports") or []
        if peers and not any(_peer_matches(p, peer, namespace) for p in peers):
            continue
        if ports and not any(_port_matches(e, destination, port, protocol) for e in ports):
            continue
        return True
    return False


def ingress_allowed(policies: Sequence[Policy], source: Endpoint, destination: Pod, port: int,
                    protocol: str = "TCP") -> bool:
    isolating = [p for p in policies if selects(p, destination) and "Ingress" in policy_types(p)]
    return not isolating or any(
        _rules_allow(p["spec"].get("ingress") or [], "from", source, destination, port, protocol, _namespace(p))
        for p in isolating)


def egress_allowed(policies: Sequence[Policy], source: Pod, destination: Endpoint, port: int,
                   protocol: str = "TCP") -> bool:
    isolating = [p for p in policies if selects(p, source) and "Egress" in policy_types(p)]
    return not isolating or any(
        _rules_allow(p["spec"].get("egress") or [], "to", destination, destination, port, protocol, _namespace(p))
        for p in isolating)


def allowed(policies: Sequence[Policy], source: Endpoint, destination: Endpoint, port: int,
            protocol: str = "TCP") -> bool:
    """May `source` open a connection to `destination`:port (replies of an allowed connection always pass)?"""
    if source == destination or isinstance(source, Node) or isinstance(destination, Node):
        return True
    if isinstance(source, Pod) and not egress_allowed(policies, source, destination, port, protocol):
        return False
    return not isinstance(destination, Pod) or ingress_allowed(policies, source, destination, port, protocol)


def pod_from_template(name: str, namespace: str, template: Mapping[str, Any],
                      namespace_labels: Mapping[str, str] | None = None) -> Pod:
    """A pod as a Deployment's template would create it: its labels and its containers' named ports."""
    ports = {p["name"]: (int(p["containerPort"]), p.get("protocol", "TCP"))
             for c in template["spec"]["containers"] for p in c.get("ports") or [] if p.get("name")}
    return Pod(name, namespace, dict(template["metadata"].get("labels") or {}), dict(namespace_labels or {}), ports)
