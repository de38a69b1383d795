"""One autoscaling evaluation for one MineDraft: observe, decide, and say what to write (scale, status, events).

The kopf timer (handlers.py) calls `Autoscaler.evaluate` every tick; it acts only when the MineDraft's
`intervalSeconds` have passed — except at zero replicas, where every tick is due: then the only signal is the
gateway's `minedraft_gateway_streams_waiting` (streams held at the gateway until an engine is ready), read from
Prometheus or scraped from the gateway pods, and one waiting stream scales to one replica at once (a stream's wait
is then a tick plus a replica's startup, not an interval more). Between evaluations, every tick also reads the
engines' waiting requests (one Prometheus query, or a scrape of the engine pods) and evaluates at once when they grew
since the last evaluation (`should_evaluate`, the trigger `policy.evaluate_early`): a queue that builds between two
evaluations is seen at the next tick, not at the next interval.

Per-MineDraft memory (policy state, the previous direct scrape) lives in the
Autoscaler object held in the operator's memo, not at module level.
"""

from __future__ import annotations

import datetime
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from minedraft.operator import render
from minedraft.operator import spec as s
from minedraft.operator.autoscale import observe
from minedraft.operator.autoscale.drafter_pool import PoolDecision, PoolPolicy, decide_pool
from minedraft.operator.autoscale.policy import (
    Decision,
    Observations,
    PolicyConfig,
    PolicyState,
    decide,
    evaluate_early,
    wake_from_zero,
)

# Replica changes kept in status.scaling.decisions (oldest dropped first).
MAX_RECORDED_DECISIONS = 10
# The drafter pool's evaluation interval when the MineDraft's engines are not autoscaled (else theirs).
POOL_INTERVAL_SECONDS = 30


def policy_config(spec: s.MineDraftSpec) -> PolicyConfig:
    a = spec.autoscaling
    assert a is not None
    return PolicyConfig(min_replicas=a.min_replicas, max_replicas=a.max_replicas,
                        target_utilization=a.target_utilization, interval_seconds=a.interval_seconds,
                        scale_down_stabilization_seconds=a.scale_down_stabilization_seconds,
                        max_scale_up_step=a.max_scale_up_step, requests_per_replica=spec.engine.max_num_seqs,
                        # Three missed evaluations, or a minute of Prometheus lag, whichever is longer.
                        max_metrics_age_seconds=max(3 * a.interval_seconds, 60),
                        prior_capacity_tokens_per_second_per_replica=a.replica_capacity_tokens_per_second)


def _rfc3339(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _reason_code(decision: Decision, unavailable: observe.MetricsUnavailable | None) -> str:
    if unavailable is not None:
        return unavailable.reason
    if not decision.metrics_available:
        return "MetricsStale" if "old" in decision.reason else "NoEngineMetrics"
    if decision.desired > decision.current:
        return "ScaledUp"
    if decision.desired < decision.current:
        return "ScaledDown"
    return "Steady"


def scaling_status(previous: Mapping[str, Any] | None, decision: Decision, reason: str, now_seconds: float,
                   observations: Observations | None) -> dict[str, Any]:
    """status.scaling after this evaluation: the last evaluation's figures and the last replica changes."""
    decisions = list((previous or {}).get("decisions") or [])
    if decision.changed:
        decisions.append({"time": _rfc3339(now_seconds), "from": decision.current, "to": decision.desired,
                          "reason": decision.reason,
                          "inputs": asdict(decision.inputs) if decision.inputs is not None else {}})
    status: dict[str, Any] = {
        "metricsAvailable": decision.metrics_available, "reason": reason, "message": decision.reason,
        # No evaluation time: an evaluation that changes nothing must not rewrite the status (and bump the
        # resourceVersion) every interval; decisions carry their time.
        "desiredReplicas": decision.desired,
        "decisions": decisions[-MAX_RECORDED_DECISIONS:],
    }
    if decision.inputs is not None:
        status["recommendedReplicas"] = decision.inputs.recommended
        status["capacityTokensPerSecondPerReplica"] = decision.inputs.capacity_tokens_per_second_per_replica
        status["demandTokensPerSecond"] = decision.inputs.demand_tokens_per_second
    return status


def speculation_status(observations: Observations | None) -> dict[str, Any] | None:
    if observations is None or observations.speculation.acceptance_rate is None:
        return None
    sp = observations.speculation
    out: dict[str, Any] = {"acceptanceRate": round(sp.acceptance_rate or 0.0, 4)}
    if sp.overlap_fraction is not None:
        out["overlap"] = round(sp.overlap_fraction, 4)
    if sp.mean_accepted_length is not None:
        out["meanAcceptedLength"] = round(sp.mean_accepted_length, 4)
    if sp.modes:
        out["modes"] = list(sp.modes)
    return out


@dataclass
class Evaluation:
    """What one evaluation decided; the handler writes it."""

    decision: Decision
    scaling: dict[str, Any]
    speculation: dict[str, Any] | None
    observations: Observations | None


@dataclass
class _Memory:
    state: PolicyState = field(default_factory=PolicyState)
    last_evaluation_seconds: float | None = None
    scrapes: dict[str, observe.Scrape] = field(default_factory=dict)
    # The last evaluation found zero replicas and left them so: every tick is due (the gateway is polled).
    at_zero: bool = False
    # The engines' waiting requests at the last evaluation with metrics: the fast path triggers when they grow.
    last_waiting: float | None = None
    # When the last scale-up was decided: no early evaluation within an interval of it (the step is per interval).
    last_scale_up_seconds: float | None = None


@dataclass
class _PoolMemory:
    last_evaluation_seconds: float | None = None
    last_scale_up_seconds: float | None = None


def pool_policy(spec: s.MineDraftSpec) -> PoolPolicy:
    pool = spec.drafter_pool
    assert pool is not None and pool.min_replicas is not None and pool.max_replicas is not None
    stabilization = (spec.autoscaling.scale_down_stabilization_seconds if spec.autoscaling is not None else 300.0)
    return PoolPolicy(pool.min_replicas, pool.max_replicas, pool.target_utilization, stabilization)


def pool_status(decision: PoolDecision) -> dict[str, Any]:
    """status.drafterPool after an evaluation (no time: an unchanged evaluation rewrites nothing)."""
    out: dict[str, Any] = {"desiredReplicas": decision.desired, "metricsAvailable": decision.metrics_available,
                           "message": decision.reason}
    if decision.utilization is not None:
        out["utilization"] = decision.utilization
    return out


Fetch = Callable[[str, str, float], Awaitable[Observations]]


class Autoscaler:
    """Per-operator: remembers each MineDraft's policy state between evaluations."""

    def __init__(self, default_prometheus: str | None,
                 engine_addresses: Callable[[str, str], Awaitable[list[str]]], tick_seconds: float = 5.0,
                 gateway_addresses: Callable[[str, str], Awaitable[list[str]]] | None = None) -> None:
        self.default_prometheus = default_prometheus
        # The operator's tick: the fast path evaluates early at most once per tick.
        self.tick_seconds = tick_seconds
        # Ready engine pods (only those serve; a loading one has no figures yet), and every gateway pod, ready or
        # not (one that holds streams at zero engines must be heard whatever its readiness says).
        self.engine_addresses = engine_addresses
        self.gateway_addresses = gateway_addresses or engine_addresses
        self._memory: dict[tuple[str, str], _Memory] = {}
        self._pool_memory: dict[tuple[str, str], _PoolMemory] = {}

    def forget(self, namespace: str, name: str) -> None:
        self._memory.pop((namespace, name), None)
        self._pool_memory.pop((namespace, name), None)

    # -- the shared drafter pool, scaled on its own utilisation (apart from the engines) ---------------------------

    def pool_due(self, spec: s.MineDraftSpec, meta: s.ObjectMeta, now_seconds: float) -> bool:
        pool = spec.drafter_pool
        if pool is None or not pool.autoscaled:
            return False
        interval = spec.autoscaling.interval_seconds if spec.autoscaling is not None else POOL_INTERVAL_SECONDS
        last = self._pool_memory.get((meta.namespace, meta.name), _PoolMemory()).last_evaluation_seconds
        return last is None or now_seconds - last >= interval - 0.25

    async def evaluate_pool(self, session: Any, spec: s.MineDraftSpec, meta: s.ObjectMeta, now_seconds: float
                            ) -> PoolDecision:
        """The pool's replicas from its busy share (Prometheus: the MineDraft's own, else the operator's). Without
        Prometheus the pool holds its replicas (its pods are not scraped directly)."""
        pool = spec.drafter_pool
        assert pool is not None
        memory = self._pool_memory.setdefault((meta.namespace, meta.name), _PoolMemory())
        memory.last_evaluation_seconds = now_seconds
        policy = pool_policy(spec)
        address = (spec.autoscaling.prometheus_address if spec.autoscaling is not None else None) \
            or self.default_prometheus
        current = pool.replicas
        if not address:
            decision = decide_pool(policy, current, None, memory.last_scale_up_seconds, now_seconds)
            return PoolDecision(decision.current, decision.desired, "no Prometheus to read the drafter pool's "
                                "utilisation from (autoscaling.prometheusAddress or the operator's): holding", False)
        try:
            observation = await observe.query_drafter_pool(session, address, meta.namespace,
                                                           render.names(meta)["drafter"])
        except observe.MetricsUnavailable as exc:
            decision = decide_pool(policy, current, None, memory.last_scale_up_seconds, now_seconds)
            return PoolDecision(decision.current, decision.desired, str(exc), False)
        decision = decide_pool(policy, current, observation, memory.last_scale_up_seconds, now_seconds)
        if decision.desired > decision.current:
            memory.last_scale_up_seconds = now_seconds
        return decision

    def due(self, namespace: str, name: str, interval_seconds: float, now_seconds: float) -> bool:
        memory = self._memory.get((namespace, name), _Memory())
        if memory.at_zero:
            return True
        last = memory.last_evaluation_seconds
        # A little slack: a timer tick that lands just short of the interval should not wait a whole extra tick.
        return last is None or now_seconds - last >= interval_seconds - 0.25

    async def should_evaluate(self, session: Any, spec: s.MineDraftSpec, meta: s.ObjectMeta, now_seconds: float
                              ) -> bool:
        """Due (interval passed, or at zero), or the engines' waiting requests grew since the last evaluation."""
        assert spec.autoscaling is not None
        if self.due(meta.namespace, meta.name, spec.autoscaling.interval_seconds, now_seconds):
            return True
        memory = self._memory.get((meta.namespace, meta.name))
        if memory is None or memory.last_waiting is None:
            return False
        config = policy_config(spec)
        # Cheap to rule out without I/O: nothing can trigger (at zero, at the maximum, within the gap).
        if not evaluate_early(config, spec.desired_replicas, memory.last_waiting, memory.last_evaluation_seconds,
                              memory.last_waiting + 1, now_seconds, self.tick_seconds,
                              memory.last_scale_up_seconds):
            return False
        try:
            waiting = await self._engines_waiting(session, spec, meta)
        except observe.MetricsUnavailable:
            return False  # the regular evaluation reports unavailable metrics; the fast path just stays quiet
        return evaluate_early(config, spec.desired_replicas, memory.last_waiting, memory.last_evaluation_seconds,
                              waiting, now_seconds, self.tick_seconds, memory.last_scale_up_seconds)

    def _prometheus_address(self, spec: s.MineDraftSpec) -> str | None:
        """The MineDraft's own Prometheus, else the operator's; None: scrape the pods."""
        assert spec.autoscaling is not None
        return spec.autoscaling.prometheus_address or self.default_prometheus

    async def _engines_waiting(self, session: Any, spec: s.MineDraftSpec, meta: s.ObjectMeta) -> float | None:
        assert spec.autoscaling is not None
        engine_service = render.names(meta)["engine"]
        address = self._prometheus_address(spec)
        if address:
            return await observe.query_engines_waiting(session, address, meta.namespace, engine_service)
        # A scrape of its own: the evaluation's rates come from the difference between its own scrapes.
        hosts = await self.engine_addresses(meta.namespace, engine_service)
        scrapes = await observe.scrape_engines(session, [f"{h}:{render.ENGINE_METRICS_PORT}" for h in hosts], 0.0)
        if not scrapes:
            return None
        return sum(x.gauges.get(observe.ENGINE_WAITING_METRIC, 0.0) for x in scrapes.values())

    async def _observe(self, session: Any, spec: s.MineDraftSpec, meta: s.ObjectMeta, memory: _Memory,
                       now_seconds: float) -> Observations:
        assert spec.autoscaling is not None
        engine_service = render.names(meta)["engine"]
        address = self._prometheus_address(spec)
        if address:
            return await observe.query_prometheus(session, address, meta.namespace, engine_service, now_seconds)
        # No Prometheus: scrape each ready engine pod's metrics port (addresses from the engine Service's
        # EndpointSlices); rates come from the difference to the previous scrape.
        hosts = await self.engine_addresses(meta.namespace, engine_service)
        scrapes = await observe.scrape_engines(session, [f"{h}:{render.ENGINE_METRICS_PORT}" for h in hosts],
                                               now_seconds)
        previous, memory.scrapes = memory.scrapes, scrapes
        return observe.observations_from_scrapes(scrapes, previous)

    async def _gateway_waiting(self, session: Any, spec: s.MineDraftSpec, meta: s.ObjectMeta) -> float | None:
        assert spec.autoscaling is not None
        gateway_service = render.names(meta)["gateway"]
        address = self._prometheus_address(spec)
        if address:
            return await observe.query_gateway_waiting(session, address, meta.namespace, gateway_service)
        hosts = await self.gateway_addresses(meta.namespace, gateway_service)
        return await observe.scrape_gateway_waiting(session, [f"{h}:{render.GATEWAY_METRICS_PORT}" for h in hosts])

    async def _evaluate_at_zero(self, session: Any, spec: s.MineDraftSpec, meta: s.ObjectMeta, memory: _Memory,
                                previous_scaling: Mapping[str, Any] | None, now_seconds: float) -> Evaluation:
        unavailable: observe.MetricsUnavailable | None = None
        try:
            waiting = await self._gateway_waiting(session, spec, meta)
        except observe.MetricsUnavailable as exc:
            waiting, unavailable = None, exc
        config = policy_config(spec)
        wake = wake_from_zero(config, 0, waiting)
        if wake is not None:
            decision = wake
            # The idle history before zero must not hold the new replica back nor size it: start afresh, keeping
            # what was learned about the replicas (speed, startup).
            memory.state = PolicyState(speed_samples=memory.state.speed_samples,
                                       startup_seconds=memory.state.startup_seconds,
                                       pending_scale_up=(now_seconds, wake.desired))
        elif unavailable is not None:
            decision = Decision(0, 0, str(unavailable), False)
        elif waiting is None:
            decision = Decision(0, 0, "at zero replicas: the gateway reports no minedraft_gateway_streams_waiting",
                                False)
        else:
            decision = Decision(0, 0, "at zero replicas: no stream waits at the gateway", True)
        memory.at_zero = not decision.changed
        reason = "ScaledUp" if decision.changed else (unavailable.reason if unavailable is not None else
                                                      "Steady" if decision.metrics_available else "NoGatewayMetrics")
        return Evaluation(decision=decision, scaling=scaling_status(previous_scaling, decision, reason, now_seconds,
                                                                    None), speculation=None, observations=None)

    async def evaluate(self, session: Any, spec: s.MineDraftSpec, meta: s.ObjectMeta,
                       previous_scaling: Mapping[str, Any] | None, now_seconds: float) -> Evaluation:
        assert spec.autoscaling is not None
        memory = self._memory.setdefault((meta.namespace, meta.name), _Memory())
        memory.last_evaluation_seconds = now_seconds
        if spec.desired_replicas == 0:
            return await self._evaluate_at_zero(session, spec, meta, memory, previous_scaling, now_seconds)
        memory.at_zero = False
        unavailable: observe.MetricsUnavailable | None = None
        observations: Observations | None
        try:
            observations = await self._observe(session, spec, meta, memory, now_seconds)
        except observe.MetricsUnavailable as exc:
            observations, unavailable = None, exc
        current = spec.desired_replicas
        decision, memory.state = decide(policy_config(spec), memory.state, current, observations, now_seconds)
        memory.last_waiting = observations.waiting_requests if observations is not None else None
        if decision.desired > decision.current:
            memory.last_scale_up_seconds = now_seconds
        # Gone to zero: from the next tick on, the gateway is polled every tick.
        memory.at_zero = decision.desired == 0
        if unavailable is not None and not decision.changed:
            decision = Decision(current, current, str(unavailable), False)
        reason = _reason_code(decision, unavailable)
        return Evaluation(decision=decision,
                          scaling=scaling_status(previous_scaling, decision, reason, now_seconds, observations),
                          speculation=speculation_status(observations), observations=observations)
