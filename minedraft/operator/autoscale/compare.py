"""Both policies on every trace over several seeds of Poisson arrivals: the table, the HPA's target sweep, plots.

One seed is one draw of arrivals; the HPA's result on bursts in particular hangs on where its oscillation happens to
be when a burst comes (seed 0: 4,989 violations on the burst trace, seed 1: 1,130, seed 2: 10,829), so every
figure here is pooled over `seeds`: replica-seconds are the mean per seed, SLO violations the request-weighted
fraction over all of them. The per-trace JSON and plots are the first seed's runs, with every decision.

Simulations are independent and pure: they run in a process pool, longest first.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minedraft.operator.autoscale.replica_model import AnyReplicaModel, load_replica_model
from minedraft.operator.autoscale.simulate import SimConfig, SimResult, Trace, load_trace, plot, simulate

# HPA targets tried (running + waiting requests per pod): 1/16 .. 16/16 of a replica's batch (2, 4, .. 32 at 32).
HPA_TARGET_STEPS = 16
SLO_BUDGET = 0.01  # the recording rules' SLO: 99% of requests get their first token within the target
# minedraft's target utilisations shown beside the HPA's sweep (the headline uses the spec's default, not these).
UTILIZATION_SWEEP = (0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)
DEFAULT_SEEDS = (0, 1, 2)


def hpa_targets(max_batch: int) -> tuple[float, ...]:
    return tuple(round(max_batch * i / HPA_TARGET_STEPS, 3) for i in range(1, HPA_TARGET_STEPS + 1))


@dataclass(frozen=True)
class Outcome:
    """What one simulation contributes to the pooled figures."""

    trace: str
    seed: int
    requests: float
    violations: float
    replica_seconds: float
    max_queue: float
    direction_changes: int
    first_reaction_seconds: float | None

    @classmethod
    def of(cls, result: SimResult, seed: int) -> Outcome:
        return cls(result.trace, seed, result.requests, result.slo_violation_fraction * result.requests,
                   result.replica_seconds, result.max_queue, result.direction_changes, result.first_reaction_seconds)


def pooled(outcomes: Sequence[Outcome], num_seeds: int) -> dict[str, float]:
    """Request-weighted violation fraction and mean replica-seconds per seed, over `outcomes`."""
    requests = sum(o.requests for o in outcomes)
    violations = sum(o.violations for o in outcomes)
    return {"slo_violation_fraction": round(violations / requests if requests else 0.0, 6),
            "replica_seconds": round(sum(o.replica_seconds for o in outcomes) / max(num_seeds, 1), 1)}


def _outcome(job: tuple[Trace, AnyReplicaModel, SimConfig]) -> Outcome:
    trace, model, config = job
    return Outcome.of(simulate(trace, model, config), config.seed)


def _run_all(jobs: list[tuple[Trace, AnyReplicaModel, SimConfig]], workers: int) -> list[Outcome]:
    """Every job's outcome, in the jobs' order; in `workers` processes (the longest traces first), with progress."""
    order = sorted(range(len(jobs)), key=lambda i: -jobs[i][0].duration_seconds)
    outcomes: list[Outcome | None] = [None] * len(jobs)

    def collect(done: Iterator[Outcome]) -> None:
        for count, (i, outcome) in enumerate(zip(order, done, strict=True), 1):
            outcomes[i] = outcome
            _progress(count, len(jobs))

    if workers <= 1:
        collect(map(_outcome, (jobs[i] for i in order)))
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            collect(pool.map(_outcome, (jobs[i] for i in order)))
    return [o for o in outcomes if o is not None]


def _progress(count: int, total: int) -> None:
    if count == total or count % 10 == 0:
        print(f"compare: {count}/{total} simulations", file=sys.stderr, flush=True)


def compare(traces_dir: Path, model_path: Path, out_dir: Path, seeds: Sequence[int], target_utilization: float,
            plots: bool = True, sweep_utilization: bool = True, workers: int | None = None) -> dict[str, Any]:
    model = load_replica_model(model_path)
    traces = [load_trace(p) for p in sorted(traces_dir.glob("*.jsonl"))]
    seeds = tuple(seeds)
    if not seeds:
        raise ValueError("seeds: at least one seed is needed")
    workers = workers or os.cpu_count() or 1

    def hpa(target: float, seed: int) -> SimConfig:
        return SimConfig(policy="hpa-queue", hpa_target_per_pod=target, seed=seed)

    def ours(utilization: float, seed: int) -> SimConfig:
        return SimConfig(policy="minedraft", target_utilization=utilization, seed=seed)

    # Every simulation the comparison needs, run once: the HPA's sweep and minedraft's utilisation sweep (the
    # default utilisation among them), over every trace and seed.
    targets = hpa_targets(model.max_batch)
    utilizations = sorted({target_utilization, *(UTILIZATION_SWEEP if sweep_utilization else ())})
    keys = [("hpa-queue", value) for value in targets] + [("minedraft", value) for value in utilizations]
    jobs = [(trace, model, hpa(value, seed) if policy == "hpa-queue" else ours(value, seed))
            for policy, value in keys for trace in traces for seed in seeds]
    outcomes = _run_all(jobs, workers)
    per_key = len(traces) * len(seeds)
    by_key = {key: outcomes[i * per_key:(i + 1) * per_key] for i, key in enumerate(keys)}

    # The HPA's target: the single value that meets the SLO (99% of requests within the TTFT target, i.e. at most 1%
    # violations over all traces and seeds together, request-weighted) with the fewest replica-seconds. Also
    # reported: the cheapest target with no more violations than minedraft's (the issue's "at no more SLO
    # violations", from the HPA's side).
    sweep = [{"target": value, **pooled(by_key[("hpa-queue", value)], len(seeds))} for value in targets]
    meeting = [s for s in sweep if s["slo_violation_fraction"] <= SLO_BUDGET]
    best = min(meeting or sweep, key=lambda s: (s["replica_seconds"], s["slo_violation_fraction"]))
    utilization_sweep = [{"target_utilization": value, **pooled(by_key[("minedraft", value)], len(seeds))}
                         for value in utilizations if sweep_utilization]
    ours_total = pooled(by_key[("minedraft", target_utilization)], len(seeds))
    no_worse = [s for s in sweep if s["slo_violation_fraction"] <= ours_total["slo_violation_fraction"]]
    matched = min(no_worse, key=lambda s: s["replica_seconds"]) if no_worse else None
    # minedraft's own knob tuned by the HPA's rule (the cheapest utilisation swept that meets the SLO budget): the
    # HPA's target is fitted to these traces, so the default alone would compare a tuned baseline with an untuned
    # policy.
    ours_meeting = [u for u in utilization_sweep if u["slo_violation_fraction"] <= SLO_BUDGET]
    tuned = min(ours_meeting, key=lambda u: u["replica_seconds"]) if ours_meeting else None
    variants: list[tuple[str, tuple[str, float]]] = [("minedraft", ("minedraft", target_utilization))]
    if tuned is not None and tuned["target_utilization"] != target_utilization:
        variants.append(("minedraft (tuned)", ("minedraft", tuned["target_utilization"])))
    variants.append(("hpa-queue", ("hpa-queue", best["target"])))
    if matched is not None and matched["target"] != best["target"]:
        variants.append(("hpa-queue (no more violations)", ("hpa-queue", matched["target"])))

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for trace in traces:
        row: dict[str, Any] = {"trace": trace.name, "description": trace.description}
        for name, (policy, value) in variants:
            runs = [o for o in by_key[(policy, value)] if o.trace == trace.name]
            reactions = [o.first_reaction_seconds for o in runs if o.first_reaction_seconds is not None]
            row[name] = {
                **pooled(runs, len(seeds)),
                "slo_violation_fraction_by_seed": [round(o.violations / o.requests if o.requests else 0.0, 6)
                                                   for o in runs],
                "max_queue": round(max(o.max_queue for o in runs), 1),
                "direction_changes": round(sum(o.direction_changes for o in runs) / len(runs), 1),
                "first_reaction_seconds": max(reactions) if len(reactions) == len(runs) else None,
                **({"hpa_target_per_pod": value} if policy == "hpa-queue" else {}),
            }
            # The first seed's run again, with its decisions and timeline: the JSON and plot per trace.
            config = hpa(value, seeds[0]) if policy == "hpa-queue" else ours(value, seeds[0])
            _write_run(simulate(trace, model, config), name, trace, out_dir, plots and name in ("minedraft",
                                                                                                "hpa-queue"))
        rows.append(row)
    totals = {name: pooled(by_key[key], len(seeds)) for name, key in variants}
    if plots:
        sweep_plot(sweep, totals["minedraft"], out_dir / "tradeoff.png", target_utilization, utilization_sweep)
    return {"replica_model": model.to_json(), "seeds": list(seeds), "minedraft_target_utilization": target_utilization,
            "minedraft_tuned_target_utilization": tuned["target_utilization"] if tuned else None,
            "hpa_target_per_pod": best["target"],
            "hpa_target_no_more_violations": matched["target"] if matched else None,
            "variants": [name for name, _ in variants], "hpa_sweep": sweep, "utilization_sweep": utilization_sweep,
            "traces": rows, "overall": totals,
            "overall_by_seed": {name: {str(seed): pooled([o for o in by_key[key] if o.seed == seed], 1)
                                       for seed in seeds} for name, key in variants}}


def _write_run(result: SimResult, name: str, trace: Trace, out_dir: Path, with_plot: bool) -> None:
    import json

    data = result.to_json()
    data.pop("timeline")
    slug = name.replace(" ", "-").replace("(", "").replace(")", "")
    (out_dir / f"{trace.name}-{slug}.json").write_text(json.dumps(data, indent=1) + "\n")
    if with_plot:
        plot(result, out_dir / f"{trace.name}-{result.policy}.png", trace.slo_ttft_seconds)


def sweep_plot(sweep: list[dict[str, Any]], minedraft: dict[str, Any], path: Path, target_utilization: float,
               utilization_sweep: list[dict[str, Any]] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [s["replica_seconds"] / 3600 for s in sweep]
    ys = [100 * s["slo_violation_fraction"] for s in sweep]
    ax.plot(xs, ys, "o-", label=f"hpa-queue, targets {sweep[0]['target']:g}..{sweep[-1]['target']:g} requests/pod")
    for s, x, y in zip(sweep, xs, ys, strict=True):
        ax.annotate(f"{s['target']:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if utilization_sweep:
        uxs = [u["replica_seconds"] / 3600 for u in utilization_sweep]
        uys = [100 * u["slo_violation_fraction"] for u in utilization_sweep]
        ax.plot(uxs, uys, "s--", color="tab:red", alpha=0.5, label="minedraft, target utilisation swept")
        for u, x, y in zip(utilization_sweep, uxs, uys, strict=True):
            ax.annotate(f"{u['target_utilization']:g}", (x, y), textcoords="offset points", xytext=(4, -10),
                        fontsize=7, color="tab:red")
    ax.plot([minedraft["replica_seconds"] / 3600], [100 * minedraft["slo_violation_fraction"]], "r*",
            markersize=14, label=f"minedraft (utilisation {target_utilization:g})")
    ax.axhline(100 * SLO_BUDGET, color="grey", linestyle="--", label="SLO budget (1%)")
    # Violations span four orders of magnitude (0.02% .. 19%): linear up to 0.1%, logarithmic above.
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set_ylim(bottom=0.0)
    ax.set_xlabel("replica-hours per seed, all traces")
    ax.set_ylabel("requests over the TTFT SLO (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def markdown(summary: dict[str, Any], command: str) -> str:
    seeds = summary["seeds"]
    model = summary["replica_model"]
    sources = model.get("calibrated_from") or [model.get("source", "?")]  # a twin-built model names its source
    lines = ["# Autoscaling: minedraft vs hpa-queue in the simulator", "",
             f"- command: `{command}`",
             f"- replica model: calibrated from {', '.join(sources)} "
             f"(startup {summary['replica_model']['startup_seconds']:.0f} s, batch "
             f"{summary['replica_model']['max_batch']}, speedup {summary['replica_model'].get('speedup', 1):g}, "
             f"modes {', '.join(summary['replica_model'].get('modes', ()))})",
             f"- seeds of the Poisson arrivals: {', '.join(str(s) for s in seeds)}; replica-s are the mean per seed, "
             "SLO violations the request-weighted share over all seeds (per seed in brackets); max queue the "
             "largest, direction changes the mean, reaction the slowest over the seeds (`-` where some seed had "
             "no scale-up after the event, or the trace has none)",
             f"- minedraft: target utilisation {summary['minedraft_target_utilization']} (the default, not tuned); "
             "`minedraft (tuned)`: utilisation "
             f"{summary.get('minedraft_tuned_target_utilization')}, the cheapest of the utilisations swept that "
             "meets the SLO, the rule the HPA's target is chosen by; hpa-queue: "
             f"target {summary['hpa_target_per_pod']:g} running + waiting requests per pod: of the targets swept, "
             "the one with the fewest replica-seconds that meets the SLO (at most 1% violations over all traces "
             "and seeds together, request-weighted); `hpa-queue (no more violations)`: target "
             f"{summary['hpa_target_no_more_violations']}, the cheapest with no more violations than minedraft",
             "- SLO: time to first token within each trace's `slo_ttft_seconds` (2.5 s)", "",
             "| trace | policy | replica-s | SLO violations | max queue | direction changes | reaction to event |",
             "|---|---|---|---|---|---|---|"]
    for row in summary["traces"]:
        for policy in summary["variants"]:
            r = row[policy]
            reaction = "-" if r["first_reaction_seconds"] is None else f"{r['first_reaction_seconds']:.0f} s"
            by_seed = ", ".join(f"{100 * v:.2f}" for v in r["slo_violation_fraction_by_seed"])
            lines.append(f"| {row['trace']} | {policy} | {r['replica_seconds']:.0f} | "
                         f"{100 * r['slo_violation_fraction']:.2f}% ({by_seed}) | {r['max_queue']:.0f} | "
                         f"{r['direction_changes']:g} | {reaction} |")
    ours = [p for p in summary["variants"] if p.startswith("minedraft")]
    lines += ["", "Overall (all traces together):", ""]
    for policy in summary["variants"]:
        h = summary["overall"][policy]
        versus = ""
        if not policy.startswith("minedraft") and h["replica_seconds"]:
            versus = "; " + ", ".join(
                f"{p} uses {100 * (1 - summary['overall'][p]['replica_seconds'] / h['replica_seconds']):.1f}% fewer "
                "replica-seconds" for p in ours)
        per_seed = ", ".join(f"{100 * v['slo_violation_fraction']:.3f}%"
                             for v in summary["overall_by_seed"][policy].values())
        lines.append(f"- {policy}: {h['replica_seconds']:.0f} replica-s, "
                     f"{100 * h['slo_violation_fraction']:.3f}% SLO violations (per seed: {per_seed}){versus}")
    lines += ["", "![trade-off](tradeoff.png)", "",
              "HPA target sweep (all traces and seeds together):", "", "| target | replica-s | SLO violations |",
              "|---|---|---|"]
    for s in summary["hpa_sweep"]:
        lines.append(f"| {s['target']:g} | {s['replica_seconds']:.0f} | {100 * s['slo_violation_fraction']:.3f}% |")
    if summary.get("utilization_sweep"):
        lines += ["", "minedraft's target utilisation swept (all traces and seeds together):", "",
                  "| target utilisation | replica-s | SLO violations |",
                  "|---|---|---|"]
        for u in summary["utilization_sweep"]:
            lines.append(f"| {u['target_utilization']:g} | {u['replica_seconds']:.0f} | "
                         f"{100 * u['slo_violation_fraction']:.3f}% |")
    return "\n".join(lines) + "\n"
