"""Autoscaling the shared drafter pool (spec.drafterPool with minReplicas/maxReplicas) on its own utilisation, apart
from the engines.

The signal is the pool's busy share: the rate of `minedraft_drafter_drafting_seconds_total` summed over its pods is
the number of pool replicas' worth of drafting going on; divided by the replicas, each one's busy share. Time spent on
lookahead's extra branches (`minedraft_drafter_optional_drafting_seconds_total`) is left out: a lookahead engine widens
its branches into whatever drafter time is free (one engine alone keeps a drafter 60-90% busy where sd keeps it 25%,
in the twin), and the pool drafts them only when no other job waits, so that time is spare, not demand. A drafter's
batched draft loop is nearly flat in batch, so a busy share near 1 is the pool's limit (jobs then queue and engines
are answered busy and draft less): the pool scales up to bring the share back to the target, as the HPA algorithm
does (desired = ceil(drafting replicas / target)), at once; it scales down one replica per evaluation, only when
the share after removing it would stay under the target, and after a stabilisation window. Busy answers
(`minedraft_drafter_busy_total`) at or above the target mean jobs were turned away: at least one more replica.

`decide_pool` is pure (no clock, no I/O); the operator's loop feeds it Prometheus figures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# A change of the busy share within this of the target is noise: hold (the HPA's default tolerance).
TOLERANCE = 0.1


@dataclass(frozen=True)
class PoolPolicy:
    min_replicas: int
    max_replicas: int
    target_utilization: float = 0.7
    scale_down_stabilization_seconds: float = 300.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"drafterPool.minReplicas: must be between 1 and maxReplicas ({self.max_replicas}), "
                             f"got {self.min_replicas}")
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"drafterPool.targetUtilization: must be in (0, 1], got {self.target_utilization}")


@dataclass(frozen=True)
class PoolObservation:
    """Pool-wide figures over the last minute: seconds of drafting per second (summed over pods: 1.5 = one and a
    half replicas busy) and jobs answered busy per second."""

    drafting_replicas: float
    busy_per_second: float = 0.0
    # Of drafting_replicas, the part spent on lookahead's extra branches (spare time: not planned for).
    optional_replicas: float = 0.0

    @property
    def required_replicas(self) -> float:
        return max(0.0, self.drafting_replicas - self.optional_replicas)


@dataclass(frozen=True)
class PoolDecision:
    current: int
    desired: int
    reason: str
    metrics_available: bool
    utilization: float | None = None

    @property
    def changed(self) -> bool:
        return self.desired != self.current


def decide_pool(policy: PoolPolicy, current: int, observation: PoolObservation | None,
                last_scale_up_seconds: float | None, now_seconds: float) -> PoolDecision:
    """The pool's replicas after this evaluation. `current`: the replicas the spec asks for now."""
    clamped = min(max(current, policy.min_replicas), policy.max_replicas)
    if observation is None:
        reason = "no drafter pool metrics (minedraft_drafter_drafting_seconds_total): holding"
        if clamped != current:
            reason = f"{reason}, within minReplicas..maxReplicas"
        return PoolDecision(current, clamped, reason, False)
    replicas = max(current, 1)
    drafting = observation.required_replicas
    utilization = drafting / replicas
    target = policy.target_utilization
    wanted = math.ceil(drafting / target - 1e-9) if drafting > 0 else 0
    desired = current
    reason = f"busy share {utilization:.2f} per replica against a target of {target:.2f}"
    if observation.optional_replicas > 0:
        reason += f" (not counting {observation.optional_replicas / replicas:.2f} on lookahead's extra branches)"
    if utilization > target * (1 + TOLERANCE) and wanted > current:
        desired = wanted
        reason = f"{reason}: scale up to bring it to the target"
    elif observation.busy_per_second > 0 and utilization >= target:
        desired = current + 1
        reason = f"{reason}, and {observation.busy_per_second:.2f} jobs/s answered busy: one more replica"
    elif current > 1 and drafting / (current - 1) < target * (1 - TOLERANCE):
        since_up = None if last_scale_up_seconds is None else now_seconds - last_scale_up_seconds
        if since_up is not None and since_up < policy.scale_down_stabilization_seconds:
            reason = f"{reason}: would scale down, but scaled up {since_up:.0f} s ago"
        else:
            desired = current - 1
            reason = f"{reason}: one replica fewer stays under the target"
    bounded = min(max(desired, policy.min_replicas), policy.max_replicas)
    if bounded != desired:
        reason = f"{reason} (bounded by minReplicas {policy.min_replicas}..maxReplicas {policy.max_replicas})"
    return PoolDecision(current, bounded, reason, True, round(utilization, 4))


# -- Prometheus ----------------------------------------------------------------------------------------------------


def pool_queries(namespace: str, drafter: str) -> dict[str, str]:
    """PromQL for the pool's figures. Its pods are scraped through a PodMonitor named like the drafter Deployment
    (job "<namespace>/<drafter>"), or by plain scrape configs conventionally named after it; a missing namespace
    label (Prometheus outside Kubernetes) matches too, as for the engines (observe.selector)."""
    labels = f'namespace=~"{namespace}|", job=~"(.+/)?{drafter}"'
    return {
        "drafting_replicas": f"sum(rate(minedraft_drafter_drafting_seconds_total{{{labels}}}[1m]))",
        "busy_per_second": f"sum(rate(minedraft_drafter_busy_total{{{labels}}}[1m]))",
        "optional_replicas": f"sum(rate(minedraft_drafter_optional_drafting_seconds_total{{{labels}}}[1m]))",
    }


def observation_from_prometheus(results: Mapping[str, Sequence[Mapping[str, Any]]]) -> PoolObservation | None:
    """None when the pool exports no drafting time (no pods scraped yet, or no Prometheus target)."""
    def scalar(key: str) -> float | None:
        rows = results.get(key) or []
        if not rows:
            return None
        value = float(rows[0]["value"][1])
        return None if math.isnan(value) else value

    drafting = scalar("drafting_replicas")
    if drafting is None:
        return None
    # (Pods of a release without the optional counter: all of their drafting counts.)
    return PoolObservation(drafting_replicas=max(0.0, drafting),
                           busy_per_second=max(0.0, scalar("busy_per_second") or 0.0),
                           optional_replicas=min(max(0.0, scalar("optional_replicas") or 0.0), max(0.0, drafting)))
