"""Pure status computation and the drift check."""

from __future__ import annotations

from typing import Any

from minedraft.operator import spec as s
from minedraft.operator import status as st
from minedraft.operator.reconcile import is_subset

SPEC = s.parse_spec({"target": {"source": {"image": {"path": "/t"}}}, "draft": {"source": {"image": {"path": "/d"}}},
                     "replicas": 2})
META = s.ObjectMeta(name="md", namespace="ns", uid="u", generation=3)
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def deployment(replicas: int, ready: int, updated: int | None = None, generation: int = 1,
               observed: int = 1) -> st.DeploymentState:
    return st.DeploymentState(replicas, ready, replicas if updated is None else updated, generation, observed)


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_nothing_created_yet_is_pending() -> None:
    status = st.compute_status(st.Observed(3, SPEC, META), T0)
    assert status["phase"] == "Pending"
    c = conditions(status)
    assert c["Ready"]["status"] == "False" and c["EngineReady"]["reason"] == "NotCreated"
    assert all(x["observedGeneration"] == 3 for x in status["conditions"])
    assert status["replicas"] == 2 and status["readyReplicas"] == 0 and status["ready"] == "0/2"
    assert status["selector"] == "minedraft.io/instance=md,minedraft.io/component=engine"
    assert status["endpoint"] == "md-gateway.ns.svc:50051"
    assert list(c) == list(st.CONDITION_ORDER)


def test_ready_when_engines_and_gateway_are() -> None:
    status = st.compute_status(st.Observed(3, SPEC, META, engine=deployment(2, 2), gateway=deployment(2, 2)), T0)
    c = conditions(status)
    assert status["phase"] == "Ready" and c["Ready"]["status"] == "True" and c["Ready"]["reason"] == "Serving"
    assert c["ScalingReady"]["reason"] == "FixedReplicas" and c["MetricsAvailable"]["status"] == "Unknown"
    assert status["ready"] == "2/2"


def test_rolling_out_and_partially_ready() -> None:
    rolling = st.compute_status(st.Observed(3, SPEC, META, engine=deployment(2, 2, generation=2, observed=1),
                                            gateway=deployment(2, 2)), T0)
    assert conditions(rolling)["EngineReady"]["reason"] == "RollingOut" and rolling["phase"] == "Progressing"
    partial = st.compute_status(st.Observed(3, SPEC, META, engine=deployment(2, 1), gateway=deployment(2, 2)), T0)
    ready = conditions(partial)["Ready"]
    assert ready["reason"] == "ReplicasNotReady" and ready["message"] == "1/2 engine replicas ready"


def test_problems_fail_with_their_reason() -> None:
    problem = st.Problem("SecretNotFound", "spec.gateway.authTokenSecretRef: Secret 'x' not found in namespace ns")
    status = st.compute_status(st.Observed(3, SPEC, META, problems=(problem,)), T0)
    c = conditions(status)
    assert status["phase"] == "Failed"
    assert c["Ready"]["reason"] == "SecretNotFound" and "authTokenSecretRef" in c["Ready"]["message"]
    invalid = st.compute_status(st.Observed(1, None, None, problems=(st.Problem("InvalidSpec", "spec.x: bad"),)), T0)
    assert conditions(invalid)["Ready"]["reason"] == "InvalidSpec"


def test_autoscaling_and_metrics_conditions() -> None:
    spec = s.parse_spec({"target": {"source": {"image": {"path": "/t"}}},
                         "draft": {"source": {"image": {"path": "/d"}}}, "autoscaling": {"maxReplicas": 5}})
    figures = st.SpeculationFigures(acceptance_rate=0.61234, overlap=0.9, modes=("psd",))
    status = st.compute_status(st.Observed(1, spec, META, speculation=figures), T0)
    c = conditions(status)
    assert c["ScalingReady"]["status"] == "Unknown" and "1..5" in c["ScalingReady"]["message"]
    assert c["MetricsAvailable"]["status"] == "True"
    assert status["speculation"] == {"acceptanceRate": 0.6123, "overlap": 0.9, "modes": ["psd"]}


def test_recomputing_the_same_observation_changes_nothing() -> None:
    observed = st.Observed(3, SPEC, META, engine=deployment(2, 1), gateway=deployment(2, 2))
    first = st.compute_status(observed, T0)
    again = st.compute_status(st.Observed(3, SPEC, META, engine=deployment(2, 1), gateway=deployment(2, 2),
                                          previous_conditions=first["conditions"]), T1)
    assert again == first  # lastTransitionTime kept: nothing to write, no Event
    assert not st.status_changed(first, again)
    assert st.condition_changes(first["conditions"], again["conditions"]) == []
    # A real transition gets the new time and is reported once.
    became_ready = st.compute_status(st.Observed(3, SPEC, META, engine=deployment(2, 2), gateway=deployment(2, 2),
                                                 previous_conditions=first["conditions"]), T1)
    changes = st.condition_changes(first["conditions"], became_ready["conditions"])
    assert {c["type"] for c in changes} == {"Ready", "EngineReady"}
    assert all(c["lastTransitionTime"] == T1 for c in changes)
    assert st.status_changed(first, became_ready)


def test_drift_check_ignores_server_defaults_and_canonical_quantities() -> None:
    desired = {"spec": {"replicas": 2, "template": {"containers": [{"name": "c", "resources": {"requests": {
        "cpu": "0.5", "memory": "1Gi"}}}]}}}
    observed = {"metadata": {"uid": "x"}, "status": {}, "spec": {"replicas": 2, "revisionHistoryLimit": 10,
                "template": {"containers": [{"name": "c", "terminationMessagePath": "/dev/termination-log",
                                             "resources": {"requests": {"cpu": "500m", "memory": "1024Mi"}}}]}}}
    assert is_subset(desired, observed)
    assert not is_subset({"spec": {"replicas": 3}}, observed)
    assert not is_subset({"spec": {"template": {"containers": [{"name": "c"}, {"name": "d"}]}}}, observed)
    assert not is_subset({"spec": {"template": {"containers": [{"name": "c", "resources": {"requests": {
        "cpu": "1"}}}]}}}, observed)
    assert not is_subset({"a": "x"}, {"a": "y"}) and is_subset({"a": []}, {"a": []})


def test_monitoring_is_detected_again_after_start() -> None:
    """Issue 30: with --monitoring auto, a discovery call that failed at start (or a Prometheus operator installed
    later) is checked again on the drift passes, and PodMonitors are rendered from then on."""
    import asyncio

    from minedraft.operator.handlers import refresh_monitoring
    from minedraft.operator.kube import KubeError
    from minedraft.operator.metrics import OperatorMetrics
    from minedraft.operator.reconcile import Reconciler
    from minedraft.operator.settings import OperatorSettings

    answers: list[bool | Exception] = [KubeError(503, "GET", "/apis/monitoring.coreos.com/v1", "unavailable"),
                                       False, True, False]

    class Client:
        async def has_api(self, group: str, version: str, plural: str) -> bool:
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    settings = OperatorSettings(monitoring="auto")
    reconciler = Reconciler(Client(), settings.render_options(False), OperatorMetrics())  # type: ignore[arg-type]
    seen = []
    for _ in range(4):
        asyncio.run(refresh_monitoring(settings, reconciler))
        seen.append(reconciler.options.monitoring)
    assert seen == [False, False, True, False]
    assert answers == []
    off = OperatorSettings(monitoring="off")
    assert asyncio.run(refresh_monitoring(off, Reconciler(Client(), off.render_options(False),  # type: ignore[arg-type]
                                                          OperatorMetrics()))) is False


POOL_SPEC = s.parse_spec({"target": {"source": {"image": {"path": "/t"}}},
                          "draft": {"source": {"image": {"path": "/d"}}}, "replicas": 2, "speculation": {"mode": "psd"},
                          "drafterPool": {"tokenSecretRef": {"name": "tok"}, "replicas": 2}})


def test_a_drafter_pool_gets_a_readiness_condition_of_its_own_apart_from_ready() -> None:
    serving = {"engine": deployment(2, 2), "gateway": deployment(2, 2)}
    c = conditions(st.compute_status(st.Observed(3, POOL_SPEC, META, **serving), T0))
    assert c["DrafterPoolReady"]["status"] == "False" and c["DrafterPoolReady"]["reason"] == "NotCreated"
    # Engines whose pool is not ready still serve (without drafts): Ready does not wait for the pool.
    assert c["Ready"]["status"] == "True"
    c = conditions(st.compute_status(st.Observed(3, POOL_SPEC, META, drafter=deployment(2, 1), **serving), T0))
    assert (c["DrafterPoolReady"]["reason"], c["DrafterPoolReady"]["message"]) == (
        "ReplicasNotReady", "1/2 drafter pool replicas ready")
    c = conditions(st.compute_status(st.Observed(3, POOL_SPEC, META, drafter=deployment(2, 2), **serving), T0))
    assert c["DrafterPoolReady"]["status"] == "True"
    assert c["DrafterPoolReady"]["message"] == ("2/2 drafter pool replicas ready; dtype auto: the draft's 16-bit dtype "
                                                "on its GPU, 1024 requests held per pod")
    # Without a pool there is no such condition.
    assert "DrafterPoolReady" not in conditions(st.compute_status(st.Observed(3, SPEC, META, **serving), T0))


def test_an_idle_minedraft_scaled_to_zero_is_idle_not_failed() -> None:
    """The autoscaler scaled it to zero (minReplicas 0): Ready stays True (reason Idle, phase Idle) while the gateway
    is ready to wake an engine; the same zero without scale to zero (fixed replicas 0) is not ready."""
    models = {"target": {"source": {"image": {"path": "/t"}}}, "draft": {"source": {"image": {"path": "/d"}}}}
    spec = s.parse_spec({**models, "replicas": 0, "autoscaling": {"minReplicas": 0, "maxReplicas": 2}})
    assert spec.desired_replicas == 0
    status = st.compute_status(st.Observed(3, spec, META, engine=deployment(0, 0), gateway=deployment(2, 2)), T0)
    c = conditions(status)
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("True", "Idle")
    assert (c["EngineReady"]["status"], c["EngineReady"]["reason"]) == ("True", "ScaledToZero")
    assert status["phase"] == "Idle" and status["ready"] == "0/0"
    # A gateway that is down is still an outage.
    down = conditions(st.compute_status(st.Observed(3, spec, META, engine=deployment(0, 0),
                                                    gateway=deployment(2, 0)), T0))
    assert down["Ready"]["status"] == "False"
    fixed = s.parse_spec({**models, "replicas": 0})
    c = conditions(st.compute_status(st.Observed(3, fixed, META, engine=deployment(0, 0), gateway=deployment(2, 2)),
                                     T0))
    assert c["Ready"]["status"] == "False"
