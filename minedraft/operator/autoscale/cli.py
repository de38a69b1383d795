"""`minedraft autoscale`: simulate a policy on a trace, compare both policies on the committed traces, make traces,
calibrate the replica model from the engine benchmark's JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_MODEL = ROOT / "benchmarks" / "autoscale" / "replica-model.json"
DEFAULT_TRACES = ROOT / "benchmarks" / "autoscale" / "traces"
# HPA targets tried (running + waiting requests per pod): 1/16 .. 16/16 of a replica's batch (2, 4, .. 32 at 32).
HPA_TARGET_STEPS = 16


def hpa_targets(max_batch: int) -> tuple[float, ...]:
    return tuple(round(max_batch * i / HPA_TARGET_STEPS, 3) for i in range(1, HPA_TARGET_STEPS + 1))
SLO_BUDGET = 0.01  # the recording rules' SLO: 99% of requests get their first token within the target
# minedraft's target utilisations shown beside the HPA's sweep (the headline uses the spec's default, not these).
UTILIZATION_SWEEP = (0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)


def cmd_simulate(args: argparse.Namespace) -> int:
    from minedraft.operator.autoscale.replica_model import ReplicaModel
    from minedraft.operator.autoscale.simulate import SimConfig, load_trace, plot, simulate

    trace = load_trace(Path(args.trace))
    model = ReplicaModel.load(Path(args.replica_model))
    result = simulate(trace, model, SimConfig(policy=args.policy, hpa_target_per_pod=args.hpa_target,
                                              target_utilization=args.target_utilization, seed=args.seed))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = result.to_json()
    if not args.timeline:
        data.pop("timeline")
    out.write_text(json.dumps(data, indent=1) + "\n")
    if args.plot:
        plot(result, Path(args.plot), trace.slo_ttft_seconds)
    print(json.dumps(result.summary()))
    return 0


def _overall(results: list[Any]) -> tuple[float, float]:
    """(request-weighted SLO-violation fraction, total replica-seconds) over traces."""
    requests = sum(r.requests for r in results)
    violations = sum(r.slo_violation_fraction * r.requests for r in results)
    return violations / requests if requests else 0.0, sum(r.replica_seconds for r in results)


def compare(traces_dir: Path, model_path: Path, out_dir: Path, seed: int, target_utilization: float,
            plots: bool = True, sweep_utilization: bool = True) -> dict[str, Any]:
    from minedraft.operator.autoscale.replica_model import ReplicaModel
    from minedraft.operator.autoscale.simulate import SimConfig, load_trace, plot, simulate

    model = ReplicaModel.load(model_path)
    traces = [load_trace(p) for p in sorted(traces_dir.glob("*.jsonl"))]
    # The HPA's target: the single value that meets the SLO (99% of requests within the TTFT target, i.e. at most 1%
    # violations over all traces together, request-weighted) with the fewest replica-seconds. Also reported: the
    # cheapest target with no more violations than minedraft's (the "at no more SLO violations").
    sweep = []
    for target in hpa_targets(model.max_batch):
        runs = [simulate(t, model, SimConfig(policy="hpa-queue", hpa_target_per_pod=target, seed=seed))
                for t in traces]
        violation, replica_seconds = _overall(runs)
        sweep.append({"target": target, "slo_violation_fraction": round(violation, 6),
                      "replica_seconds": round(replica_seconds, 1)})
    meeting = [s for s in sweep if s["slo_violation_fraction"] <= SLO_BUDGET]
    best = min(meeting or sweep, key=lambda s: (s["replica_seconds"], s["slo_violation_fraction"]))
    minedraft_runs = [simulate(t, model, SimConfig(policy="minedraft", target_utilization=target_utilization,
                                                   seed=seed)) for t in traces]
    minedraft_violation, _ = _overall(minedraft_runs)
    # minedraft's own trade-off curve, for the plot and the record only: the headline stays at `target_utilization`.
    utilization_sweep = []
    for utilization in UTILIZATION_SWEEP if sweep_utilization else ():
        runs = (minedraft_runs if utilization == target_utilization else
                [simulate(t, model, SimConfig(policy="minedraft", target_utilization=utilization, seed=seed))
                 for t in traces])
        violation, replica_seconds = _overall(runs)
        utilization_sweep.append({"target_utilization": utilization, "slo_violation_fraction": round(violation, 6),
                                  "replica_seconds": round(replica_seconds, 1)})
    no_worse = [s for s in sweep if s["slo_violation_fraction"] <= minedraft_violation]
    matched = min(no_worse, key=lambda s: s["replica_seconds"]) if no_worse else None
    variants: list[tuple[str, str, float]] = [("minedraft", "minedraft", 0.0),
                                              ("hpa-queue", "hpa-queue", best["target"])]
    if matched is not None and matched["target"] != best["target"]:
        variants.append(("hpa-queue (no more violations)", "hpa-queue", matched["target"]))
    rows = []
    results: dict[str, list[Any]] = {name: [] for name, _, _ in variants}
    out_dir.mkdir(parents=True, exist_ok=True)
    for index, trace in enumerate(traces):
        row: dict[str, Any] = {"trace": trace.name, "description": trace.description}
        for name, policy, target in variants:
            result = minedraft_runs[index] if policy == "minedraft" else simulate(
                trace, model, SimConfig(policy=policy, hpa_target_per_pod=target, seed=seed))
            results[name].append(result)
            row[name] = {**result.summary(), **({"hpa_target_per_pod": target} if target else {})}
            data = result.to_json()
            data.pop("timeline")
            slug = name.replace(" ", "-").replace("(", "").replace(")", "")
            (out_dir / f"{trace.name}-{slug}.json").write_text(json.dumps(data, indent=1) + "\n")
            if plots and name in ("minedraft", "hpa-queue"):
                plot(result, out_dir / f"{trace.name}-{policy}.png", trace.slo_ttft_seconds)
        rows.append(row)
    totals = {}
    for policy, runs in results.items():
        violation, replica_seconds = _overall(runs)
        totals[policy] = {"slo_violation_fraction": round(violation, 6), "replica_seconds": round(replica_seconds, 1)}
    if plots:
        sweep_plot(sweep, totals["minedraft"], out_dir / "tradeoff.png", utilization_sweep)
    return {"replica_model": model.to_json(), "seed": seed, "minedraft_target_utilization": target_utilization,
            "hpa_target_per_pod": best["target"],
            "hpa_target_no_more_violations": matched["target"] if matched else None,
            "variants": [name for name, _, _ in variants], "hpa_sweep": sweep, "utilization_sweep": utilization_sweep,
            "traces": rows, "overall": totals}


def sweep_plot(sweep: list[dict[str, Any]], minedraft: dict[str, Any], path: Path,
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
            markersize=14, label="minedraft (utilisation 0.8)")
    ax.axhline(100 * SLO_BUDGET, color="grey", linestyle="--", label="SLO budget (1%)")
    ax.set_xlabel("replica-hours, all traces")
    ax.set_ylabel("requests over the TTFT SLO (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def markdown(summary: dict[str, Any], command: str) -> str:
    lines = ["# Autoscaling: minedraft vs hpa-queue in the simulator", "",
             f"- command: `{command}`",
             f"- replica model: calibrated from {', '.join(summary['replica_model']['calibrated_from'])} "
             f"(startup {summary['replica_model']['startup_seconds']:.0f} s, batch "
             f"{summary['replica_model']['max_batch']}, speedup {summary['replica_model'].get('speedup', 1):g}, "
             f"modes {', '.join(summary['replica_model'].get('modes', ()))})",
             f"- minedraft: target utilisation {summary['minedraft_target_utilization']} (not tuned); hpa-queue: "
             f"target {summary['hpa_target_per_pod']:g} running + waiting requests per pod: of the targets swept, "
             "the one with the fewest replica-seconds that meets the SLO (at most 1% violations over all traces "
             "together, request-weighted); `hpa-queue (no more violations)`: target "
             f"{summary['hpa_target_no_more_violations']}, the cheapest with no more violations than minedraft",
             "- SLO: time to first token within each trace's `slo_ttft_seconds` (2.5 s)", "",
             "| trace | policy | replica-s | SLO violations | max queue | direction changes | reaction to event |",
             "|---|---|---|---|---|---|---|"]
    for row in summary["traces"]:
        for policy in summary["variants"]:
            r = row[policy]
            reaction = "-" if r["first_reaction_seconds"] is None else f"{r['first_reaction_seconds']:.0f} s"
            lines.append(f"| {row['trace']} | {policy} | {r['replica_seconds']:.0f} | "
                         f"{100 * r['slo_violation_fraction']:.2f}% | {r['max_queue']:.0f} | "
                         f"{r['direction_changes']} | {reaction} |")
    m = summary["overall"]["minedraft"]
    lines += ["", "Overall (all traces together):", ""]
    for policy in summary["variants"]:
        h = summary["overall"][policy]
        saving = 1 - m["replica_seconds"] / h["replica_seconds"] if h["replica_seconds"] else 0.0
        versus = "" if policy == "minedraft" else f"; minedraft uses {100 * saving:.1f}% fewer replica-seconds"
        lines.append(f"- {policy}: {h['replica_seconds']:.0f} replica-s, "
                     f"{100 * h['slo_violation_fraction']:.2f}% SLO violations{versus}")
    lines += ["", "![trade-off](tradeoff.png)", "",
              "HPA target sweep (all traces together):", "", "| target | replica-s | SLO violations |", "|---|---|---|"]
    for s in summary["hpa_sweep"]:
        lines.append(f"| {s['target']:g} | {s['replica_seconds']:.0f} | {100 * s['slo_violation_fraction']:.2f}% |")
    if summary.get("utilization_sweep"):
        lines += ["", "minedraft's target utilisation swept (all traces together; for the trade-off only — the table "
                  "above uses the default):", "", "| target utilisation | replica-s | SLO violations |",
                  "|---|---|---|"]
        for u in summary["utilization_sweep"]:
            lines.append(f"| {u['target_utilization']:g} | {u['replica_seconds']:.0f} | "
                         f"{100 * u['slo_violation_fraction']:.2f}% |")
    return "\n".join(lines) + "\n"


def cmd_compare(args: argparse.Namespace) -> int:
    out = Path(args.out)
    summary = compare(Path(args.traces), Path(args.replica_model), out, args.seed, args.target_utilization,
                      plots=not args.no_plots)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    command = "minedraft autoscale compare " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else \
        "minedraft autoscale compare"
    (out / "README.md").write_text(markdown(summary, command))
    print(markdown(summary, command))
    return 0


def cmd_make_traces(args: argparse.Namespace) -> int:
    from minedraft.operator.autoscale.traces import write_traces

    for path in write_traces(Path(args.out), args.seed):
        print(path)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from minedraft.operator.autoscale.replica_model import calibrate, describe

    model = calibrate([Path(p) for p in args.bench], args.startup_seconds, speedup=args.speedup,
                      max_batch=args.max_batch)
    Path(args.out).write_text(json.dumps(model.to_json(), indent=2) + "\n")
    print(json.dumps(model.to_json()))
    for line in describe(model):
        print(line)
    return 0


def add_subcommands(sub: Any) -> None:
    """Register `minedraft autoscale ...` on the top-level subparsers."""
    parser = sub.add_parser("autoscale", help="the speculation-aware autoscaler's simulator")
    commands = parser.add_subparsers(dest="autoscale_command", required=True)
    sim = commands.add_parser("simulate", help="replay a trace against the replica model under one policy")
    sim.add_argument("--trace", required=True, help="JSON-lines trace")
    sim.add_argument("--policy", choices=("minedraft", "hpa-queue"), default="minedraft")
    sim.add_argument("--replica-model", default=str(DEFAULT_MODEL), help="replica model JSON (default: committed)")
    sim.add_argument("--json", required=True, help="write the result here")
    sim.add_argument("--plot", help="write a PNG of load, replicas and latency here")
    sim.add_argument("--hpa-target", type=float, default=12.0,
                     help="hpa-queue: running + waiting requests per pod (compare picks the best; default 12)")
    sim.add_argument("--target-utilization", type=float, default=0.8, help="minedraft: target utilisation")
    sim.add_argument("--timeline", action="store_true", help="include the per-second timeline in the JSON")
    sim.add_argument("--seed", type=int, default=0)
    sim.set_defaults(func=cmd_simulate)
    cmp = commands.add_parser("compare", help="both policies on every trace, the HPA target swept: table + plots")
    cmp.add_argument("--traces", default=str(DEFAULT_TRACES))
    cmp.add_argument("--replica-model", default=str(DEFAULT_MODEL))
    cmp.add_argument("--out", required=True)
    cmp.add_argument("--target-utilization", type=float, default=0.8)
    cmp.add_argument("--seed", type=int, default=0)
    cmp.add_argument("--no-plots", action="store_true")
    cmp.set_defaults(func=cmd_compare)
    make = commands.add_parser("make-traces", help="write the committed traces (deterministic)")
    make.add_argument("--out", default=str(DEFAULT_TRACES))
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(func=cmd_make_traces)
    cal = commands.add_parser("calibrate", help="fit the replica model to engine benchmark JSONs")
    cal.add_argument("--bench", nargs="+", required=True, help="minedraft bench --json outputs")
    cal.add_argument("--startup-seconds", type=float, default=40.0,
                     help="scale-up to serving (design.md §4: an engine starts in ~35-40 s here)")
    cal.add_argument("--speedup", type=float, default=1.0,
                     help="divide every step's seconds by this: the benchmark's shape on a faster device")
    cal.add_argument("--max-batch", type=int, help="requests per replica (default: the largest concurrency measured)")
    cal.add_argument("--out", default=str(DEFAULT_MODEL))
    cal.set_defaults(func=cmd_calibrate)
