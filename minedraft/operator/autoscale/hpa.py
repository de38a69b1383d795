"""The Kubernetes HorizontalPodAutoscaler's algorithm (autoscaling/v2, default behaviour), for the simulator's baseline.

As kube-controller-manager's replica calculator and horizontal controller do it, for a Pods metric with an
AverageValue target (here: running + waiting requests per pod):

- every sync period (15 s): ratio = mean metric over pods with metrics / target; within the 10% tolerance, no
  change; else desired = ceil(ratio x pods with metrics). Pods without metrics yet (still starting) count as 0
  when scaling up and as the target when scaling down, then the ratio is recomputed; if that flips the direction
  or falls within tolerance, no change;
- scale-up: no stabilisation window; rate limited by the default policies (at most +100% or +4 pods per 15 s,
  whichever allows more);
- scale-down: the highest recommendation over the last 300 s (stabilisation window); at most -100% per 15 s;
- clamped to min/max replicas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

TOLERANCE = 0.1
SYNC_PERIOD_SECONDS = 15.0
SCALE_DOWN_STABILIZATION_SECONDS = 300.0
SCALE_UP_PERCENT = 100
SCALE_UP_PODS = 4


@dataclass(frozen=True)
class HpaConfig:
    target_per_pod: float
    min_replicas: int = 1
    max_replicas: int = 10
    tolerance: float = TOLERANCE
    scale_down_stabilization_seconds: float = SCALE_DOWN_STABILIZATION_SECONDS


@dataclass(frozen=True)
class HpaState:
    recommendations: tuple[tuple[float, int], ...] = ()


def _calculate(config: HpaConfig, current: int, ready: int, total_metric: float) -> int:
    """The replica calculator: `total_metric` summed over the `ready` pods with metrics."""
    if ready == 0:
        return current
    ratio = (total_metric / ready) / config.target_per_pod
    missing = current - ready
    if missing == 0:
        if abs(ratio - 1.0) <= config.tolerance:
            return current
        return math.ceil(ratio * ready - 1e-9)
    if abs(ratio - 1.0) <= config.tolerance:
        return current
    scale_up = ratio > 1.0
    # Missing pods: 0 when scaling up, the target when scaling down.
    filled = total_metric + (0.0 if scale_up else missing * config.target_per_pod)
    new_ratio = (filled / current) / config.target_per_pod
    if abs(new_ratio - 1.0) <= config.tolerance or (new_ratio > 1.0) != scale_up:
        return current
    return math.ceil(new_ratio * current - 1e-9)


def hpa_decide(config: HpaConfig, state: HpaState, current: int, ready: int, total_metric: float,
               now_seconds: float) -> tuple[int, str, HpaState]:
    """Next replica count, why, and the next state."""
    recommended = max(config.min_replicas, min(config.max_replicas, _calculate(config, current, ready, total_metric)))
    window = config.scale_down_stabilization_seconds
    history = (*((t, r) for t, r in state.recommendations if t > now_seconds - window), (now_seconds, recommended))
    state = replace(state, recommendations=history)
    metric = total_metric / ready if ready else 0.0
    if recommended > current:
        limit = max(current + current * SCALE_UP_PERCENT // 100, current + SCALE_UP_PODS)
        desired = min(recommended, limit)
        return desired, f"hpa: {metric:.1f} requests per pod > target {config.target_per_pod:g}", state
    if recommended < current:
        desired = max(r for _, r in history)
        if desired < current:
            return desired, f"hpa: {metric:.1f} requests per pod < target {config.target_per_pod:g}", state
    return current, "hpa: within tolerance or stabilising", state
