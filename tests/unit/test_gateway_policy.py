"""The gateway's pure parts: endpoint set, P2C routing, admission, retry classification, tokens, discovery parsing."""

import random
from collections import Counter

import grpc
import pytest

from minedraft.api.auth import bearer_token, parse_tokens, token_accepted
from minedraft.gateway.discovery import SliceTracker, addresses_from_slice, parse_engines, parse_service
from minedraft.gateway.policy import (
    Admission,
    EndpointSet,
    EndpointState,
    FailureAction,
    choose_two,
    classify_failure,
    pick,
)


def healthy_set(*addresses: str) -> EndpointSet:
    endpoints = EndpointSet()
    endpoints.replace(addresses)
    for address in addresses:
        endpoints.set_healthy(address, True)
    return endpoints


def test_replace_keeps_state_of_known_endpoints():
    endpoints = healthy_set("a:1", "b:1")
    endpoints.acquire("a:1")
    added, removed = endpoints.replace(["a:1", "c:1"])
    assert (added, removed) == ({"c:1"}, {"b:1"})
    a = endpoints.get("a:1")
    assert a is not None and a.healthy and a.outstanding == 1
    c = endpoints.get("c:1")
    assert c is not None and not c.healthy, "a new endpoint is not ready until its health check says so"
    assert endpoints.set_healthy("b:1", True) is False, "late health report of a removed endpoint is ignored"
    endpoints.release("b:1")  # a stream finishing on a removed endpoint: no error


def test_p2c_never_picks_the_more_loaded_of_two():
    a, b = EndpointState("a", True, outstanding=5), EndpointState("b", True, outstanding=1)
    rng = random.Random(0)
    assert all(choose_two([a, b], rng) is b for _ in range(50))


def test_p2c_spreads_load_and_avoids_the_busiest():
    endpoints = healthy_set("a:1", "b:1", "c:1", "d:1")
    rng = random.Random(1)
    for _ in range(400):  # streams that never finish: outstanding counts only grow
        chosen = pick(endpoints, rng, now_seconds=0.0)
        assert chosen is not None
        endpoints.acquire(chosen.address)
    loads = sorted(e.outstanding for e in endpoints)
    assert loads[-1] - loads[0] <= 3, loads
    busy = healthy_set("a:1", "b:1", "c:1")
    for _ in range(100):
        busy.acquire("a:1")
    picks = Counter(pick(busy, rng, 0.0).address for _ in range(300))  # type: ignore[union-attr]
    assert picks["a:1"] == 0, "P2C always has a less loaded alternative to a"


def test_pick_skips_unhealthy_excluded_and_cooling_down():
    endpoints = healthy_set("a:1", "b:1", "c:1")
    endpoints.set_healthy("a:1", False)
    endpoints.cool_down("b:1", until_seconds=10.0)
    rng = random.Random(2)
    assert {pick(endpoints, rng, 5.0).address for _ in range(20)} == {"c:1"}  # type: ignore[union-attr]
    assert pick(endpoints, rng, 5.0, exclude={"c:1"}) is None
    assert pick(endpoints, rng, 10.0, exclude={"c:1"}).address == "b:1"  # type: ignore[union-attr]
    assert choose_two([], rng) is None


def test_admission_is_bounded_and_never_negative():
    admission = Admission(2)
    assert admission.try_acquire() and admission.try_acquire()
    assert not admission.try_acquire()
    admission.release()
    assert admission.try_acquire()
    for _ in range(5):
        admission.release()
    assert admission.in_flight == 0
    with pytest.raises(ValueError, match="max_in_flight"):
        Admission(0)


@pytest.mark.parametrize(("code", "sent", "action"), [
    (grpc.StatusCode.UNAVAILABLE, 0, FailureAction.RETRY),
    # An error a request caused is that request's answer: not retried (it would fail on, and bench, every engine).
    (grpc.StatusCode.INTERNAL, 0, FailureAction.PASS_THROUGH),
    (grpc.StatusCode.UNKNOWN, 0, FailureAction.PASS_THROUGH),
    (grpc.StatusCode.INVALID_ARGUMENT, 0, FailureAction.PASS_THROUGH),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 0, FailureAction.PASS_THROUGH),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 0, FailureAction.PASS_THROUGH),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 3, FailureAction.PASS_THROUGH),
    (grpc.StatusCode.CANCELLED, 3, FailureAction.PASS_THROUGH),
    (grpc.StatusCode.UNAVAILABLE, 1, FailureAction.UNAVAILABLE_AFTER_TOKENS),
    (grpc.StatusCode.INTERNAL, 7, FailureAction.PASS_THROUGH),
    # An engine refusing the gateway's own credential (the caller's is never forwarded): that engine's failure.
    (grpc.StatusCode.UNAUTHENTICATED, 0, FailureAction.CREDENTIAL_REFUSED),
])
def test_retry_only_before_the_first_response(code, sent, action):
    assert classify_failure(code, sent) is action


def test_bearer_tokens():
    tokens = parse_tokens("# comment\nsecret-one\n\n second,third \n")
    assert tokens == (b"secret-one", b"second,third")
    # A token is kept whole: a # or , inside it is part of it (it was cut at the #, split at the comma).
    assert parse_tokens("abc#def\n  # a comment\nx,y\n") == (b"abc#def", b"x,y")
    assert parse_tokens(" a#1 , b ,,", comma_separated=True) == (b"a#1", b"b")
    for bad in ("two words\n", "tab\there\n"):
        with pytest.raises(ValueError, match="line 1"):
            parse_tokens(bad)
    tokens = parse_tokens("secret-one\nsecond\nthird\n")
    assert token_accepted(bearer_token([("authorization", "Bearer third")]), tokens)
    assert token_accepted(bearer_token([("Authorization", b"bearer secret-one")]), tokens)
    assert not token_accepted(bearer_token([("authorization", "Bearer secret")]), tokens)
    assert not token_accepted(bearer_token([("authorization", "Basic secret-one")]), tokens)
    assert not token_accepted(bearer_token([("x-other", "Bearer third")]), tokens)
    assert not token_accepted("anything", ())


def _slice(name: str, service: str, endpoints: list, ports: list) -> dict:
    return {"metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
            "endpoints": endpoints, "ports": ports}


def test_addresses_from_slice_ready_only_and_named_port():
    s = _slice("s", "eng", [
        {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
        {"addresses": ["10.0.0.2"], "conditions": {"ready": False, "terminating": True}},
        {"addresses": ["10.0.0.3"]},  # ready unset means ready
        {"addresses": ["fd00::4"], "conditions": {"ready": True}},
    ], [{"name": "metrics", "port": 9400}, {"name": "grpc", "port": 50051}])
    assert addresses_from_slice(s, "grpc") == {"10.0.0.1:50051", "10.0.0.3:50051", "[fd00::4]:50051"}
    assert addresses_from_slice(s, "nope") == set(), "two ports and none named: no guess"
    single = _slice("s", "eng", [{"addresses": ["10.0.0.1"]}], [{"name": "x", "port": 1}])
    assert addresses_from_slice(single, "grpc") == {"10.0.0.1:1"}


def test_slice_tracker_unions_slices_and_ignores_other_services():
    tracker = SliceTracker("eng", "grpc")
    port = [{"name": "grpc", "port": 5}]
    tracker.reset([_slice("a", "eng", [{"addresses": ["1.1.1.1"]}], port),
                   _slice("x", "other", [{"addresses": ["9.9.9.9"]}], port)])
    assert tracker.addresses == {"1.1.1.1:5"}
    assert tracker.apply({"type": "ADDED", "object": _slice("b", "eng", [{"addresses": ["2.2.2.2"]}], port)})
    assert not tracker.apply({"type": "ADDED", "object": _slice("y", "other", [{"addresses": ["8.8.8.8"]}], port)})
    assert tracker.addresses == {"1.1.1.1:5", "2.2.2.2:5"}
    assert not tracker.apply({"type": "MODIFIED", "object": _slice("b", "eng", [{"addresses": ["2.2.2.2"]}], port)})
    assert tracker.apply({"type": "DELETED", "object": _slice("a", "eng", [], port)})
    assert tracker.addresses == {"2.2.2.2:5"}
    assert not tracker.apply({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "7"}}})


def test_parse_engines_and_service():
    assert parse_engines("a:1, b:2,") == ["a:1", "b:2"]
    with pytest.raises(ValueError, match="host:port"):
        parse_engines("a:1,b")
    assert parse_service("ns/name") == ("ns", "name")
    for bad in ("name", "/name", "ns/", "a/b/c"):
        with pytest.raises(ValueError, match="NAMESPACE/NAME"):
            parse_service(bad)
