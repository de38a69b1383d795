"""Autoscaling the shared drafter pool on its own utilisation, apart from the engines: the pure policy, the figures
it reads from Prometheus, the spec/CRD fields (errors naming them), the rendered replicas, and the loop's evaluation
(Prometheus answered by a stand-in: no I/O)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from minedraft.operator import render
from minedraft.operator import spec as s
from minedraft.operator.autoscale import observe
from minedraft.operator.autoscale.drafter_pool import (
    PoolObservation,
    PoolPolicy,
    decide_pool,
    observation_from_prometheus,
    pool_queries,
)
from minedraft.operator.autoscale.loop import Autoscaler, pool_status

from .test_crd import admit
from .test_drafter_pool import with_spec

POLICY = PoolPolicy(min_replicas=1, max_replicas=6, target_utilization=0.7, scale_down_stabilization_seconds=300)


def test_a_busy_pool_scales_up_at_once_to_bring_its_busy_share_to_the_target():
    # Two replicas drafting 1.9 replicas' worth: 0.95 each; ceil(1.9 / 0.7) = 3.
    decision = decide_pool(POLICY, 2, PoolObservation(drafting_replicas=1.9), None, 1000.0)
    assert (decision.desired, decision.metrics_available, decision.utilization) == (3, True, 0.95)
    saturated = decide_pool(POLICY, 5, PoolObservation(drafting_replicas=5.0), None, 1000.0)
    assert saturated.desired == 6 and "maxReplicas 6" in saturated.reason  # ceil(7.1) bounded by the maximum


def test_a_pool_near_its_target_holds():
    assert decide_pool(POLICY, 2, PoolObservation(drafting_replicas=1.45), None, 1000.0).desired == 2


def test_busy_answers_at_the_target_add_one_replica():
    decision = decide_pool(POLICY, 2, PoolObservation(drafting_replicas=1.45, busy_per_second=3.0), None, 1000.0)
    assert decision.desired == 3 and "answered busy" in decision.reason


def test_an_idle_pool_scales_down_one_replica_at_a_time_after_the_stabilisation_window():
    idle = PoolObservation(drafting_replicas=0.2)
    assert decide_pool(POLICY, 4, idle, None, 1000.0).desired == 3
    held = decide_pool(POLICY, 4, idle, 900.0, 1000.0)  # scaled up 100 s ago
    assert held.desired == 4 and "100 s ago" in held.reason
    # One fewer must stay under the target: 1.3 replicas' worth on 2 would be 1.3 on 1, above it.
    assert decide_pool(POLICY, 2, PoolObservation(drafting_replicas=1.3), None, 1000.0).desired == 2
    assert decide_pool(POLICY, 1, PoolObservation(drafting_replicas=0.0), None, 1000.0).desired == 1


def test_time_on_lookaheads_extra_branches_is_not_planned_for():
    # One replica drafting 0.89 of its time, 0.65 of it on a lookahead engine's extra branches (the twin's figures
    # for one engine at 32 requests): its demand is the 0.24 left, under the target; counted whole it would scale up.
    alone = PoolObservation(drafting_replicas=0.89, optional_replicas=0.65)
    decision = decide_pool(POLICY, 1, alone, None, 1000.0)
    assert decision.desired == 1 and decision.utilization == 0.24
    assert "not counting 0.65 on lookahead's extra branches" in decision.reason
    assert decide_pool(POLICY, 1, PoolObservation(drafting_replicas=0.89), None, 1000.0).desired == 2
    # Nor does it hold replicas up: two replicas whose required work fits one (0.5 < 0.7 * 0.9) lose one.
    assert decide_pool(POLICY, 2, PoolObservation(drafting_replicas=1.6, optional_replicas=1.1), None,
                       1000.0).desired == 1
    # Required work above the target still scales up, whatever the optional part.
    assert decide_pool(POLICY, 1, PoolObservation(drafting_replicas=1.0, optional_replicas=0.1), None,
                       1000.0).desired == 2


def test_without_metrics_the_pool_holds_within_its_bounds():
    decision = decide_pool(POLICY, 9, None, None, 1000.0)
    assert (decision.desired, decision.metrics_available) == (6, False)
    assert decide_pool(POLICY, 2, None, None, 1000.0).desired == 2


def test_bad_policies_name_the_field():
    with pytest.raises(ValueError, match=r"drafterPool\.minReplicas"):
        PoolPolicy(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match=r"drafterPool\.targetUtilization"):
        PoolPolicy(min_replicas=1, max_replicas=2, target_utilization=0.0)


def test_the_pool_figures_from_prometheus():
    assert observation_from_prometheus({"drafting_replicas": [], "busy_per_second": []}) is None
    figures = observation_from_prometheus({"drafting_replicas": [{"metric": {}, "value": [1.0, "1.25"]}],
                                           "busy_per_second": [{"metric": {}, "value": [1.0, "0.5"]}]})
    assert figures == PoolObservation(drafting_replicas=1.25, busy_per_second=0.5)
    with_optional = observation_from_prometheus({"drafting_replicas": [{"metric": {}, "value": [1.0, "1.25"]}],
                                                 "optional_replicas": [{"metric": {}, "value": [1.0, "0.75"]}]})
    assert with_optional is not None and with_optional.required_replicas == 0.5
    # (Never more optional than drafting: the two rates are read a moment apart.)
    capped = observation_from_prometheus({"drafting_replicas": [{"metric": {}, "value": [1.0, "0.5"]}],
                                          "optional_replicas": [{"metric": {}, "value": [1.0, "0.6"]}]})
    assert capped is not None and capped.required_replicas == 0.0
    assert observation_from_prometheus({"drafting_replicas": [{"metric": {}, "value": [1.0, "NaN"]}]}) is None


def test_the_queries_select_only_the_pools_scrape_job():
    query = pool_queries("serving", "pool-drafter")["drafting_replicas"]
    assert 'namespace=~"serving|"' in query and "minedraft_drafter_drafting_seconds_total" in query
    pattern = re.search(r'job=~"([^"]+)"', query)
    assert pattern is not None
    # PromQL regexes match whole values: the PodMonitor's job, or a plain scrape job named after the Deployment.
    assert re.fullmatch(pattern.group(1), "serving/pool-drafter")
    assert re.fullmatch(pattern.group(1), "pool-drafter")
    assert not re.fullmatch(pattern.group(1), "serving/pool-engine")
    assert not re.fullmatch(pattern.group(1), "serving/other-pool-drafter")
    optional = pool_queries("serving", "pool-drafter")["optional_replicas"]
    assert "minedraft_drafter_optional_drafting_seconds_total" in optional and pattern.group(1) in optional


def drafter_deployment(doc: dict[str, Any]) -> dict[str, Any]:
    (deployment,) = [m for m in render.render_resource(doc)
                     if m["kind"] == "Deployment" and m["metadata"]["name"].endswith("-drafter")]
    return deployment


# -- spec, CRD, render ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("changes", "error"), [
    ({"drafterPool__minReplicas": 2}, "spec.drafterPool.maxReplicas: autoscaling the pool needs both"),
    ({"drafterPool__minReplicas": 3, "drafterPool__maxReplicas": 2}, "spec.drafterPool.minReplicas: must not exceed"),
    ({"drafterPool__minReplicas": 1, "drafterPool__maxReplicas": 2, "drafterPool__targetUtilization": 1.5},
     "spec.drafterPool.targetUtilization: must be a number in (0, 1]"),
], ids=["min-without-max", "min-above-max", "utilization"])
def test_bad_pool_bounds_are_refused_naming_the_field(changes: dict[str, Any], error: str):
    with pytest.raises(s.SpecError) as exc:
        s.parse_spec(with_spec("pool", **changes)["spec"])
    assert any(e.startswith(error) for e in exc.value.errors), exc.value.errors


@pytest.mark.parametrize(("changes", "message"), [
    ({"drafterPool__maxReplicas": 2}, "spec.drafterPool.minReplicas: drafterPool.minReplicas and "
                                      "drafterPool.maxReplicas go together"),
    ({"drafterPool__minReplicas": 3, "drafterPool__maxReplicas": 2},
     "spec.drafterPool.minReplicas: drafterPool.minReplicas must not exceed drafterPool.maxReplicas"),
], ids=["max-without-min", "min-above-max"])
def test_the_crd_refuses_bad_pool_bounds_at_admission_naming_the_field(changes: dict[str, Any], message: str):
    found = admit(with_spec("pool", **changes))
    assert any(f.startswith(message) for f in found), found


def test_an_autoscaled_pool_is_admitted_and_renders_its_replicas_within_the_bounds():
    doc = with_spec("pool", drafterPool__minReplicas=2, drafterPool__maxReplicas=4, drafterPool__replicas=1)
    assert admit(doc) == []
    spec = s.parse_spec(doc["spec"])
    assert spec.drafter_pool is not None and spec.drafter_pool.autoscaled
    assert drafter_deployment(doc)["spec"]["replicas"] == 2  # replicas 1 clamped up to minReplicas
    assert drafter_deployment(with_spec("pool", drafterPool__replicas=3))["spec"]["replicas"] == 3


# -- the loop --------------------------------------------------------------------------------------------------------


async def _no_addresses(namespace: str, service: str) -> list[str]:
    return []


def test_the_loop_scales_the_pool_from_prometheus_apart_from_the_engines(monkeypatch: pytest.MonkeyPatch):
    doc = with_spec("pool", drafterPool__minReplicas=1, drafterPool__maxReplicas=4, drafterPool__replicas=2)
    spec, meta = s.parse_spec(doc["spec"]), s.parse_meta(doc["metadata"])
    assert spec.autoscaling is None  # the engines are not autoscaled: the pool still is
    asked: list[tuple[str, str, str]] = []

    async def busy_pool(session: Any, address: str, namespace: str, deployment: str) -> PoolObservation:
        asked.append((address, namespace, deployment))
        return PoolObservation(drafting_replicas=1.9)

    monkeypatch.setattr(observe, "query_drafter_pool", busy_pool)
    autoscaler = Autoscaler("http://prometheus:9090", _no_addresses)
    assert autoscaler.pool_due(spec, meta, 1000.0)
    decision = asyncio.run(autoscaler.evaluate_pool(None, spec, meta, 1000.0))
    assert (decision.current, decision.desired) == (2, 3)
    assert asked == [("http://prometheus:9090", "serving", "qwen3-8b-drafter")]
    assert not autoscaler.pool_due(spec, meta, 1010.0) and autoscaler.pool_due(spec, meta, 1030.0)
    assert pool_status(decision) == {"desiredReplicas": 3, "metricsAvailable": True, "utilization": 0.95,
                                     "message": decision.reason}
    # A pool without bounds is not the autoscaler's.
    fixed = s.parse_spec(with_spec("pool")["spec"])
    assert not autoscaler.pool_due(fixed, meta, 2000.0)


def test_without_prometheus_the_pool_holds_and_says_why():
    doc = with_spec("pool", drafterPool__minReplicas=1, drafterPool__maxReplicas=4, drafterPool__replicas=2)
    spec, meta = s.parse_spec(doc["spec"]), s.parse_meta(doc["metadata"])
    decision = asyncio.run(Autoscaler(None, _no_addresses).evaluate_pool(None, spec, meta, 1000.0))
    assert (decision.desired, decision.metrics_available) == (2, False) and "no Prometheus" in decision.reason
