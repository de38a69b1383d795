"""`minedraft autoscale`: simulate a policy on a trace, compare both policies on the committed traces, make traces,
calibrate the replica model from the engine benchmark's JSON."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_MODEL = ROOT / "benchmarks" / "autoscale" / "replica-model.json"
DEFAULT_TRACES = ROOT / "benchmarks" / "autoscale" / "traces"
CAPACITY_PRIOR_ACCEPTANCES = (0.8, 0.6, 0.4)


def _load_model(args: argparse.Namespace) -> Any:
    from minedraft.operator.autoscale.replica_model import load_replica_model

    return load_replica_model(Path(args.replica_model))


def _floats(flag: str, text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise SystemExit(f"{flag}: expected comma-separated numbers, got {text!r}") from None


def twin_model(args: argparse.Namespace, prompt_tokens: int, output_tokens: int) -> Any:
    """The replica model from a cost-curve file through the twin (`minedraft plan`'s figures)."""
    # The twin runs the engine's planner (zmq and the engine's modules): loaded here, when this command runs, never by
    # the operator (its image has neither), as `minedraft plan` is by the top-level CLI.
    twin = importlib.import_module("minedraft.twin.autoscale_model")
    try:
        settings = twin.TwinModelSettings(
            curves=args.curves, target=args.target, drafter=args.drafter,
            loads=tuple(int(v) for v in _floats("--twin-loads", args.twin_loads)),
            acceptances=_floats("--twin-acceptances", args.twin_acceptances),
            prompt_tokens=args.prompt_tokens or prompt_tokens, output_tokens=args.output_tokens or output_tokens,
            max_batch=args.max_batch, fixed_startup_seconds=args.fixed_startup_seconds,
            disk_gb_per_second=args.disk_gb_per_second, plan_flags=tuple(args.plan_flag or ()))
    except ValueError as exc:
        raise SystemExit(f"autoscale simulate: {exc}") from None
    return twin.replica_model_from_curves(settings)


def capacity_table(model: Any, prompt_tokens: int, output_tokens: int, acceptance: float) -> list[dict[str, Any]]:
    """Per-replica capacity at each of a twin model's loads: decoding alone, and with each request's prefill."""
    rows = []
    for load in model.loads:
        tps, mode, k = model.best(load, acceptance)
        rows.append({"load": load, "acceptance": acceptance, "tokens_per_s": round(tps, 1), "mode": mode, "k": k,
                     "tokens_per_s_with_prefill": round(model.capacity_with_prefill(load, acceptance, prompt_tokens,
                                                                                    output_tokens), 1)})
    return rows


def cmd_simulate(args: argparse.Namespace) -> int:
    from minedraft.operator.autoscale.replica_model import TableReplicaModel, load_replica_model
    from minedraft.operator.autoscale.simulate import SimConfig, load_trace, plot, plot_policies, simulate

    trace = load_trace(Path(args.trace))
    first = trace.rows[0]
    if args.curves:
        model = twin_model(args, first.prompt_tokens, first.output_tokens)
        if args.save_model:
            Path(args.save_model).write_text(json.dumps(model.to_json(), indent=1) + "\n")
    else:
        model = load_replica_model(Path(args.replica_model))
    policies = ("minedraft", "hpa-queue") if args.policy == "both" else (args.policy,)
    results = [simulate(trace, model, SimConfig(policy=policy, hpa_target_per_pod=args.hpa_target,
                                                target_utilization=args.target_utilization, seed=args.seed,
                                                startup_seconds=args.startup_seconds)) for policy in policies]
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = []
    for result in results:
        data = result.to_json()
        if not args.timeline:
            data.pop("timeline")
        runs.append(data)
    described: dict[str, Any] = {k: v for k, v in model.to_json().items()
                                 if k not in ("ar_step", "draft_forward", "sd_extra_per_draft", "psd_ratio",
                                              "tokens_per_second", "choices")}
    if isinstance(model, TableReplicaModel):
        described["capacity"] = capacity_table(model, model.prompt_tokens, model.output_tokens,
                                               args.capacity_acceptance)
    body: dict[str, Any] = runs[0] if len(runs) == 1 else {"runs": runs}
    out.write_text(json.dumps({**body, "replica_model": described}, indent=1) + "\n")
    if args.plot:
        if len(results) == 1:
            plot(results[0], Path(args.plot), trace.slo_ttft_seconds)
        else:
            plot_policies(results, Path(args.plot), trace.slo_ttft_seconds)
    for result in results:
        print(json.dumps(result.summary()))
    if isinstance(model, TableReplicaModel):
        for row in described["capacity"]:
            print(f"replica capacity at {row['load']:g} requests, acceptance {row['acceptance']:g}: "
                  f"{row['tokens_per_s']:.0f} tok/s decoding ({row['mode']} k={row['k']}), "
                  f"{row['tokens_per_s_with_prefill']:.0f} with prefill")
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
    try:
        seeds = [int(v) for v in args.seeds.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--seeds: expected comma-separated integers, got {args.seeds!r}") from None
    rows = run(load_traces(Path(args.traces), names), model, startups, hpa_target=args.hpa_target, seeds=seeds,
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
    sim.add_argument("--policy", choices=("minedraft", "hpa-queue", "both"), default="minedraft",
                     help="both: the two side by side (one JSON with both runs, one plot)")
    sim.add_argument("--replica-model", default=str(DEFAULT_MODEL),
                     help="replica model JSON (default: committed, the CPU calibration); ignored with --curves")
    sim.add_argument("--startup-seconds", type=float,
                     help="scale-up to serving (default: the replica model's)")
    twin = sim.add_argument_group("a replica model from GPU cost curves, through the twin (minedraft plan)")
    twin.add_argument("--curves", help="a cost-curve file (minedraft-cost-curves/v1): build the replica model from it")
    twin.add_argument("--target", help="target model in the file (default: its only one)")
    twin.add_argument("--drafter", help="drafter model in the file (default: its only one)")
    twin.add_argument("--twin-loads", default="1,2,4,8,16,32,64,128,256", help="requests per replica the twin runs")
    twin.add_argument("--twin-acceptances", default="0.2,0.4,0.6,0.8,0.9",
                      help="per-position acceptances the twin runs (the simulator interpolates between them)")
    twin.add_argument("--prompt-tokens", type=int, help="request shape for the twin (default: the trace's first row)")
    twin.add_argument("--output-tokens", type=int)
    twin.add_argument("--max-batch", type=int, default=256, help="the engine's --max-num-seqs (default 256)")
    twin.add_argument("--disk-gb-per-second", type=float, default=1.0,
                      help="start-up estimate: the weights' read bandwidth (default 1 GB/s, an estimate)")
    twin.add_argument("--fixed-startup-seconds", type=float, default=60.0,
                      help="start-up estimate: scheduling, image, CUDA graphs before the weights (default 60 s)")
    twin.add_argument("--plan-flag", action="append",
                      help="a further `minedraft plan` flag as deployed, e.g. --plan-flag=-tp --plan-flag=2")
    twin.add_argument("--capacity-acceptance", type=float, default=0.8,
                      help="acceptance of the per-replica capacity table printed (default 0.8)")
    twin.add_argument("--save-model", help="write the replica model built from the curves here (for "
                      "--replica-model, check and compare)")
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
    chk.add_argument("--seeds", default="0,1,2",
                     help="seeds of the Poisson arrivals, comma-separated; figures are pooled over them")
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
