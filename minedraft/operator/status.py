"""Pure status computation: observed objects (as plain data) to the MineDraft's status and conditions.

Conditions keep their lastTransitionTime while their status stays the same, so a status recomputed from the same
observations equals the previous one and the operator writes nothing (no spurious changes, no event storms).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from minedraft.operator import render
from minedraft.operator import spec as s

CONDITION_ORDER = ("Ready", "EngineReady", "GatewayReady", "Progressing", "ScalingReady", "MetricsAvailable")
# Deployment conditions that mean a rollout is stuck (not merely slow).
_STUCK_DEPLOYMENT = {("Progressing", "False"), ("ReplicaFailure", "True")}
# Container waiting reasons that mean a pod will not start without a change (not merely ContainerCreating).
_STUCK_WAITING = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
                            "CreateContainerError", "CrashLoopBackOff", "RunContainerError"})
MAX_MESSAGE_CHARS = 400


@dataclass(frozen=True)
class DeploymentState:
    """What a Deployment reports; None in Observed when it does not exist (yet)."""

    replicas: int
    ready_replicas: int
    updated_replicas: int
    generation: int
    observed_generation: int
    # The Deployment's own stuck conditions as (reason, message), e.g. ProgressDeadlineExceeded.
    stuck: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_object(cls, obj: Mapping[str, Any] | None) -> DeploymentState | None:
        if obj is None:
            return None
        st = obj.get("status") or {}
        stuck = tuple((str(c.get("reason") or c.get("type")), str(c.get("message") or ""))
                      for c in st.get("conditions") or [] if (c.get("type"), c.get("status")) in _STUCK_DEPLOYMENT)
        return cls(
            replicas=int((obj.get("spec") or {}).get("replicas", 1)),
            ready_replicas=int(st.get("readyReplicas") or 0),
            updated_replicas=int(st.get("updatedReplicas") or 0),
            generation=int((obj.get("metadata") or {}).get("generation") or 0),
            observed_generation=int(st.get("observedGeneration") or 0),
            stuck=stuck,
        )

    @property
    def rolled_out(self) -> bool:
        return self.observed_generation >= self.generation and self.updated_replicas >= self.replicas


@dataclass(frozen=True)
class PodIssue:
    """Why one pod is not running: the scheduler's or the kubelet's reason and message."""

    component: str  # engine | gateway
    pod: str
    reason: str
    message: str


def pod_issues(pods: Sequence[Mapping[str, Any]]) -> list[PodIssue]:
    """What keeps pods from running, from their status: unschedulable, image pulls, config errors, crash loops
    (with the crashed container's termination message: the engine's last log lines, e.g. a refused vLLM flag)."""
    issues: list[PodIssue] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        component = str((meta.get("labels") or {}).get("minedraft.io/component", ""))
        name = str(meta.get("name", ""))
        st = pod.get("status") or {}
        for cond in st.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                issues.append(PodIssue(component, name, str(cond.get("reason") or "Unschedulable"),
                                       str(cond.get("message") or "")))
        for container in st.get("containerStatuses") or []:
            waiting = (container.get("state") or {}).get("waiting") or {}
            reason = str(waiting.get("reason") or "")
            if reason not in _STUCK_WAITING:
                continue
            message = str(waiting.get("message") or "")
            terminated = (container.get("lastState") or {}).get("terminated") or {}
            if terminated.get("message"):
                message = f"{message}; last exit {terminated.get('exitCode')}: {terminated['message']}".lstrip("; ")
            issues.append(PodIssue(component, name, reason, message))
    return issues


# Event reasons that mean a pod stays in ContainerCreating until someone acts: a Secret or ConfigMap volume that does
# not exist or lacks the key mounted, a volume that cannot mount, a ReadWriteOnce volume attached to another node.
# They show only as Events (the pod's own status says ContainerCreating, with no message).
STUCK_EVENT_REASONS = frozenset({"FailedMount", "FailedAttachVolume"})


def _event_time(event: Mapping[str, Any]) -> str:
    series = event.get("series") or {}
    return str(series.get("lastObservedTime") or event.get("lastTimestamp") or event.get("eventTime")
               or event.get("firstTimestamp") or "")


def not_started(pod: Mapping[str, Any]) -> bool:
    """A pod, not being deleted, none of whose containers has started (Pending, ContainerCreating)."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return not any((c.get("state") or {}).get("running") or (c.get("state") or {}).get("terminated")
                   for c in statuses)


def event_issues(pods: Sequence[Mapping[str, Any]], events: Sequence[Mapping[str, Any]]) -> list[PodIssue]:
    """The latest FailedMount/FailedAttachVolume Warning of each of these pods that has not started its containers
    (an Event outlives the problem: a pod already running is not reported)."""
    waiting: dict[str, tuple[str, str]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        if not_started(pod):
            waiting[str(meta.get("name", ""))] = (str(meta.get("uid") or ""),
                                                  str((meta.get("labels") or {}).get("minedraft.io/component", "")))
    latest: dict[str, Mapping[str, Any]] = {}
    for event in events:
        involved = event.get("involvedObject") or event.get("regarding") or {}
        name = str(involved.get("name", ""))
        if (event.get("type") != "Warning" or event.get("reason") not in STUCK_EVENT_REASONS
                or involved.get("kind") != "Pod" or name not in waiting):
            continue
        uid = waiting[name][0]
        if uid and involved.get("uid") and involved.get("uid") != uid:
            continue  # an earlier pod of the same name
        if name not in latest or _event_time(event) >= _event_time(latest[name]):
            latest[name] = event
    return [PodIssue(waiting[name][1], name, str(event["reason"]), str(event.get("message") or event.get("note") or ""))
            for name, event in sorted(latest.items())]


@dataclass(frozen=True)
class SpeculationFigures:
    acceptance_rate: float | None = None
    overlap: float | None = None
    modes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Problem:
    """Why the spec cannot be applied: a condition reason and a message naming the field."""

    reason: str
    message: str


@dataclass(frozen=True)
class Observed:
    generation: int
    spec: s.MineDraftSpec | None  # None when the spec does not parse
    meta: s.ObjectMeta | None
    problems: tuple[Problem, ...] = ()
    engine: DeploymentState | None = None
    gateway: DeploymentState | None = None
    speculation: SpeculationFigures | None = None
    previous_conditions: Sequence[Mapping[str, Any]] = field(default_factory=tuple)
    # status.scaling as the autoscaler last wrote it (None before its first evaluation or without autoscaling).
    scaling: Mapping[str, Any] | None = None
    pod_issues: tuple[PodIssue, ...] = ()
    # The shared drafter pool's Deployment (only observed with spec.drafterPool).
    drafter: DeploymentState | None = None


def _condition(cond_type: str, status: str, reason: str, message: str, generation: int, now: str,
               previous: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    before = previous.get(cond_type)
    since = before.get("lastTransitionTime") if before and before.get("status") == status else None
    return {"type": cond_type, "status": status, "reason": reason, "message": message,
            "observedGeneration": generation, "lastTransitionTime": since or now}


def _short(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS - 3] + "..."


def _progressing(observed: Observed, gateway_enabled: bool) -> tuple[str, str, str]:
    """Progressing: False with the first stuck reason (Deployment or pod), True while rolling out or done."""
    states = [("engine", observed.engine)] + ([("gateway", observed.gateway)] if gateway_enabled else [])
    for what, state in states:
        for reason, message in state.stuck if state else ():
            return "False", reason, _short(f"{what} Deployment: {message}")
    for issue in observed.pod_issues:
        return "False", issue.reason, _short(f"{issue.component} pod {issue.pod}: {issue.message}")
    if all(state is not None and state.rolled_out for _, state in states):
        return "True", "Complete", "every Deployment has rolled out"
    return "True", "RollingOut", "Deployments are rolling out"


def _deployment_condition(state: DeploymentState | None, desired: int, what: str) -> tuple[str, str, str]:
    if state is None:
        return "False", "NotCreated", f"the {what} Deployment does not exist yet"
    if desired == 0:
        return "False", "ScaledToZero", f"no {what} replicas requested"
    if not state.rolled_out:
        return ("False", "RollingOut",
                f"{state.updated_replicas}/{desired} {what} replicas updated, {state.ready_replicas} ready")
    if state.ready_replicas < desired:
        return "False", "ReplicasNotReady", f"{state.ready_replicas}/{desired} {what} replicas ready"
    return "True", "AllReplicasReady", f"{state.ready_replicas}/{desired} {what} replicas ready"


def autoscaling_conditions(scaling: Mapping[str, Any], generation: int, now: str,
                           previous_conditions: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """ScalingReady and MetricsAvailable from the autoscaler's last evaluation (status.scaling).

    Both the autoscaler (right after it evaluates) and every reconcile pass derive them from the same record, so
    the two writers never disagree.
    """
    previous = {c.get("type", ""): c for c in previous_conditions}
    reason = str(scaling.get("reason") or "Unknown")
    message = str(scaling.get("message") or "")
    if scaling.get("metricsAvailable"):
        metrics = _condition("MetricsAvailable", "True", "Collected", "engine metrics are current", generation, now,
                             previous)
        ready = _condition("ScalingReady", "True", reason, message, generation, now, previous)
    else:
        metrics = _condition("MetricsAvailable", "False", reason, message, generation, now, previous)
        ready = _condition("ScalingReady", "False", reason, f"no scaling decision: {message}", generation, now,
                           previous)
    return ready, metrics


def compute_status(observed: Observed, now: str) -> dict[str, Any]:
    """The full status to write; `now` is an RFC 3339 time used only for conditions that change."""
    previous = {c.get("type", ""): c for c in observed.previous_conditions}
    gen = observed.generation

    def cond(cond_type: str, status: str, reason: str, message: str) -> dict[str, Any]:
        return _condition(cond_type, status, reason, message, gen, now, previous)

    spec, meta = observed.spec, observed.meta
    status: dict[str, Any] = {"observedGeneration": gen}
    if observed.problems or spec is None or meta is None:
        problem = observed.problems[0] if observed.problems else Problem("InvalidSpec", "the spec does not parse")
        message = "; ".join(p.message for p in observed.problems) or problem.message
        conditions = [
            cond("Ready", "False", problem.reason, message),
            cond("EngineReady", "False", problem.reason, message),
            cond("GatewayReady", "False", problem.reason, message),
            cond("Progressing", "False", problem.reason, message),
            cond("ScalingReady", "Unknown", problem.reason, "not evaluated while the spec cannot be applied"),
            cond("MetricsAvailable", "Unknown", problem.reason, "not evaluated while the spec cannot be applied"),
        ]
        # The replica figures of an earlier good spec stay as they were: the objects it made keep running.
        return {**status, "phase": "Failed", "conditions": conditions}

    desired = spec.desired_replicas
    engine = cond("EngineReady", *_deployment_condition(observed.engine, desired, "engine"))
    idle = desired == 0 and render.may_scale_to_zero(spec) and observed.engine is not None
    if idle:
        # Scaled to zero by the autoscaler: idle, not failed. The gateway holds the first request and wakes an engine.
        engine = cond("EngineReady", "True", "ScaledToZero", "idle: scaled to zero (autoscaling.minReplicas 0); the "
                                                             "gateway wakes an engine on the next request")
    if spec.gateway.enabled:
        gateway = cond("GatewayReady", *_deployment_condition(observed.gateway, spec.gateway.replicas, "gateway"))
    else:
        gateway = cond("GatewayReady", "True", "Disabled", "spec.gateway.enabled is false: clients use the engines' "
                                                          "Service")
    progressing = cond("Progressing", *_progressing(observed, spec.gateway.enabled))
    if spec.autoscaling is None:
        scaling = cond("ScalingReady", "True", "FixedReplicas", f"{desired} engine replicas requested")
    else:
        a = spec.autoscaling
        scaling = cond("ScalingReady", "Unknown", "NoDecisionYet",
                       f"autoscaling within {a.min_replicas}..{a.max_replicas}; no decision yet, {desired} "
                       "engine replicas requested")
    figures = observed.speculation
    if figures is None or figures.acceptance_rate is None:
        metrics = cond("MetricsAvailable", "Unknown", "NotCollected", "speculation metrics are not collected yet")
    else:
        metrics = cond("MetricsAvailable", "True", "Collected", "speculation metrics are current")
    if spec.autoscaling is not None and observed.scaling:
        scaling, metrics = autoscaling_conditions(observed.scaling, gen, now, observed.previous_conditions)
    not_ready = [c for c in (engine, gateway) if c["status"] != "True"]
    if not_ready:
        first = not_ready[0]
        message = first["message"]
        if progressing["status"] == "False":
            # Why it is not ready, when something is stuck: e.g. "0/1 engine replicas ready; Unschedulable: ..."
            message = _short(f"{message}; {progressing['reason']}: {progressing['message']}")
        ready = cond("Ready", "False", first["reason"], message)
    elif idle:
        ready = cond("Ready", "True", "Idle", "scaled to zero while idle: the gateway is ready and wakes an engine on "
                                              "the next request")
    else:
        ready = cond("Ready", "True", "Serving", "engines and gateway are ready")
    engine_ready = observed.engine.ready_replicas if observed.engine else 0
    if idle and ready["status"] == "True":
        phase = "Idle"
    elif ready["status"] == "True":
        phase = "Ready"
    elif observed.engine is None and observed.gateway is None:
        phase = "Pending"
    else:
        phase = "Progressing"
    pool_conditions = []
    if spec.drafter_pool is not None:
        # Informational, not part of Ready: engines whose pool is down keep serving, decoding without drafts.
        pool_status, pool_reason, pool_message = _deployment_condition(
            observed.drafter, render.drafter_replicas(spec), "drafter pool")
        if pool_status == "True":
            # What the pool runs with: its dtype (never float32 on a GPU by default) and the requests each pod holds.
            pool_message += (f"; dtype {s.pool_dtype_summary(spec)}, {s.pool_max_num_seqs(spec)} requests held per "
                             "pod")
        pool_conditions.append(cond("DrafterPoolReady", pool_status, pool_reason, pool_message))
    status.update({
        "phase": phase,
        "conditions": [ready, engine, gateway, progressing, scaling, metrics, *pool_conditions],
        "replicas": desired,
        "readyReplicas": engine_ready,
        "ready": f"{engine_ready}/{desired}",
        "selector": render.engine_selector(meta),
        "endpoint": render.gateway_endpoint(spec, meta) if spec.gateway.enabled else render.engine_endpoint(meta),
    })
    if figures is not None and figures.acceptance_rate is not None:
        status["speculation"] = {"acceptanceRate": round(figures.acceptance_rate, 4),
                                 **({"overlap": round(figures.overlap, 4)} if figures.overlap is not None else {}),
                                 **({"modes": list(figures.modes)} if figures.modes else {})}
    return status


def status_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether writing `new` changes anything the operator owns in `old` (kopf's own keys are ignored)."""
    old = old or {}
    return any(old.get(key) != value for key, value in new.items())


def condition_changes(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Conditions whose status, reason or message differ from before: each becomes one Event."""
    before = {c.get("type"): c for c in old}
    changed = []
    for c in new:
        b = before.get(c["type"])
        if b is None or any(b.get(k) != c.get(k) for k in ("status", "reason", "message")):
            changed.append(dict(c))
    return changed
