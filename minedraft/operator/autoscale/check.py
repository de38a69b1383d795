"""`minedraft autoscale check`: both policies on every trace at several start-up delays, side by side, against the
issue's bar: no scale-down within CHURN_SECONDS of a scale-up, SLO misses per trace at most the HPA pattern's + 0.5
points, total replica-seconds at most 0.8x the HPA pattern's, and churn (replicas removed before they served, changes
of direction) no more than the HPA pattern's.

The HPA pattern is the Kubernetes HPA algorithm on running + waiting requests per pod (`hpa.py`) at one target
(`--hpa-target`, the simulator's default). Figures are pooled over seeds of Poisson arrivals (as `compare` does: one
draw decides where the HPA's oscillation is when a burst comes): replica-seconds the mean per seed, SLO misses the
request-weighted fraction over all of them, churn counts summed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minedraft.operator.autoscale.replica_model import AnyReplicaModel, load_replica_model
from minedraft.operator.autoscale.simulate import SimConfig, Trace, load_trace, simulate

SLO_SLACK = 0.005  # SLO misses may exceed the HPA pattern's by at most this (0.5 points)
REPLICA_SECONDS_RATIO = 0.8  # total replica-seconds at most this share of the HPA pattern's
DEFAULT_HPA_TARGET = 12.0


@dataclass(frozen=True)
class Row:
    trace: str
    startup_seconds: float
    policy: str
    replica_seconds: float
    slo_violation_fraction: float
    direction_changes: int
    removed_before_ready: int
    scale_downs_soon_after_scale_up: int
    requests: float = 0.0


def _run(job: tuple[Trace, Any, SimConfig]) -> Row:
    trace, model, config = job
    result = simulate(trace, model, config)
    return Row(trace.name, result.startup_seconds, config.policy, result.replica_seconds,
               result.slo_violation_fraction, result.direction_changes, result.removed_before_ready,
               result.scale_downs_soon_after_scale_up, result.requests)


def pool_seeds(rows: Sequence[Row]) -> list[Row]:
    """One row per (trace, startup, policy) over its seeds: mean replica-seconds, request-weighted SLO misses,
    churn summed."""
    groups: dict[tuple[str, float, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.trace, row.startup_seconds, row.policy), []).append(row)
    out = []
    for (trace, startup, policy), group in groups.items():
        requests = sum(r.requests for r in group)
        misses = sum(r.slo_violation_fraction * r.requests for r in group)
        out.append(Row(trace, startup, policy, sum(r.replica_seconds for r in group) / len(group),
                       misses / requests if requests else 0.0, sum(r.direction_changes for r in group),
                       sum(r.removed_before_ready for r in group),
                       sum(r.scale_downs_soon_after_scale_up for r in group), requests))
    return out


def run(traces: Sequence[Trace], model: Any, startups: Sequence[float], hpa_target: float = DEFAULT_HPA_TARGET,
        seeds: Sequence[int] = (0, 1, 2), workers: int | None = None) -> list[Row]:
    jobs = [(trace, model, SimConfig(policy=policy, hpa_target_per_pod=hpa_target, seed=seed,
                                     startup_seconds=startup))
            for startup in startups for trace in traces for policy in ("minedraft", "hpa-queue") for seed in seeds]
    workers = workers or os.cpu_count() or 1
    if workers <= 1:
        return pool_seeds([_run(job) for job in jobs])
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return pool_seeds(list(pool.map(_run, jobs)))


def verdict(rows: Sequence[Row]) -> dict[str, Any]:
    """Per start-up: totals of both policies and every failure of the bar, named."""
    out: dict[str, Any] = {}
    for startup in sorted({r.startup_seconds for r in rows}):
        ours = {r.trace: r for r in rows if r.startup_seconds == startup and r.policy == "minedraft"}
        hpa = {r.trace: r for r in rows if r.startup_seconds == startup and r.policy == "hpa-queue"}
        failures = []
        for name, row in ours.items():
            base = hpa[name]
            if row.scale_downs_soon_after_scale_up:
                failures.append(f"{name}: {row.scale_downs_soon_after_scale_up} scale-down(s) within 120 s of a "
                                "scale-up")
            if row.slo_violation_fraction > base.slo_violation_fraction + SLO_SLACK:
                failures.append(f"{name}: SLO misses {100 * row.slo_violation_fraction:.2f}% > HPA's "
                                f"{100 * base.slo_violation_fraction:.2f}% + 0.5")
            if row.removed_before_ready > base.removed_before_ready:
                failures.append(f"{name}: {row.removed_before_ready} replicas removed before ready (HPA "
                                f"{base.removed_before_ready})")
            if row.direction_changes > base.direction_changes:
                failures.append(f"{name}: {row.direction_changes} direction changes (HPA {base.direction_changes})")
        total_ours = sum(r.replica_seconds for r in ours.values())
        total_hpa = sum(r.replica_seconds for r in hpa.values())
        ratio = total_ours / total_hpa if total_hpa else 0.0
        if ratio > REPLICA_SECONDS_RATIO:
            failures.append(f"total replica-seconds {ratio:.2f}x the HPA's (> {REPLICA_SECONDS_RATIO})")
        out[f"{startup:g}"] = {"replica_seconds_ratio": round(ratio, 3), "failures": failures}
    return out


def markdown(rows: Sequence[Row], command: str) -> str:
    lines = [f"`{command}`", "",
             "Replica-seconds: mean per seed; SLO misses: share of requests over the TTFT target, over all seeds; "
             "churn columns: summed over the seeds.", "",
             "| startup | trace | replica-s minedraft / HPA (ratio) | SLO misses minedraft / HPA | direction changes "
             "minedraft / HPA | removed before ready minedraft / HPA | scale-downs < 120 s after a scale-up "
             "minedraft / HPA |", "|---|---|---|---|---|---|---|"]
    for startup in sorted({r.startup_seconds for r in rows}):
        ours = {r.trace: r for r in rows if r.startup_seconds == startup and r.policy == "minedraft"}
        hpa = {r.trace: r for r in rows if r.startup_seconds == startup and r.policy == "hpa-queue"}
        for name in sorted(ours):
            a, b = ours[name], hpa[name]
            lines.append(f"| {startup:g} s | {name} | {a.replica_seconds:.0f} / {b.replica_seconds:.0f} "
                         f"({a.replica_seconds / b.replica_seconds:.2f}) | {100 * a.slo_violation_fraction:.2f}% / "
                         f"{100 * b.slo_violation_fraction:.2f}% | {a.direction_changes} / {b.direction_changes} | "
                         f"{a.removed_before_ready} / {b.removed_before_ready} | "
                         f"{a.scale_downs_soon_after_scale_up} / {b.scale_downs_soon_after_scale_up} |")
        total_a = sum(r.replica_seconds for r in ours.values())
        total_b = sum(r.replica_seconds for r in hpa.values())
        lines.append(f"| {startup:g} s | **all** | {total_a:.0f} / {total_b:.0f} (**{total_a / total_b:.2f}**) | "
                     "| | | |")
    for label, v in verdict(rows).items():
        lines.append("")
        lines.append(f"startup {label} s: replica-seconds {v['replica_seconds_ratio']:.2f}x the HPA's; "
                     + ("every bar met" if not v["failures"] else "fails: " + "; ".join(v["failures"])))
    return "\n".join(lines) + "\n"


def load_traces(directory: Path, names: Sequence[str] | None = None) -> list[Trace]:
    traces = [load_trace(p) for p in sorted(directory.glob("*.jsonl"))]
    if names:
        unknown = set(names) - {t.name for t in traces}
        if unknown:
            raise ValueError(f"traces: no {', '.join(sorted(unknown))} in {directory}")
        traces = [t for t in traces if t.name in names]
    return traces


def load_model(path: Path) -> AnyReplicaModel:
    return load_replica_model(path)
