"""kopf handlers: thin adapters from kopf's callbacks to the Reconciler, in a registry built per operator run.

Handlers keep nothing at module level: the registry, the client, the metrics and the render options live in the
operator's memo, built once in `run_operator`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from minedraft.operator import spec as s
from minedraft.operator.kube import KubeClient, KubeError
from minedraft.operator.metrics import OperatorMetrics
from minedraft.operator.reconcile import Reconciler
from minedraft.operator.settings import OperatorSettings
from minedraft.operator.status import status_changed

Logger = logging.Logger | logging.LoggerAdapter[Any]
RESOURCE = (s.API_GROUP, s.API_VERSION, s.PLURAL)
# Back-off when the API server itself fails (not the spec): kopf retries the handler, the process keeps running.
API_RETRY_DELAY_SECONDS = 10.0


@dataclass
class Memo:
    """What every handler needs; kopf hands each handler its own shallow copy of this memo."""

    reconciler: Reconciler
    metrics: OperatorMetrics


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

    # Level-triggered safety net: someone edited or deleted a managed object, or pods became ready.
    @kopf.on.timer(*RESOURCE, interval=settings.drift_interval_seconds, initial_delay=settings.drift_interval_seconds,
                   registry=registry)
    async def drift(body: kopf.Body, patch: kopf.Patch, memo: Any, logger: Logger, **_: Any) -> None:
        await _reconcile("timer", body, patch, memo, logger)

    # Owner references do the cleanup, so this handler is optional (it alone would need no finalizer). kopf still
    # puts a finalizer on each MineDraft because of the timer, and removes it once the timer has stopped.
    @kopf.on.delete(*RESOURCE, optional=True, registry=registry)
    async def deleted(body: kopf.Body, memo: Any, logger: Logger, **_: Any) -> None:
        memo.metrics.forget(body.metadata.namespace or "", body.metadata.name or "")
        logger.info("deleted; its objects go with it through their owner references")

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


async def run_operator(settings: OperatorSettings, client: KubeClient | None = None,
                       connection: kopf.ConnectionInfo | None = None, stop_flag: asyncio.Event | None = None,
                       ready_flag: asyncio.Event | None = None, metrics: OperatorMetrics | None = None) -> None:
    """Run until stopped (SIGTERM, or stop_flag in tests)."""
    client = client or KubeClient.from_environment()
    metrics = metrics or OperatorMetrics()
    available = False
    if settings.monitoring == "auto":
        try:
            available = await client.has_api("monitoring.coreos.com", "v1", "podmonitors")
        except KubeError:
            available = False
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port, registry=metrics.registry)
    memo = Memo(reconciler=Reconciler(client, settings.render_options(available), metrics), metrics=metrics)
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
