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
CAPACITY_PRIOR_ACCEPTANCES = (0.8, 0.6, 0.4)


def _load_model(args: argparse.Namespace) -> Any:
    from minedraft.operator.autoscale.replica_model import ReplicaModel

    return ReplicaModel.load(Path(args.replica_model))


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


def cmd_compare(args: argparse.Namespace) -> int:
    from minedraft.operator.autoscale.compare import compare, markdown

    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--seeds: expected comma-separated integers, got {args.seeds!r}") from None
    out = Path(args.out)
    summary = compare(Path(args.traces), Path(args.replica_model), out, seeds, args.target_utilization,
                      plots=not args.no_plots, workers=args.workers)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    command = "minedraft autoscale compare " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else \
        "minedraft autoscale compare"
    (out / "README.md").write_text(markdown(summary, command))
    print(markdown(summary, command))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from minedraft.operator.autoscale.bench import bench, markdown, write

    summary = bench(Path(args.replica_model), Path(args.traces), family_size=args.family_size, seed=args.seed,
                    utilization=args.target_utilization, workers=args.workers)
    command = "minedraft autoscale bench " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else \
        "minedraft autoscale bench"
    write(summary, Path(args.out), command, plots=not args.no_plots)
    print(markdown(summary, command))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from minedraft.operator.autoscale.check import load_traces, markdown, run, verdict

    model = _load_model(args)
    try:
        startups = [float(s) for s in args.startup_seconds.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--startup-seconds: expected comma-separated numbers, got {args.startup_seconds!r}") from None
    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    rows = run(load_traces(Path(args.traces), names), model, startups, hpa_target=args.hpa_target, seed=args.seed,
               workers=args.workers)
    command = "minedraft autoscale check " + " ".join(sys.argv[3:])
    text = markdown(rows, command)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 1 if any(v["failures"] for v in verdict(rows).values()) else 0


def cmd_history(args: argparse.Namespace) -> int:
    import asyncio
    import time

    from minedraft.operator.autoscale.history import fetch, runs_from_points

    end = time.time()
    points = asyncio.run(fetch(args.prometheus, args.namespace, f"{args.name}-engine", end - args.hours * 3600, end,
                               args.step_seconds))
    runs = runs_from_points(points, args.min_points)
    if not runs:
        raise SystemExit(f"history: no (mode, k, load) seen at least {args.min_points} times in {len(points)} points "
                         f"of {args.namespace}/{args.name}-engine over {args.hours:g} h")
    report = {"source": f"prometheus history of {args.namespace}/{args.name}-engine, {args.hours:g} h",
              "runs": runs}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"history: {len(runs)} measured runs from {len(points)} points -> {args.out}", file=sys.stderr)
    return 0


def cmd_make_traces(args: argparse.Namespace) -> int:
    from minedraft.operator.autoscale.traces import write_traces

    for path in write_traces(Path(args.out), args.seed):
        print(path)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from minedraft.operator.autoscale.replica_model import calibrate, describe

    model = calibrate([Path(p) for p in args.bench], args.startup_seconds, speedup=args.speedup,
                      max_batch=args.max_batch, kv_capacity_tokens=args.kv_capacity_tokens,
                      prefill_seconds_per_token=args.prefill_ms_per_token / 1000.0,
                      assumptions=tuple(args.assumption or ()))
    Path(args.out).write_text(json.dumps(model.to_json(), indent=2) + "\n")
    print(json.dumps(model.to_json()))
    for line in describe(model):
        print(line)
    # The MineDraft's capacity prior (used until the autoscaler has measured a speed): a full batch at the acceptance
    # the deployment expects.
    for acceptance in CAPACITY_PRIOR_ACCEPTANCES:
        print(f"spec.autoscaling.replicaCapacityTokensPerSecond at acceptance {acceptance:g}: "
              f"{model.best(model.max_batch, acceptance)[0]:.0f} (full batch of {model.max_batch})")
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
    cmp.add_argument("--seeds", default="0,1,2",
                     help="seeds of the Poisson arrivals, comma-separated; figures are pooled over them")
    cmp.add_argument("--workers", type=int, help="simulations in parallel (default: one per CPU)")
    cmp.add_argument("--no-plots", action="store_true")
    cmp.set_defaults(func=cmd_compare)
    bench = commands.add_parser("bench", help="minedraft, the HPA and the oracle over the generated family and the "
                                              "committed traces: table + plot of per-trace ratios")
    bench.add_argument("--out", required=True)
    bench.add_argument("--traces", default=str(DEFAULT_TRACES))
    bench.add_argument("--replica-model", default=str(DEFAULT_MODEL))
    bench.add_argument("--family-size", type=int, default=210, help="generated traces (default 210: 30 per shape)")
    bench.add_argument("--seed", type=int, default=0, help="the family's seed")
    bench.add_argument("--target-utilization", type=float, default=0.8)
    bench.add_argument("--workers", type=int, help="simulations in parallel (default: one per CPU)")
    bench.add_argument("--no-plots", action="store_true")
    bench.set_defaults(func=cmd_bench)
    chk = commands.add_parser("check", help="both policies on every trace at several start-ups against the churn, "
                                             "SLO and replica-seconds bar (a table; exit 1 if any fails)")
    chk.add_argument("--traces", default=str(DEFAULT_TRACES))
    chk.add_argument("--only", help="comma-separated trace names (default: every trace in --traces)")
    chk.add_argument("--replica-model", default=str(DEFAULT_MODEL))
    chk.add_argument("--startup-seconds", default="40,180", help="comma-separated start-up delays (default 40,180)")
    chk.add_argument("--hpa-target", type=float, default=12.0)
    chk.add_argument("--seed", type=int, default=0)
    chk.add_argument("--workers", type=int, help="simulations in parallel (default: one per CPU)")
    chk.add_argument("--out", help="also write the table here")
    chk.set_defaults(func=cmd_check)
    hist = commands.add_parser("history", help="measured runs for calibrate from a deployment's Prometheus history")
    hist.add_argument("--prometheus", required=True, help="Prometheus HTTP API address")
    hist.add_argument("--namespace", required=True)
    hist.add_argument("--name", required=True, help="the MineDraft's name (its engines are <name>-engine)")
    hist.add_argument("--hours", type=float, default=168.0, help="how far back (default a week)")
    hist.add_argument("--step-seconds", type=float, default=30.0)
    hist.add_argument("--min-points", type=int, default=5, help="points a (mode, k, load) needs to count")
    hist.add_argument("--out", required=True, help="JSON for `calibrate --bench`")
    hist.set_defaults(func=cmd_history)
    make = commands.add_parser("make-traces", help="write the committed traces (deterministic)")
    make.add_argument("--out", default=str(DEFAULT_TRACES))
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(func=cmd_make_traces)
    cal = commands.add_parser("calibrate", help="fit the replica model to engine benchmark JSONs")
    cal.add_argument("--bench", nargs="+", required=True,
                     help="minedraft bench --json, minedraft doctor --json or minedraft autoscale history outputs")
    cal.add_argument("--startup-seconds", type=float, default=40.0,
                     help="scale-up to serving: pod start plus model load (an engine starts in ~35-40 s on the CI "
                     "machines)")
    cal.add_argument("--speedup", type=float, default=1.0,
                     help="divide every step's seconds by this: the benchmark's shape on a faster device")
    cal.add_argument("--max-batch", type=int, help="requests per replica (default: the largest concurrency measured)")
    cal.add_argument("--kv-capacity-tokens", type=float,
                     help="tokens of KV cache per replica (vLLM's log: 'GPU KV cache size: N tokens'; default: "
                     "unbounded, the batch is limited by --max-batch alone)")
    cal.add_argument("--prefill-ms-per-token", type=float, default=0.0,
                     help="a replica's milliseconds per prompt token prefilled (default 0: prefill not modelled)")
    cal.add_argument("--assumption", action="append",
                     help="where a figure the benchmarks do not measure came from (kept in the model; repeatable)")
    cal.add_argument("--out", default=str(DEFAULT_MODEL))
    cal.set_defaults(func=cmd_calibrate)
