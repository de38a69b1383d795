"""One reconcile pass for one MineDraft: parse, check referenced Secrets, apply what drifted, observe, compute status.

Level-based: the same pass runs on create, update, resume and on the drift timer. It returns what happened (the
status to write and the Events to post) instead of talking to kopf, so the handlers stay thin.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from minedraft.operator import render, status
from minedraft.operator import spec as s
from minedraft.operator.kube import RESOURCES, SECRETS, KubeClient, KubeError
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


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Reconciler:
    def __init__(self, client: KubeClient, options: render.RenderOptions, metrics: OperatorMetrics) -> None:
        self.client = client
        self.options = options
        self.metrics = metrics

    async def _secret_problems(self, spec: s.MineDraftSpec, namespace: str) -> list[status.Problem]:
        problems = []
        for field_path, ref in spec.secret_refs():
            name, keys = (ref.name, [ref.key]) if isinstance(ref, s.SecretKeyRef) else (ref, ["tls.crt", "tls.key"])
            secret = await self.client.get(SECRETS, namespace, name)
            if secret is None:
                problems.append(status.Problem(
                    "SecretNotFound", f"{field_path}: Secret {name!r} not found in namespace {namespace}"))
                continue
            present = set((secret.get("data") or {}).keys()) | set((secret.get("stringData") or {}).keys())
            missing = [k for k in keys if k not in present]
            if missing:
                problems.append(status.Problem(
                    "SecretKeyNotFound", f"{field_path}: Secret {name!r} has no key {', '.join(missing)}"))
        return problems

    async def apply_all(self, manifests: Sequence[render.Manifest]) -> list[str]:
        """Apply every manifest whose observed object lacks something desired; return what changed."""
        changes = []
        for manifest in manifests:
            resource = RESOURCES[manifest["kind"]]
            meta = manifest["metadata"]
            current = await self.client.get(resource, meta["namespace"], meta["name"])
            if current is not None and is_subset(manifest, current):
                self.metrics.applies.labels(kind=manifest["kind"], action="unchanged").inc()
                continue
            action = "created" if current is None else "updated"
            await self.client.apply(manifest)
            self.metrics.applies.labels(kind=manifest["kind"], action=action).inc()
            changes.append(f"{manifest['kind']}/{meta['name']} {action}")
        return changes

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
        if spec is not None and meta is not None:
            problems = await self._secret_problems(spec, namespace)
        if spec is not None and meta is not None and not problems:
            try:
                applied = await self.apply_all(render.render(spec, meta, self.options))
            except KubeError as exc:
                self.metrics.errors.labels(reason="ApplyFailed").inc()
                problems = [status.Problem("ApplyFailed", str(exc))]
        observed = status.Observed(generation=generation, spec=spec, meta=meta, problems=tuple(problems),
                                   previous_conditions=previous)
        if spec is not None and meta is not None:
            names = render.names(meta)
            engine = await self.client.get(RESOURCES["Deployment"], namespace, names["engine"])
            gateway = await self.client.get(RESOURCES["Deployment"], namespace, names["gateway"])
            observed = status.Observed(
                generation=generation, spec=spec, meta=meta, problems=tuple(problems),
                engine=status.DeploymentState.from_object(engine),
                gateway=status.DeploymentState.from_object(gateway),
                previous_conditions=previous, scaling=old_status.get("scaling"))
        new_status = status.compute_status(observed, _now())
        events = [Event("Normal", "Applied", change) for change in applied]
        for cond in status.condition_changes(previous, new_status["conditions"]):
            if cond["type"] != "Ready":
                continue  # one Event per change of the summary condition; the others show in status
            kind = "Normal" if cond["status"] == "True" else "Warning"
            events.append(Event(kind, str(cond["reason"]), f"Ready={cond['status']}: {cond['message']}"))
        for problem in problems:
            self.metrics.errors.labels(reason=problem.reason).inc()
        return Outcome(status=new_status, events=events, applied=applied)
