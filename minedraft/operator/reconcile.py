"""One reconcile pass for one MineDraft: parse, check referenced Secrets, apply what drifted, observe, compute status.

Level-based: the same pass runs on create, update, resume and on the drift timer. It returns what happened (the
status to write and the Events to post) instead of talking to kopf, so the handlers stay thin.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal, InvalidOperation
from typing import Any

from minedraft.operator import render, status
from minedraft.operator import spec as s
from minedraft.operator.kube import EVENTS, PODS, RESOURCES, SECRETS, KubeClient, KubeError
from minedraft.operator.metrics import OperatorMetrics

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_SUFFIX: dict[str, int | Decimal] = {
    "": 1, "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def _quantity(value: Any) -> Decimal | None:
    if not isinstance(value, str):
        return None
    match = _QUANTITY.match(value)
    if not match:
        return None
    try:
        return Decimal(match.group(1)) * Decimal(_SUFFIX[match.group(2) or ""])
    except InvalidOperation:
        return None


def is_subset(desired: Any, observed: Any) -> bool:
    """Whether `observed` already holds everything `desired` sets (server defaults may add more).

    Quantities compare by value because the API server canonicalises them ("0.5" comes back as "500m"); without
    that, every timer tick would see drift and re-apply.
    """
    if isinstance(desired, Mapping):
        return isinstance(observed, Mapping) and all(
            k in observed and is_subset(v, observed[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(observed, list) and len(desired) == len(observed)
                and all(is_subset(d, o) for d, o in zip(desired, observed, strict=True)))
    if desired == observed:
        return True
    left, right = _quantity(desired), _quantity(observed)
    return left is not None and left == right


# The hash of the manifest the operator last applied to an object, kept on the object itself. Drift is judged against
# it: a field the MineDraft no longer sets changes the hash, so the full object is applied again and server-side
# apply removes what this field manager no longer sets. (A subset check of desired against live cannot see removals.)
APPLIED_HASH = "minedraft.io/applied-hash"


def applied_hash(manifest: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def with_applied_hash(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest with its own hash as an annotation (computed over the manifest without it)."""
    meta = dict(manifest["metadata"])
    meta["annotations"] = {**(meta.get("annotations") or {}), APPLIED_HASH: applied_hash(manifest)}
    return {**manifest, "metadata": meta}


def needs_apply(desired: Mapping[str, Any], live: Mapping[str, Any] | None) -> bool:
    """Apply when the object is missing, when what the MineDraft asks for changed since the last apply (removals
    included), or when someone edited a field the operator sets."""
    if live is None:
        return True
    want = (desired.get("metadata") or {}).get("annotations", {}).get(APPLIED_HASH)
    have = ((live.get("metadata") or {}).get("annotations") or {}).get(APPLIED_HASH)
    return want != have or not is_subset(desired, live)


def selector_changed(desired: Mapping[str, Any], live: Mapping[str, Any] | None) -> bool:
    """A Deployment's selector is immutable: one rendered with another selector must be replaced."""
    if live is None or desired.get("kind") != "Deployment":
        return False
    return (live.get("spec") or {}).get("selector") != desired["spec"]["selector"]


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in (obj.get("metadata") or {}).get("ownerReferences") or [])


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass
class Outcome:
    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)  # "Kind/name created|updated"


UPGRADE_ANNOTATION = "minedraft.io/upgrade-engine-image"


def running_engine_image(deployment: Mapping[str, Any] | None) -> str | None:
    """The image the engine Deployment's pods are asked to run (its template), None without one."""
    containers = ((((deployment or {}).get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers")
    if not containers:
        return None
    image = containers[0].get("image")
    return str(image) if image else None


def choose_engine_image(pinned: str | None, running: str | None, default: str, policy: str, requested: bool,
                        another_rolling: bool) -> str:
    """The engine image to render for a MineDraft. Pure.

    A MineDraft that names its image (spec.engine.image) gets it: its own spec change, its own rollout. Otherwise a
    new operator default (a chart upgrade changed image.tag) is taken at once only under policy All; OnRequest waits
    for the MineDraft's upgrade annotation; OneAtATime (the default) takes it when no other MineDraft is rolling to
    it, so a chart upgrade never restarts every engine of the cluster at once. Until then the running image stays.
    """
    if pinned is not None:
        return pinned
    if running is None or running == default or policy == "All" or requested:
        return default
    if policy == "OneAtATime" and not another_rolling:
        return default
    return running


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Reconciler:
    def __init__(self, client: KubeClient, options: render.RenderOptions, metrics: OperatorMetrics,
                 engine_image_rollout: str = "OneAtATime") -> None:
        self.client = client
        self.options = options
        self.metrics = metrics
        self.engine_image_rollout = engine_image_rollout
        # MineDrafts (namespace, name) whose engines are rolling to the operator's default image now; one event loop,
        # so the check and the claim below never interleave.
        self.rolling_image: set[tuple[str, str]] = set()
        # MineDrafts (by uid) whose internal credential exists: created at most once per MineDraft and operator run.
        self.internal_secret_done: set[str] = set()

    async def ensure_internal_secret(self, spec: s.MineDraftSpec, meta: s.ObjectMeta, recorded: bool,
                                     missing: bool = False) -> list[str]:
        """Create the internal credential's Secret with a random token when the pods use it and it is missing; an
        existing one (rotated by its owner) is left as it is. `recorded`: the MineDraft's status already names it
        (an operator restart then sends nothing); `missing`: a pod reported it not found (deleted: make a new one)."""
        if not render.needs_internal_secret(spec):
            return []
        if not missing and (recorded or meta.uid in self.internal_secret_done):
            return []
        import secrets

        created = await self.client.create_if_absent(SECRETS, render.internal_secret(meta, secrets.token_hex(32)))
        self.internal_secret_done.add(meta.uid)
        return [f"Secret/{render.names(meta)['internal']} created"] if created else []

    async def _engine_image(self, spec: s.MineDraftSpec, meta: s.ObjectMeta, annotations: Mapping[str, Any]
                            ) -> tuple[s.MineDraftSpec, str | None]:
        """The spec to render with its engine image decided (choose_engine_image), and the default image it is held
        back from (None when it runs the default or its own)."""
        default = self.options.image("engine")
        live = await self.client.get(RESOURCES["Deployment"], meta.namespace, render.names(meta)["engine"])
        running = running_engine_image(live)
        key = (meta.namespace, meta.name)
        others = bool(self.rolling_image - {key})
        requested = str(annotations.get(UPGRADE_ANNOTATION, "")).lower() == "true"
        image = choose_engine_image(spec.engine.image, running, default, self.engine_image_rollout, requested, others)
        if spec.engine.image is None and running is not None and running != default and image == default:
            self.rolling_image.add(key)  # its engines now roll to the new default: the others wait for it
        if image == default or spec.engine.image is not None:
            return spec, None
        return replace(spec, engine=replace(spec.engine, image=image)), default

    def _image_rolled_out(self, meta: s.ObjectMeta, engine: status.DeploymentState | None) -> None:
        # Updated is not enough: with the Replace strategy a replacement counts as updated while it is still Pending
        # or loading, and a broken image would then reach the next MineDraft. Ready, as `kubectl rollout status`.
        if engine is not None and engine.rolled_out and engine.ready_replicas >= engine.replicas:
            self.rolling_image.discard((meta.namespace, meta.name))

    async def apply_all(self, manifests: Sequence[render.Manifest]) -> list[str]:
        """Apply every manifest that changed since it was last applied or drifted; return what changed.

        Each apply is a server-side apply of the full object by one field manager, so fields the MineDraft no longer
        sets are removed. A Deployment whose selector changed (immutable) is deleted with its ReplicaSets orphaned
        and created again: the new Deployment adopts the old ReplicaSet (its pods match the new selector) and
        replaces its pods by a rolling update, so serving never stops.
        """
        changes = []
        for manifest in map(with_applied_hash, manifests):
            resource = RESOURCES[manifest["kind"]]
            meta = manifest["metadata"]
            current = await self.client.get(resource, meta["namespace"], meta["name"])
            if not needs_apply(manifest, current) and not selector_changed(manifest, current):
                self.metrics.applies.labels(kind=manifest["kind"], action="unchanged").inc()
                continue
            action = "created" if current is None else "updated"
            if selector_changed(manifest, current):
                await self.client.delete(resource, meta["namespace"], meta["name"], orphan=True)
                action = "replaced (selector changed)"
            await self.client.apply(manifest)
            self.metrics.applies.labels(kind=manifest["kind"], action=action.split(" ")[0]).inc()
            changes.append(f"{manifest['kind']}/{meta['name']} {action}")
        return changes

    async def prune(self, meta: s.ObjectMeta, manifests: Sequence[render.Manifest]) -> list[str]:
        """Delete what this MineDraft made earlier and no longer wants (gateway turned off, PDB, NetworkPolicy or
        PodMonitor no longer rendered); only objects it owns."""
        wanted = {(m["kind"], m["metadata"]["name"]) for m in manifests}
        deleted = []
        for kind, name in render.all_kinds_and_names(meta):
            if (kind, name) in wanted:
                continue
            current = await self.client.get(RESOURCES[kind], meta.namespace, name)
            if current is None or not owned_by(current, meta.uid):
                continue
            await self.client.delete(RESOURCES[kind], meta.namespace, name)
            self.metrics.applies.labels(kind=kind, action="deleted").inc()
            deleted.append(f"{kind}/{name} deleted")
        return deleted

    async def _pod_issues(self, meta: s.ObjectMeta) -> tuple[status.PodIssue, ...]:
        pods = await self.client.list_objects(PODS, meta.namespace, f"minedraft.io/instance={meta.name}")
        # Filtered here too: the label selector is the API server's job, but be exact about what is ours.
        ours = [p for p in pods if ((p.get("metadata") or {}).get("labels") or {}).get("minedraft.io/instance")
                == meta.name]
        issues = status.pod_issues(ours)
        if any(status.not_started(p) and not status.pod_issues([p]) for p in ours):
            # Pods whose status says nothing (ContainerCreating): their Events say why (FailedMount, Multi-Attach).
            events = await self.client.list_objects(EVENTS, meta.namespace, field_selector="involvedObject.kind=Pod")
            reported = {i.pod for i in issues}
            issues += [i for i in status.event_issues(ours, events) if i.pod not in reported]
        return tuple(issues)

    async def reconcile(self, body: Mapping[str, Any]) -> Outcome:
        metadata = body.get("metadata") or {}
        generation = int(metadata.get("generation") or 1)
        old_status = body.get("status") or {}
        previous = old_status.get("conditions") or []
        namespace = str(metadata.get("namespace") or "default")
        spec: s.MineDraftSpec | None = None
        meta: s.ObjectMeta | None = None
        problems: list[status.Problem] = []
        applied: list[str] = []
        try:
            meta = s.parse_meta(metadata)
            spec = s.parse_spec(body.get("spec"))
        except s.SpecError as exc:
            problems = [status.Problem("InvalidSpec", e) for e in exc.errors]
        # Referenced Secrets are not read: pods name them (secretKeyRef, secret volumes) and the kubelet reports a
        # missing one, which shows in the Progressing condition (CreateContainerConfigError, FailedMount).
        held_from: str | None = None
        if spec is not None and meta is not None and not problems:
            try:
                spec, held_from = await self._engine_image(spec, meta, metadata.get("annotations") or {})
                manifests = render.render(spec, meta, self.options)
                recorded = old_status.get("internalCredential") == render.names(meta)["internal"]
                applied = await self.ensure_internal_secret(spec, meta, recorded)  # before the pods that mount it
                applied += await self.apply_all(manifests)
                applied += await self.prune(meta, manifests)
            except KubeError as exc:
                self.metrics.errors.labels(reason="ApplyFailed").inc()
                problems = [status.Problem("ApplyFailed", str(exc))]
        observed = status.Observed(generation=generation, spec=spec, meta=meta, problems=tuple(problems),
                                   previous_conditions=previous)
        if spec is not None and meta is not None:
            names = render.names(meta)
            engine = await self.client.get(RESOURCES["Deployment"], namespace, names["engine"])
            gateway = await self.client.get(RESOURCES["Deployment"], namespace, names["gateway"])
            drafter = (await self.client.get(RESOURCES["Deployment"], namespace, names["drafter"])
                       if spec.drafter_pool is not None else None)
            observed = status.Observed(
                generation=generation, spec=spec, meta=meta, problems=tuple(problems),
                engine=status.DeploymentState.from_object(engine),
                gateway=status.DeploymentState.from_object(gateway),
                drafter=status.DeploymentState.from_object(drafter),
                previous_conditions=previous, scaling=old_status.get("scaling"),
                pod_issues=await self._pod_issues(meta))
            internal = render.names(meta)["internal"]
            if not problems and any(f'secret "{internal}" not found' in issue.message for issue in observed.pod_issues):
                try:
                    applied += await self.ensure_internal_secret(spec, meta, True, missing=True)
                except KubeError as exc:
                    # As a failed apply: a condition and a Ready event, and this status still written (an exception
                    # would leave the MineDraft's status as it was and say nothing of why its pods wait).
                    self.metrics.errors.labels(reason="ApplyFailed").inc()
                    observed = replace(observed, problems=(status.Problem(
                        "ApplyFailed", f"cannot create Secret/{internal} again (its pods cannot mount it): {exc}"),))
        new_status = status.compute_status(observed, _now())
        if spec is not None and meta is not None and not problems:
            self._image_rolled_out(meta, observed.engine)
            new_status["engineImage"] = spec.engine.image or self.options.image("engine")
            new_status["pendingEngineImage"] = held_from  # None removes it (a merge patch) once it runs the new one
            new_status["internalCredential"] = (render.names(meta)["internal"] if render.needs_internal_secret(spec)
                                                else None)
        events = [Event("Normal", "Applied", change) for change in applied]
        for cond in status.condition_changes(previous, new_status["conditions"]):
            if cond["type"] != "Ready":
                continue  # one Event per change of the summary condition; the others show in status
            kind = "Normal" if cond["status"] == "True" else "Warning"
            events.append(Event(kind, str(cond["reason"]), f"Ready={cond['status']}: {cond['message']}"))
        for problem in problems:
            self.metrics.errors.labels(reason=problem.reason).inc()
        return Outcome(status=new_status, events=events, applied=applied)
