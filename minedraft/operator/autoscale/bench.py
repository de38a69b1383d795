"""The autoscaling benchmark: minedraft, the HPA baseline and the oracle side by side, over the generated family and
the committed traces, in one run (`minedraft autoscale bench --out benchmarks/results/autoscale`).

- minedraft: the policy at its default target utilisation (not tuned on the family);
- hpa-queue: the Kubernetes HPA's algorithm on running + waiting requests per pod, at its best single target over
  the family (the cheapest of the targets swept with at most 1% SLO violations, request-weighted over the family);
  also the cheapest target with no more violations than minedraft's (the issue's "at no more SLO violations");
- oracle: the exact cheapest schedule for the fluid requirement with perfect foresight under the same startup
  delay (family.py), replayed in the simulator for its own SLO violations.

One seed of Poisson arrivals per trace (the family's members differ by much more than a seed does). Simulations run
in a process pool.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minedraft.operator.autoscale.family import (
    FAMILY_SIZE,
    PropertyReport,
    check_properties,
    make_family,
    oracle,
    requirement,
)
from minedraft.operator.autoscale.hpa import SCALE_UP_PERCENT
from minedraft.operator.autoscale.replica_model import AnyReplicaModel, load_replica_model
from minedraft.operator.autoscale.simulate import SimConfig, Trace, load_trace, simulate

HPA_TARGETS = (2.0, 4.0, 6.0, 8.0, 12.0, 16.0)
SLO_BUDGET = 0.01
DEFAULT_UTILIZATION = 0.8
# minedraft's one knob swept like the HPA's target, so the two are also compared at equal SLO violations: a policy
# that buys fewer violations with headroom shows what that headroom costs. Over the family only.
UTILIZATION_SWEEP = (0.7, 0.6, 0.5, 0.4)
# The family the policy's changes are chosen on (`--seed 1`); every other seed is a hold-out, seed 0 the reported one.
TUNING_SEED = 1
TUNING_NOTE = (f"hold-out: the policy's rules are chosen by comparing variants on the seed-{TUNING_SEED} family "
               f"(`minedraft autoscale bench --seed {TUNING_SEED}`), a different draw of the same generator; nothing "
               "is tuned on this family (docs/autoscaling.md says which results were seen when)")


@dataclass(frozen=True)
class Job:
    trace: Trace
    group: str  # "family" or "committed"
    policy: str  # "minedraft", "hpa-queue" or "oracle"
    value: float  # the HPA's target or minedraft's utilisation (0 for the oracle)


def _run(job_and_model: tuple[Job, AnyReplicaModel]) -> dict[str, Any]:
    job, model = job_and_model
    need = requirement(job.trace, model)
    out: dict[str, Any] = {"trace": job.trace.name, "group": job.group, "policy": job.policy, "value": job.value}
    if job.policy == "oracle":
        schedule = oracle(need, model.startup_seconds)
        result = simulate(job.trace, model, SimConfig(policy="oracle", schedule=schedule.existing,
                                                      initial_replicas=max(schedule.ready[0], 1)))
        out["oracle_replica_seconds"] = schedule.replica_seconds
    elif job.policy == "minedraft":
        config = SimConfig(policy="minedraft", target_utilization=job.value)
        result = simulate(job.trace, model, config)
        def check(step_percent: float) -> PropertyReport:
            return check_properties(result, job.trace, model, need, target_utilization=job.value,
                                    step=config.max_scale_up_step, interval_seconds=config.interval_seconds,
                                    stabilization_seconds=config.scale_down_stabilization_seconds,
                                    step_percent=step_percent)

        tight, one_decision = check(0.0), check(SCALE_UP_PERCENT)
        out["properties"] = {"tight": tight.to_json(), "tight_ok": tight.ok, "ok": one_decision.ok,
                             "one_decision": one_decision.to_json()}
    else:
        result = simulate(job.trace, model, SimConfig(policy="hpa-queue", hpa_target_per_pod=job.value))
    out.update(replica_seconds=result.replica_seconds, requests=result.requests,
               violations=result.slo_violation_fraction * result.requests)
    return out


def _pool(jobs: list[Job], model: AnyReplicaModel, workers: int) -> list[dict[str, Any]]:
    order = sorted(range(len(jobs)), key=lambda i: -jobs[i].trace.duration_seconds)
    results: list[dict[str, Any] | None] = [None] * len(jobs)
    args = [(jobs[i], model) for i in order]
    if workers <= 1:
        done = map(_run, args)
        for count, (i, r) in enumerate(zip(order, done, strict=True), 1):
            results[i] = r
            _progress(count, len(jobs))
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            for count, (i, r) in enumerate(zip(order, pool.map(_run, args, chunksize=4), strict=True), 1):
                results[i] = r
                _progress(count, len(jobs))
    return [r for r in results if r is not None]


def _progress(count: int, total: int) -> None:
    if count == total or count % 100 == 0:
        print(f"bench: {count}/{total} simulations", file=sys.stderr, flush=True)


def _pooled(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    requests = sum(r["requests"] for r in rows)
    return {"replica_seconds": round(sum(r["replica_seconds"] for r in rows), 1),
            "slo_violation_fraction": round(sum(r["violations"] for r in rows) / requests if requests else 0.0, 6)}


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench(model_path: Path, traces_dir: Path, family_size: int = FAMILY_SIZE, seed: int = 0,
          utilization: float = DEFAULT_UTILIZATION, hpa_targets: Sequence[float] = HPA_TARGETS,
          workers: int | None = None, indices: Sequence[int] | None = None,
          utilization_sweep: Sequence[float] = UTILIZATION_SWEEP) -> dict[str, Any]:
    model = load_replica_model(model_path)
    family = make_family(model, family_size, seed, indices)
    committed = [load_trace(p) for p in sorted(traces_dir.glob("*.jsonl"))]
    jobs: list[Job] = []
    for group, traces in (("family", family), ("committed", committed)):
        for trace in traces:
            jobs.append(Job(trace, group, "oracle", 0.0))
            jobs.append(Job(trace, group, "minedraft", utilization))
            jobs += [Job(trace, group, "hpa-queue", target) for target in hpa_targets]
    utilization_sweep = [u for u in utilization_sweep if u != utilization]
    jobs += [Job(trace, "family", "minedraft", u) for trace in family for u in utilization_sweep]
    results = _pool(jobs, model, workers or os.cpu_count() or 1)

    def rows(group: str, policy: str, value: float | None = None) -> list[dict[str, Any]]:
        return [r for r in results if r["group"] == group and r["policy"] == policy
                and (value is None or r["value"] == value)]

    ours = _pooled(rows("family", "minedraft", utilization))
    sweep = [{"target": t, **_pooled(rows("family", "hpa-queue", t))} for t in hpa_targets]
    meeting = [s for s in sweep if s["slo_violation_fraction"] <= SLO_BUDGET]
    best = (min(meeting, key=lambda s: s["replica_seconds"]) if meeting
            else min(sweep, key=lambda s: (s["slo_violation_fraction"], s["replica_seconds"])))
    no_worse = [s for s in sweep if s["slo_violation_fraction"] <= ours["slo_violation_fraction"]]
    matched = min(no_worse, key=lambda s: s["replica_seconds"]) if no_worse else None
    variants: list[tuple[str, str, float | None]] = [("oracle", "oracle", None),
                                                     ("minedraft", "minedraft", utilization),
                                                     ("hpa-queue", "hpa-queue", best["target"])]
    if matched is not None and matched["target"] != best["target"]:
        variants.append(("hpa-queue (no more violations)", "hpa-queue", matched["target"]))

    minedraft_sweep = sorted(({"target_utilization": u, **_pooled(rows("family", "minedraft", u))}
                              for u in (utilization, *utilization_sweep)),
                             key=lambda m: -m["target_utilization"])
    summary: dict[str, Any] = {
        "replica_model": {k: v for k, v in model.to_json().items()
                          if k in ("calibrated_from", "startup_seconds", "max_batch", "speedup", "modes")},
        "family_size": len(family), "family_seed": seed, "arrival_seed": 0, "minedraft_target_utilization":
        utilization, "hpa_target_per_pod": best["target"],
        "hpa_target_no_more_violations": matched["target"] if matched else None,
        "variants": [name for name, _, _ in variants], "hpa_sweep": sweep,
        "minedraft_sweep": minedraft_sweep, "at_equal_violations": at_equal_violations(minedraft_sweep, best),
        "groups": {}}
    for group, traces in (("family", family), ("committed", committed)):
        oracle_by_trace = {r["trace"]: r for r in rows(group, "oracle")}
        per_trace: list[dict[str, Any]] = []
        for trace in traces:
            entry: dict[str, Any] = {"trace": trace.name, "description": trace.description,
                                     "oracle_replica_seconds": oracle_by_trace[trace.name]["oracle_replica_seconds"]}
            for name, policy, value in variants:
                r = next(x for x in rows(group, policy, value) if x["trace"] == trace.name)
                entry[name] = {"replica_seconds": r["replica_seconds"], "requests": round(r["requests"], 1),
                               "ratio_to_oracle": round(r["replica_seconds"] / entry["oracle_replica_seconds"], 4),
                               "slo_violation_fraction": round(r["violations"] / r["requests"], 6)
                               if r["requests"] else 0.0}
                if "properties" in r:
                    entry[name]["properties"] = r["properties"]
            per_trace.append(entry)
        if not per_trace:
            continue
        totals: dict[str, Any] = {}
        oracle_total = sum(e["oracle_replica_seconds"] for e in per_trace)
        for name, policy, value in variants:
            pooled = _pooled(rows(group, policy, value))
            ratios = [e[name]["ratio_to_oracle"] for e in per_trace]
            totals[name] = {**pooled, "ratio_to_oracle": round(pooled["replica_seconds"] / oracle_total, 4),
                            "per_trace_ratio_median": round(statistics.median(ratios), 4),
                            "per_trace_ratio_p90": round(_quantile(ratios, 0.9), 4),
                            "per_trace_ratio_max": round(max(ratios), 4),
                            "traces_over_slo_budget": sum(1 for e in per_trace
                                                          if e[name]["slo_violation_fraction"] > SLO_BUDGET)}
        totals["oracle"]["oracle_replica_seconds"] = round(oracle_total, 1)
        props = [e["minedraft"]["properties"] for e in per_trace]
        totals["minedraft"]["property_failures"] = {
            "one_decision": sum(1 for p in props if not p["ok"]),
            "tight_plus_4": sum(1 for p in props if not p["tight_ok"]),
            "up_with_spare": sum(1 for p in props if p["one_decision"]["up_with_spare"]),
            "down_while_queue_grows": sum(1 for p in props if p["one_decision"]["down_while_queue_grows"]),
            "out_of_bounds": sum(1 for p in props if p["one_decision"]["out_of_bounds"])}
        summary["groups"][group] = {"traces": per_trace, "overall": totals, "by_shape": by_shape(per_trace, variants)}
    return summary


def at_equal_violations(minedraft_sweep: Sequence[dict[str, Any]], hpa: dict[str, Any]) -> dict[str, Any] | None:
    """minedraft's cheapest target utilisation with no more SLO violations than the given HPA target's, and its
    replica-seconds against that HPA's (None when no swept utilisation is that careful)."""
    careful = [m for m in minedraft_sweep if m["slo_violation_fraction"] <= hpa["slo_violation_fraction"]]
    if not careful:
        return None
    cheapest = min(careful, key=lambda m: m["replica_seconds"])
    return {"target_utilization": cheapest["target_utilization"], "hpa_target": hpa["target"],
            "replica_seconds": cheapest["replica_seconds"], "hpa_replica_seconds": hpa["replica_seconds"],
            "slo_violation_fraction": cheapest["slo_violation_fraction"],
            "hpa_slo_violation_fraction": hpa["slo_violation_fraction"],
            "fewer_replica_seconds_fraction": round(1 - cheapest["replica_seconds"] / hpa["replica_seconds"], 4)}


def by_shape(per_trace: Sequence[dict[str, Any]], variants: Sequence[tuple[str, str, float | None]]
             ) -> dict[str, dict[str, dict[str, float]]]:
    """Per shape (a family member's name ends with it; a committed trace is its own): each variant's replica-seconds
    over the oracle's and its request-weighted SLO violations, pooled over the shape's traces; where the excess and
    the violations come from."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for e in per_trace:
        groups.setdefault(e["trace"].rsplit("-", 1)[-1], []).append(e)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for shape, entries in sorted(groups.items()):
        oracle_total = sum(e["oracle_replica_seconds"] for e in entries)
        out[shape] = {}
        for name, _, _ in variants:
            replica_seconds = sum(e[name]["replica_seconds"] for e in entries)
            requests = sum(e[name]["requests"] for e in entries)
            violations = sum(e[name]["slo_violation_fraction"] * e[name]["requests"] for e in entries)
            out[shape][name] = {"traces": len(entries), "ratio_to_oracle": round(replica_seconds / oracle_total, 4)
                                if oracle_total else 0.0,
                                "excess_replica_seconds": round(replica_seconds - oracle_total, 1),
                                "violations": round(violations, 1),
                                "slo_violation_fraction": round(violations / requests, 6) if requests else 0.0}
    return out


def plot_ratios(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fam = summary["groups"]["family"]["traces"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, style in (("minedraft", "r-"), ("hpa-queue", "b-"), ("hpa-queue (no more violations)", "c--")):
        if name not in summary["variants"]:
            continue
        ratios = sorted(e[name]["ratio_to_oracle"] for e in fam)
        axes[0].plot([100 * (i + 0.5) / len(ratios) for i in range(len(ratios))], ratios, style, label=name)
        axes[1].scatter([e[name]["ratio_to_oracle"] for e in fam],
                        [100 * max(e[name]["slo_violation_fraction"], 1e-5) for e in fam], s=8, label=name,
                        color=style[0])
    axes[0].axhline(1.3, color="grey", linestyle=":", label="1.3x oracle")
    axes[0].set_xlabel("family members, sorted (%)")
    axes[0].set_ylabel("replica-seconds / oracle's")
    axes[0].set_yscale("log")
    axes[0].legend()
    axes[1].set_xscale("log")
    axes[1].set_yscale("log")
    axes[1].axhline(100 * SLO_BUDGET, color="grey", linestyle="--", label="SLO budget 1%")
    axes[1].set_xlabel("replica-seconds / oracle's (per trace)")
    axes[1].set_ylabel("requests over the TTFT SLO (%, 0 drawn at 0.001)")
    axes[1].legend()
    fig.suptitle(f"{summary['family_size']} generated traces: per-trace ratio to the oracle")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def markdown(summary: dict[str, Any], command: str) -> str:
    rm = summary["replica_model"]
    targets = ", ".join(f"{s['target']:g}" for s in summary["hpa_sweep"])
    lines = ["# Autoscaling: minedraft, the HPA baseline and the oracle in the simulator", "",
             f"- command: `{command}` (simulator only; the machine was shared, which changes nothing here: the "
             "simulation is deterministic)",
             f"- replica model: calibrated from {', '.join(rm['calibrated_from'])} (startup "
             f"{rm['startup_seconds']:.0f} s, batch {rm['max_batch']}, speedup {rm['speedup']:g}); SLO: time to "
             "first token within 2.5 s; one seed of Poisson arrivals per trace",
             f"- family: {summary['family_size']} generated traces (seed {summary['family_seed']}; "
             "`minedraft/operator/autoscale/family.py`); committed: the five traces under "
             "benchmarks/autoscale/traces",
             f"- {TUNING_NOTE}" if summary["family_seed"] != TUNING_SEED else
             f"- this is the tuning family (seed {TUNING_SEED}): figures on it are not a hold-out result",
             f"- minedraft: target utilisation {summary['minedraft_target_utilization']} (the default); hpa-queue: "
             f"target {summary['hpa_target_per_pod']:g} running + waiting requests per pod, the cheapest of "
             f"{targets} with at most 1% violations over the "
             "family; `hpa-queue (no more violations)`: target "
             f"{summary['hpa_target_no_more_violations']}, the cheapest with no more violations than minedraft",
             "- oracle: per second the fewest replicas whose full-batch throughput covers the expected token rate, "
             "scheduled at least cost with perfect foresight under the same startup (exact for that fluid "
             "requirement; it ignores Poisson noise, so it is optimistic); its violations are its schedule "
             "replayed in the simulator", ""]
    for group in summary["groups"]:
        overall = summary["groups"][group]["overall"]
        lines += [f"## {group}", "",
                  "| policy | replica-s | / oracle (pooled) | per-trace median | p90 | max | SLO violations | "
                  "traces over 1% |", "|---|---|---|---|---|---|---|---|"]
        for name in summary["variants"]:
            o = overall[name]
            lines.append(f"| {name} | {o['replica_seconds']:.0f} | {o['ratio_to_oracle']:.3f} | "
                         f"{o['per_trace_ratio_median']:.3f} | {o['per_trace_ratio_p90']:.3f} | "
                         f"{o['per_trace_ratio_max']:.3f} | {100 * o['slo_violation_fraction']:.3f}% | "
                         f"{o['traces_over_slo_budget']} |")
        ours, hpa = overall["minedraft"], overall["hpa-queue"]
        lines += ["", f"minedraft uses {100 * (1 - ours['replica_seconds'] / hpa['replica_seconds']):.1f}% fewer "
                      "replica-seconds than hpa-queue"]
        if "hpa-queue (no more violations)" in overall:
            m = overall["hpa-queue (no more violations)"]
            lines[-1] += (f", {100 * (1 - ours['replica_seconds'] / m['replica_seconds']):.1f}% fewer than "
                          "hpa-queue at no more violations")
        shapes = summary["groups"][group].get("by_shape", {})
        if group == "family" and shapes:
            excess = sum(v["minedraft"]["excess_replica_seconds"] for v in shapes.values()) or 1.0
            violated = sum(v["minedraft"]["violations"] for v in shapes.values()) or 1.0
            lines += ["", "Per shape (pooled over its traces; share = the shape's part of minedraft's excess "
                          "replica-seconds over the oracle, and of its SLO violations):", "",
                      "| shape | traces | minedraft / oracle | violations | share of excess | share of violations | "
                      "hpa-queue / oracle | violations |", "|---|---|---|---|---|---|---|---|"]
            for shape, v in shapes.items():
                m, h = v["minedraft"], v["hpa-queue"]
                lines.append(f"| {shape} | {m['traces']} | {m['ratio_to_oracle']:.2f} | "
                             f"{100 * m['slo_violation_fraction']:.2f}% | "
                             f"{100 * m['excess_replica_seconds'] / excess:.0f}% | "
                             f"{100 * m['violations'] / violated:.0f}% | {h['ratio_to_oracle']:.2f} | "
                             f"{100 * h['slo_violation_fraction']:.2f}% |")
        pf = ours["property_failures"]
        lines += ["", f"minedraft's properties (traces failing, of {len(summary['groups'][group]['traces'])}): "
                      f"above the oracle by more than one decision's step for longer than the window "
                      f"{pf['one_decision']} (by more than 4 replicas: {pf['tight_plus_4']}); scale-up with "
                      f"clearly spare capacity and no queue {pf['up_with_spare']}; scale-down while a queue grows "
                      f"{pf['down_while_queue_grows']}; out of bounds {pf['out_of_bounds']}", ""]
    lines += ["![per-trace ratios](ratios.png)", "", "HPA target sweep over the family:", "",
              "| target | replica-s | SLO violations |", "|---|---|---|"]
    for s in summary["hpa_sweep"]:
        lines.append(f"| {s['target']:g} | {s['replica_seconds']:.0f} | {100 * s['slo_violation_fraction']:.3f}% |")
    if summary.get("minedraft_sweep"):
        lines += ["", "minedraft target-utilisation sweep over the family (its one knob, swept like the HPA's "
                      "target):", "", "| target utilisation | replica-s | / oracle | SLO violations |",
                  "|---|---|---|---|"]
        oracle_total = summary["groups"]["family"]["overall"]["oracle"]["oracle_replica_seconds"]
        for m in summary["minedraft_sweep"]:
            lines.append(f"| {m['target_utilization']:g} | {m['replica_seconds']:.0f} | "
                         f"{m['replica_seconds'] / oracle_total:.3f} | {100 * m['slo_violation_fraction']:.3f}% |")
        eq = summary.get("at_equal_violations")
        if eq:
            lines += ["", f"At equal SLO violations: minedraft at target utilisation {eq['target_utilization']:g} "
                          f"uses {100 * eq['fewer_replica_seconds_fraction']:.1f}% fewer replica-seconds than "
                          f"hpa-queue at target {eq['hpa_target']:g} ({100 * eq['slo_violation_fraction']:.3f}% "
                          f"against {100 * eq['hpa_slo_violation_fraction']:.3f}% violations)"]
        else:
            lines += ["", "At equal SLO violations: no swept minedraft utilisation has as few violations as "
                          "hpa-queue"]
    committed = summary["groups"].get("committed", {}).get("traces", [])
    lines += ["", "Committed traces:", "", "| trace | " + " | ".join(summary["variants"]) + " |",
              "|---|" + "---|" * len(summary["variants"])]
    for e in committed:
        cells = [f"{e[n]['replica_seconds']:.0f} ({e[n]['ratio_to_oracle']:.2f}x, "
                 f"{100 * e[n]['slo_violation_fraction']:.2f}%)" for n in summary["variants"]]
        lines.append(f"| {e['trace']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write(summary: dict[str, Any], out_dir: Path, command: str, plots: bool = True) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out_dir / "README.md").write_text(markdown(summary, command))
    if plots:
        plot_ratios(summary, out_dir / "ratios.png")
