"""The NetworkPolicy evaluator (tests/network_policy.py) against the semantics the Kubernetes API documents."""

from __future__ import annotations

from typing import Any

import pytest

from tests.network_policy import External, Node, Pod, allowed, pod_from_template, selector_matches

WEB = Pod("web", "shop", {"app": "web"}, {"team": "shop"}, {"http": (8080, "TCP"), "dns": (53, "UDP")})
DB = Pod("db", "shop", {"app": "db"}, {"team": "shop"}, {"pg": (5432, "TCP")})
OTHER_NS_WEB = Pod("web2", "blog", {"app": "web"}, {"team": "blog"})
MONITOR = Pod("prom", "monitoring", {"app": "prom"}, {"team": "obs"})
INTERNET = External("client", "203.0.113.7")


def policy(namespace: str, selector: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "p", "namespace": namespace}, "spec": {"podSelector": selector, **spec}}


DENY_ALL_INGRESS = policy("shop", {}, policyTypes=["Ingress"])


def test_a_pod_no_policy_selects_admits_everything() -> None:
    only_db = policy("shop", {"matchLabels": {"app": "db"}}, policyTypes=["Ingress"])
    assert allowed([], OTHER_NS_WEB, WEB, 8080)
    assert allowed([only_db], OTHER_NS_WEB, WEB, 8080)
    assert not allowed([only_db], OTHER_NS_WEB, DB, 5432)


def test_an_empty_pod_selector_selects_every_pod_of_its_own_namespace_only() -> None:
    assert not allowed([DENY_ALL_INGRESS], DB, WEB, 8080)
    assert not allowed([DENY_ALL_INGRESS], INTERNET, DB, 5432)
    assert allowed([DENY_ALL_INGRESS], WEB, OTHER_NS_WEB, 8080)  # other namespace: not selected


def test_a_rule_without_from_or_ports_matches_everything() -> None:
    open_all = policy("shop", {}, ingress=[{}])
    assert allowed([open_all], INTERNET, WEB, 1234) and allowed([open_all], MONITOR, DB, 5432)
    open_port = policy("shop", {}, ingress=[{"ports": [{"port": 8080}]}])
    assert allowed([open_port], INTERNET, WEB, 8080) and not allowed([open_port], INTERNET, WEB, 8081)
    empty_lists = policy("shop", {}, ingress=[{"from": [], "ports": []}])
    assert allowed([empty_lists], MONITOR, WEB, 1)


def test_a_pod_selector_peer_alone_means_the_policys_namespace() -> None:
    from_web = policy("shop", {"matchLabels": {"app": "db"}},
                      ingress=[{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}]}])
    assert allowed([from_web], WEB, DB, 5432)
    assert not allowed([from_web], OTHER_NS_WEB, DB, 5432)  # same labels, other namespace


def test_namespace_and_pod_selector_in_one_peer_is_and_in_two_peers_is_or() -> None:
    both = policy("shop", {"matchLabels": {"app": "db"}}, ingress=[{"from": [
        {"namespaceSelector": {"matchLabels": {"team": "obs"}}, "podSelector": {"matchLabels": {"app": "prom"}}}]}])
    either = policy("shop", {"matchLabels": {"app": "db"}}, ingress=[{"from": [
        {"namespaceSelector": {"matchLabels": {"team": "obs"}}}, {"podSelector": {"matchLabels": {"app": "prom"}}}]}])
    stray = Pod("stray", "monitoring", {"app": "grafana"}, {"team": "obs"})
    assert allowed([both], MONITOR, DB, 5432)
    assert not allowed([both], stray, DB, 5432)
    assert allowed([either], stray, DB, 5432)  # any pod in the namespace
    assert not allowed([either], OTHER_NS_WEB, DB, 5432)
    every_namespace = policy("shop", {}, ingress=[{"from": [{"namespaceSelector": {}}]}])
    assert allowed([every_namespace], OTHER_NS_WEB, WEB, 8080) and not allowed([every_namespace], INTERNET, WEB, 8080)


def test_ports_protocols_ranges_and_named_ports() -> None:
    rules = policy("shop", {}, ingress=[{"ports": [{"port": 5000, "endPort": 5010}, {"protocol": "UDP"},
                                                   {"port": "http"}, {"port": "pg"}]}])
    assert allowed([rules], INTERNET, WEB, 5005) and not allowed([rules], INTERNET, WEB, 5011)
    assert not allowed([rules], INTERNET, WEB, 4999)
    assert allowed([rules], INTERNET, WEB, 9999, "UDP")  # UDP without a port: every UDP port
    assert not allowed([rules], INTERNET, WEB, 9999, "SCTP")
    # A name resolves on the destination pod: web's "http" is 8080; "pg" names nothing on web.
    assert allowed([rules], INTERNET, WEB, 8080) and not allowed([rules], INTERNET, WEB, 5432)
    assert allowed([rules], INTERNET, DB, 5432) and not allowed([rules], INTERNET, DB, 8080)
    tcp_default = policy("shop", {}, ingress=[{"ports": [{"port": 53}]}])
    assert allowed([tcp_default], INTERNET, WEB, 53) and not allowed([tcp_default], INTERNET, WEB, 53, "UDP")


def test_policy_types_decide_which_directions_are_isolated() -> None:
    egress_only = policy("shop", {}, policyTypes=["Egress"])
    assert allowed([egress_only], INTERNET, WEB, 8080)  # ingress untouched
    assert not allowed([egress_only], WEB, MONITOR, 9090)
    implied = policy("shop", {}, egress=[{"to": [{"namespaceSelector": {"matchLabels": {"team": "obs"}}}]}])
    assert not allowed([implied], INTERNET, WEB, 8080)  # no policyTypes: Ingress always, Egress with egress rules
    assert allowed([implied], WEB, MONITOR, 9090) and not allowed([implied], WEB, OTHER_NS_WEB, 8080)


def test_both_ends_must_allow_and_policies_add_up() -> None:
    db_from_web = policy("shop", {"matchLabels": {"app": "db"}},
                         ingress=[{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}]}])
    web_egress_none = policy("shop", {"matchLabels": {"app": "web"}}, policyTypes=["Egress"])
    assert allowed([db_from_web], WEB, DB, 5432)
    assert not allowed([db_from_web, web_egress_none], WEB, DB, 5432)
    db_from_prom = policy("shop", {"matchLabels": {"app": "db"}}, ingress=[{"from": [
        {"namespaceSelector": {"matchLabels": {"team": "obs"}}}]}])
    assert allowed([db_from_web, db_from_prom], MONITOR, DB, 5432) and allowed([db_from_web, db_from_prom], WEB, DB, 1)


def test_ip_blocks_match_external_addresses_only() -> None:
    egress = policy("shop", {}, policyTypes=["Egress"], egress=[{"to": [
        {"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8"]}}], "ports": [{"port": 443}]}])
    assert allowed([egress], WEB, External("hub", "52.1.2.3"), 443)
    assert not allowed([egress], WEB, External("api", "10.0.0.1"), 443)
    assert not allowed([egress], WEB, External("hub", "52.1.2.3"), 80)
    assert not allowed([egress], WEB, MONITOR, 443)  # a pod is not an ipBlock peer here


def test_the_node_and_the_pod_itself_are_always_allowed() -> None:
    assert allowed([DENY_ALL_INGRESS], Node(), WEB, 8080)
    assert allowed([policy("shop", {}, policyTypes=["Egress"])], WEB, Node(), 10250)
    assert allowed([DENY_ALL_INGRESS], WEB, WEB, 8080)


def test_policies_of_other_namespaces_do_not_apply() -> None:
    assert allowed([policy("blog", {}, policyTypes=["Ingress", "Egress"])], INTERNET, WEB, 8080)


@pytest.mark.parametrize(("expr", "labels", "expected"), [
    ({"key": "a", "operator": "In", "values": ["1", "2"]}, {"a": "2"}, True),
    ({"key": "a", "operator": "In", "values": ["1"]}, {}, False),
    ({"key": "a", "operator": "NotIn", "values": ["1"]}, {}, True),
    ({"key": "a", "operator": "NotIn", "values": ["1"]}, {"a": "1"}, False),
    ({"key": "a", "operator": "Exists"}, {"a": ""}, True),
    ({"key": "a", "operator": "DoesNotExist"}, {"a": "x"}, False),
])
def test_match_expressions(expr: dict[str, Any], labels: dict[str, str], expected: bool) -> None:
    assert selector_matches({"matchExpressions": [expr]}, labels) is expected
    assert selector_matches({"matchLabels": {"b": "1"}, "matchExpressions": [expr]}, labels) is False


def test_pods_from_templates_carry_labels_named_ports_and_the_namespace_name_label() -> None:
    pod = pod_from_template("p", "ns", {"metadata": {"labels": {"x": "y"}}, "spec": {"containers": [
        {"name": "c", "ports": [{"name": "grpc", "containerPort": 50051}, {"containerPort": 1}]}]}})
    assert pod.ports == {"grpc": (50051, "TCP")} and pod.labels == {"x": "y"}
    assert pod.namespace_labels == {"kubernetes.io/metadata.name": "ns"}
