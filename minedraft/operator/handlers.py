"""kopf handlers: thin adapters from kopf's callbacks to the Reconciler, in a registry built per operator run.

Handlers keep nothing at module level: the registry, the client, the metrics and the render options live in the
operator's memo, built once in `run_operator`.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import aiohttp
import kopf

from minedraft.operator import spec as s
from minedraft.operator.autoscale.loop import Autoscaler, pool_status
from minedraft.operator.autoscale.policy import SIGNALS
from minedraft.operator.kube import KubeClient, KubeError
from minedraft.operator.metrics import OperatorMetrics
from minedraft.operator.reconcile import Reconciler
from minedraft.operator.settings import OperatorSettings
from minedraft.operator.status import autoscaling_conditions, status_changed

Logger = logging.Logger | logging.LoggerAdapter[Any]
RESOURCE = (s.API_GROUP, s.API_VERSION, s.PLURAL)
# Back-off when the API server itself fails (not the spec): kopf retries the handler, the process keeps running.
API_RETRY_DELAY_SECONDS = 10.0


@dataclass
class Memo:
    """What every handler needs; kopf hands each handler its own shallow copy of this memo (the dict below is
    shared: the copies hold the same object)."""

    reconciler: Reconciler
    metrics: OperatorMetrics
    autoscaler: Autoscaler
    # The latest body of every MineDraft seen, kept by the event handler for the periodic passes.
    bodies: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    # Background tasks started at start-up (held here so they are not garbage-collected).
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


def _rfc3339(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def _autoscale(body: kopf.Body, patch: kopf.Patch, memo: Memo, logger: Logger) -> None:
    """One autoscaler tick: evaluate when the MineDraft's interval has passed, scale through /scale, record."""
    try:
        spec = s.parse_spec(body.get("spec"))
        meta = s.parse_meta(body.get("metadata") or {})
    except s.SpecError:
        return  # the reconcile handlers report the spec's problems
    if spec.autoscaling is None:
        return
    now = time.time()
    old_status: Mapping[str, Any] = body.get("status") or {}
    async with aiohttp.ClientSession() as session:
        # The interval passed, or (one cheap read per tick) the engines' queue grew since the last evaluation.
        if not await memo.autoscaler.should_evaluate(session, spec, meta, now):
            return
        evaluation = await memo.autoscaler.evaluate(session, spec, meta, old_status.get("scaling"), now)
    decision, metrics, labels = evaluation.decision, memo.metrics, (meta.namespace, meta.name)
    if decision.changed:
        try:
            await memo.reconciler.client.scale(meta.namespace, meta.name, decision.desired)
        except KubeError as exc:
            metrics.autoscaler_decisions.labels(*labels, "scale_failed").inc()
            kopf.warn(body, reason="ScaleFailed", message=str(exc))
            return  # nothing recorded: the next tick evaluates again
        kopf.event(body, type="Normal", reason="Scaled",
                   message=f"engine replicas {decision.current} -> {decision.desired}: {decision.reason}")
        logger.info("scaled %d -> %d: %s", decision.current, decision.desired, decision.reason)
    result = ("no_metrics" if not decision.metrics_available else
              "scale_up" if decision.desired > decision.current else
              "scale_down" if decision.desired < decision.current else "hold")
    metrics.autoscaler_decisions.labels(*labels, result).inc()
    metrics.autoscaler_desired_replicas.labels(*labels).set(decision.desired)
    metrics.autoscaler_current_replicas.labels(*labels).set(decision.current)
    metrics.autoscaler_metrics_available.labels(*labels).set(1 if decision.metrics_available else 0)
    if decision.inputs is not None:
        metrics.autoscaler_capacity.labels(*labels).set(decision.inputs.capacity_tokens_per_second_per_replica)
        metrics.autoscaler_demand.labels(*labels).set(decision.inputs.demand_tokens_per_second)
        metrics.autoscaler_slots.labels(*labels).set(decision.inputs.slots_per_replica)
        for signal in SIGNALS:
            metrics.autoscaler_signal.labels(*labels, signal).set(1 if signal == decision.inputs.signal else 0)
    previous = list(old_status.get("conditions") or [])
    scaling_ready, metrics_available = autoscaling_conditions(
        evaluation.scaling, int(body.metadata.get("generation") or 1), _rfc3339(now), previous)
    was: Mapping[str, Any] = next((c for c in previous if c.get("type") == "MetricsAvailable"), {})
    if metrics_available["status"] == "False" and was.get("status") != "False":
        kopf.event(body, type="Warning", reason=str(metrics_available["reason"]),
                   message=f"MetricsAvailable=False: {metrics_available['message']}")
    replaced = {"ScalingReady": scaling_ready, "MetricsAvailable": metrics_available}
    conditions = [replaced.pop(str(c.get("type")), dict(c)) for c in previous] + list(replaced.values())
    # Only what changed is written: an evaluation that finds the same is no status write at all.
    new = {"conditions": conditions, "scaling": evaluation.scaling}
    if evaluation.speculation is not None:
        new["speculation"] = evaluation.speculation
    for key, value in new.items():
        if old_status.get(key) != value:
            patch.status[key] = value


async def _autoscale_pool(body: kopf.Body, patch: kopf.Patch, memo: Memo, logger: Logger) -> None:
    """One drafter-pool autoscaler tick: on its own utilisation, apart from the engines; writes
    spec.drafterPool.replicas (the reconcile renders the Deployment) and status.drafterPool."""
    try:
        spec = s.parse_spec(body.get("spec"))
        meta = s.parse_meta(body.get("metadata") or {})
    except s.SpecError:
        return
    now = time.time()
    if not memo.autoscaler.pool_due(spec, meta, now):
        return
    async with aiohttp.ClientSession() as session:
        decision = await memo.autoscaler.evaluate_pool(session, spec, meta, now)
    if decision.changed:
        try:
            await memo.reconciler.client.scale_drafter_pool(meta.namespace, meta.name, decision.desired)
        except KubeError as exc:
            kopf.warn(body, reason="DrafterPoolScaleFailed", message=str(exc))
            return
        kopf.event(body, type="Normal", reason="DrafterPoolScaled",
                   message=f"drafter pool replicas {decision.current} -> {decision.desired}: {decision.reason}")
        logger.info("drafter pool scaled %d -> %d: %s", decision.current, decision.desired, decision.reason)
    status = pool_status(decision)
    if (body.get("status") or {}).get("drafterPool") != status:
        patch.status["drafterPool"] = status


async def _reconcile(trigger: str, body: kopf.Body, patch: kopf.Patch, memo: Memo, logger: Logger) -> None:
    started = time.perf_counter()
    metrics = memo.metrics
    try:
        outcome = await memo.reconciler.reconcile(body)
    except KubeError as exc:
        metrics.reconciles.labels(trigger=trigger, result="api_error").inc()
        kopf.warn(body, reason="APIError", message=str(exc))
        raise kopf.TemporaryError(str(exc), delay=API_RETRY_DELAY_SECONDS) from exc
    finally:
        metrics.reconcile_seconds.observe(time.perf_counter() - started)
    old_status: Mapping[str, Any] = body.get("status") or {}
    if status_changed(old_status, outcome.status):
        for key, value in outcome.status.items():
            patch.status[key] = value
    for event in outcome.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    for change in outcome.applied:
        logger.info("applied: %s", change)
    name, namespace = body.metadata.name or "", body.metadata.namespace or ""
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in outcome.status["conditions"])
    metrics.ready.labels(namespace, name).set(1 if ready else 0)
    if "replicas" in outcome.status:
        metrics.desired_replicas.labels(namespace, name).set(outcome.status["replicas"])
        metrics.ready_replicas.labels(namespace, name).set(outcome.status["readyReplicas"])
    result = "ok" if outcome.status["phase"] != "Failed" else "problem"
    metrics.reconciles.labels(trigger=trigger, result=result).inc()


async def _status_patch(memo: Memo, body: kopf.Body, patch: kopf.Patch) -> None:
    """Write what a periodic pass put in patch.status (kopf writes a handler's patch itself; these passes run
    outside kopf's handlers), and keep the cached body in step so the next pass does not write it again before the
    watch event arrives."""
    status = dict(patch.get("status") or {})
    if status:
        key = (body.metadata.namespace or "", body.metadata.name or "")
        await memo.reconciler.client.patch_status(key[0], key[1], status)
        cached = memo.bodies.get(key)
        if cached is not None:
            memo.bodies[key] = {**cached, "status": {**(cached.get("status") or {}), **status}}


async def periodic_passes(settings: OperatorSettings, memo: Memo, logger: Logger) -> None:
    """Drift/status refresh every drift interval and autoscaler ticks, for every MineDraft seen.

    Not kopf timers: kopf puts a finalizer on every object that has a timer or daemon, and a MineDraft would then
    stay undeletable whenever the operator is not running (owner references already delete its objects). Only a
    watch-event handler feeds this loop, so the operator never adds a finalizer.
    """
    last_drift = time.monotonic()
    while True:
        await asyncio.sleep(settings.autoscale_tick_seconds if settings.autoscale_tick_seconds
                            < settings.drift_interval_seconds else settings.drift_interval_seconds)
        drift_due = time.monotonic() - last_drift >= settings.drift_interval_seconds
        if drift_due:
            last_drift = time.monotonic()
            # The Prometheus operator may be installed (or discovery may answer) after this operator started.
            await refresh_monitoring(settings, memo.reconciler, logger)
        for key, raw in list(memo.bodies.items()):
            body = kopf.Body(cast(kopf.RawBody, raw))
            if body.metadata.get("deletionTimestamp"):
                continue
            try:
                if (body.get("spec") or {}).get("autoscaling"):
                    patch = kopf.Patch()
                    await _autoscale(body, patch, memo, logger)
                    await _status_patch(memo, body, patch)
                if ((body.get("spec") or {}).get("drafterPool") or {}).get("minReplicas") is not None:
                    body = kopf.Body(cast(kopf.RawBody, memo.bodies.get(key, raw)))
                    patch = kopf.Patch()
                    await _autoscale_pool(body, patch, memo, logger)
                    await _status_patch(memo, body, patch)
                if drift_due and key in memo.bodies:
                    body = kopf.Body(cast(kopf.RawBody, memo.bodies[key]))  # with what the autoscaler just wrote
                    patch = kopf.Patch()
                    await _reconcile("timer", body, patch, memo, logger)
                    await _status_patch(memo, body, patch)
            except (kopf.TemporaryError, KubeError) as exc:
                logger.warning("periodic pass of %s/%s failed: %s (next pass retries)", *key, exc)
            except asyncio.CancelledError:
                raise
            except Exception:  # one MineDraft's bug must not stop the passes of all others
                logger.exception("periodic pass of %s/%s failed", *key)


def build_registry(settings: OperatorSettings, connection: kopf.ConnectionInfo | None = None) -> kopf.OperatorRegistry:
    """The handlers for one operator run. `connection` replaces kopf's kubeconfig login (tests, emulators)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # In a pod: the ServiceAccount; elsewhere: the kubeconfig (both through the official client's loaders).
        return connection if connection is not None else kopf.login_via_client(**kwargs)

    @kopf.on.create(*RESOURCE, registry=registry)
    async def created(body: kopf.Body, patch: kopf.Patch, memo: Any, logger: Logger, **_: Any) -> None:
        await _reconcile("create", body, patch, memo, logger)

    @kopf.on.update(*RESOURCE, registry=registry)
    async def updated(body: kopf.Body, patch: kopf.Patch, memo: Any, logger: Logger, **_: Any) -> None:
        await _reconcile("update", body, patch, memo, logger)

    @kopf.on.resume(*RESOURCE, registry=registry)
    async def resumed(body: kopf.Body, patch: kopf.Patch, memo: Any, logger: Logger, **_: Any) -> None:
        await _reconcile("resume", body, patch, memo, logger)

    # Every watch event: the latest body for the periodic passes (drift, status refresh, autoscaler). An event
    # handler needs no finalizer; a deleted MineDraft is forgotten (owner references delete its objects).
    @kopf.on.event(*RESOURCE, registry=registry)
    async def seen(event: Mapping[str, Any], body: kopf.Body, memo: Any, logger: Logger, **_: Any) -> None:
        key = (body.metadata.namespace or "", body.metadata.name or "")
        if event.get("type") == "DELETED":
            memo.bodies.pop(key, None)
            memo.metrics.forget(*key)
            memo.autoscaler.forget(*key)
            memo.reconciler.rolling_image.discard(key)  # a MineDraft deleted mid-rollout holds no other back
            memo.reconciler.internal_secret_done.discard(body.metadata.uid or "")
            logger.info("deleted; its objects go with it through their owner references")
        else:
            memo.bodies[key] = dict(body)
        if not memo.tasks:
            # Started from here, not at start-up: a task inherits the context it is created in, and only watching
            # handlers have kopf's Event posting set up (kopf.event from a start-up task fails). A task on kopf's
            # loop: kopf cancels it when the operator stops.
            memo.tasks.append(asyncio.get_running_loop().create_task(periodic_passes(settings, memo, logger)))

    # The periodic passes end with the operator: kopf runs cleanup handlers as it stops, and otherwise waits 5 s for
    # tasks left on its loop ("hung tasks") before cancelling them, which delayed every stop (a pod's SIGTERM).
    @kopf.on.cleanup(registry=registry)
    async def stop_periodic_passes(memo: Any, **_: Any) -> None:
        for task in memo.tasks:
            task.cancel()
        await asyncio.gather(*memo.tasks, return_exceptions=True)
        memo.tasks.clear()

    return registry


def kopf_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # One operator replica (the chart's Deployment uses Recreate): no peering objects, no extra RBAC for them.
    settings.peering.standalone = True
    # The CRD is installed with the chart: no need to watch CRDs or namespaces (and no RBAC to do so).
    settings.scanning.disabled = True
    # Only explicit Events (changes, problems) and kopf's own warnings reach `kubectl describe`.
    settings.posting.level = logging.WARNING
    return settings


async def refresh_monitoring(settings: OperatorSettings, reconciler: Reconciler, logger: Logger | None = None) -> bool:
    """With --monitoring auto, ask discovery again whether PodMonitors are served and render them from now on if so
    (or stop, if the CRDs were removed). Runs at start and on every drift pass, not once: a discovery call that
    failed at start, or the Prometheus operator installed afterwards, must not leave MineDrafts unmonitored until
    the operator restarts. A failed check changes nothing. Returns whether PodMonitors are rendered."""
    if settings.monitoring != "auto":
        return reconciler.options.monitoring
    try:
        available = await reconciler.client.has_api("monitoring.coreos.com", "v1", "podmonitors")
    except KubeError as exc:
        if logger is not None:
            logger.warning("cannot tell whether PodMonitors are served (checked again later): %s", exc)
        return reconciler.options.monitoring
    if available != reconciler.options.monitoring:
        reconciler.options = settings.render_options(available)
        if logger is not None:
            logger.info("PodMonitors are %s served: %s them", "now" if available else "no longer",
                        "rendering" if available else "no longer rendering")
    return available


def build_autoscaler(settings: OperatorSettings, client: KubeClient) -> Autoscaler:
    """Engines are scraped when ready (a loading one has no figures); gateways whatever their readiness (one holding
    the streams that must wake engines at zero is heard even if its readiness says otherwise)."""
    return Autoscaler(settings.prometheus_url, client.ready_addresses, tick_seconds=settings.autoscale_tick_seconds,
                      gateway_addresses=client.all_addresses)


async def run_operator(settings: OperatorSettings, client: KubeClient | None = None,
                       connection: kopf.ConnectionInfo | None = None, stop_flag: asyncio.Event | None = None,
                       ready_flag: asyncio.Event | None = None, metrics: OperatorMetrics | None = None) -> None:
    """Run until stopped (SIGTERM, or stop_flag in tests)."""
    client = client or KubeClient.from_environment()
    metrics = metrics or OperatorMetrics()
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port, registry=metrics.registry)
    reconciler = Reconciler(client, settings.render_options(False), metrics,
                            engine_image_rollout=settings.engine_image_rollout)
    await refresh_monitoring(settings, reconciler)
    memo = Memo(reconciler=reconciler, metrics=metrics, autoscaler=build_autoscaler(settings, client))
    try:
        await kopf.operator(
            registry=build_registry(settings, connection),
            settings=kopf_settings(),
            memo=memo,
            clusterwide=not settings.namespaces,
            namespaces=list(settings.namespaces),
            standalone=True,
            liveness_endpoint=f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        )
    finally:
        client.close()
