"""`minedraft plan`: every mode of the engine on a cost-curve file, through the twin; per load band the mode and k
to run, replicas needed and tokens per second per GPU. JSON on stdout with --json, progress on stderr."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minedraft.twin.capacity import DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_RUNTIME_RESERVE_BYTES, GIB
from minedraft.twin.costs import (
    DEFAULT_FAMILIES,
    DEFAULT_GPU_HOST_MS_PER_STEP,
    DRAFTER_PLACEMENTS,
    FIXED_FAMILIES,
    AcceptanceModel,
    Hardware,
)
from minedraft.twin.curves import CostCurves, CurveError, load_curves, pick_model
from minedraft.twin.deploy import DEFAULT_RPC_ROUND_TRIP_MS, TP_ROUND_TRIPS_PER_STEP, deployment_model
from minedraft.twin.devices import DEVICES
from minedraft.twin.pricing import EXAMPLE_PRICES, load_prices

if TYPE_CHECKING:
    from minedraft.twin.plan import Band

# The twin's replica loop (run, sweep, plan) drives the engine's own planner and drafter link, which import zmq:
# those load when `plan` runs, not when the CLI's parser is built (the operator and gateway images have no zmq).

DEFAULT_RATE_CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _ints(field: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise CurveError(field, f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise CurveError(field, f"expected positive integers, got {text!r}")
    return values


def _floats(field: str, text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise CurveError(field, f"expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise CurveError(field, f"expected positive numbers, got {text!r}")
    return values


def acceptance_from_bench(path: Path) -> AcceptanceModel:
    """Per-position acceptance measured by `minedraft bench` (its JSON): each position's rate pooled over every
    run and mode that drafted that far (a 0 means the position was not drafted)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CurveError("acceptance_from", f"cannot read {path}: {exc}") from None
    sums: list[float] = []
    counts: list[int] = []

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            rates = node.get("acceptance_per_position")
            if isinstance(rates, list):
                for i, value in enumerate(rates):
                    if isinstance(value, int | float) and value > 0:
                        while len(sums) <= i:
                            sums.append(0.0)
                            counts.append(0)
                        sums[i] += value
                        counts[i] += 1
            for child in node.values():
                visit(child)
        elif isinstance(node, list):
            for child in node:
                visit(child)

    visit(data)
    survival: list[float] = []
    for total, count in zip(sums, counts, strict=True):
        if not count:
            break
        survival.append(min(total / count, survival[-1] if survival else 1.0))
    if not survival:
        raise CurveError("acceptance_from", f"{path} holds no acceptance_per_position")
    return AcceptanceModel(tuple(survival))


def curves_on_cpu(curves: CostCurves) -> bool:
    """Curves measured on a CPU: vLLM runs no async scheduling there, so its own modes pay host work in series."""
    return curves.device.lower().startswith("cpu") or "(cpu)" in curves.execution.lower()


# What each figure of `plan` assumes about host work, in words (the JSON's `host_work`).
HOST_WORK_NOTE = ("host work per step (scheduling, planning, input preparation, output processing) is not in the "
                  "curves: the engine's ar, sd, psd and auto pay it after each forward pass; plain vLLM (vllm-ar), "
                  "vLLM's colocated SD (vllm-sd) and psd with async steps (psd-async, TP = 1) overlap it with the "
                  "forward pass where vLLM runs async scheduling (GPUs)")


def _hardware(args: argparse.Namespace, on_cpu: bool = False) -> Hardware:
    try:
        return Hardware(tensor_parallel_size=args.tensor_parallel_size,
                        all_reduce_us_per_layer=args.all_reduce_us_per_layer,
                        drafter_placement=args.drafter_placement, shared_contention=args.shared_contention,
                        step_overhead_ms=args.step_overhead_ms, prefill_ms_per_token=args.prefill_ms_per_token or 0.0,
                        vllm_async_scheduling=not on_cpu)
    except ValueError as exc:
        raise CurveError(str(exc).split(":", 1)[0], str(exc).split(":", 1)[-1].strip()) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--curves", required=True, help="cost-curve file (minedraft-cost-curves/v1)")
    parser.add_argument("--target", help="target model name in the file (default: its only target)")
    parser.add_argument("--drafter", help="drafter model name in the file (default: its only drafter)")
    load = parser.add_argument_group("load (one of)")
    load.add_argument("--concurrency", help="requests in flight per replica: comma-separated values")
    load.add_argument("--rate", help="requests per second: comma-separated values (a band each)")
    load.add_argument("--trace", help="file of `duration_s,requests_per_s` lines (a band each)")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--acceptance", default="0.8",
                        help="per-position acceptance: one conditional rate (0.8) or the engine's per-position "
                        "rates (0.8,0.62,0.5)")
    parser.add_argument("--acceptance-from", help="a `minedraft bench` JSON: use the acceptance it measured")
    parser.add_argument("-k", "--draft-lengths", default=None, help="k values (default: 1 to the longest the "
                        "drafter's curves measure)")
    parser.add_argument("--modes", default=",".join(DEFAULT_FAMILIES),
                        help=f"fixed-mode families to run (some of {', '.join(FIXED_FAMILIES)}; default "
                        f"{','.join(DEFAULT_FAMILIES)}; vllm-ar is plain decoding in vLLM itself, psd-async the "
                        "engine's psd with --async-psd-steps); auto always runs unless --no-auto")
    parser.add_argument("--no-auto", action="store_true")
    parser.add_argument("--confirm", action="store_true",
                        help="measure the fixed settings within 3%% of their family's best again over auto's window "
                        "(1,500 steps, not 240) before they are listed: the best of many short windows is biased "
                        "upward, so compare auto with the fixed modes this way (slower)")
    parser.add_argument("--lookahead-fanout", type=int, default=None,
                        help="lookahead: the most branches pre-drafted per request per round (the engine's "
                        "--lookahead-fanout; its core drafts fewer where measured drafter time would not hide behind "
                        "a verification). Listed as lookahead-kK with the fan-out it used and its branch hit rate")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--all-reduce-us-per-layer", type=float, default=25.0,
                        help="added per target layer to a forward at TP > 1 (default 25)")
    parser.add_argument("--drafter-placement", choices=DRAFTER_PLACEMENTS, default="own",
                        help="own: a GPU of its own (psd/sd hold TP + 1 GPUs); shared: on the target's first GPU")
    parser.add_argument("--shared-contention", type=float, default=1.0,
                        help="shared placement: share of overlapping draft/verify time that serialises (0-1)")
    parser.add_argument("--step-overhead-ms", type=float, default=DEFAULT_GPU_HOST_MS_PER_STEP,
                        help="host work per step beyond the forward pass (not in the curves): paid after each "
                        "forward by the engine's own steps, overlapped with it by plain vLLM, vLLM's colocated SD "
                        "and psd-async on a GPU (default %(default)s: an estimate of 1.7-3.3 ms at TP = 1 from the "
                        "engine's code, not measured; more at TP > 1)")
    parser.add_argument("--prefill-ms-per-token", type=float, default=None,
                        help="target time per prompt token (default: from the curves' prefill_ms shape, or a "
                        "labelled roofline estimate where the file has none; 0 leaves prefill out)")
    deploy = parser.add_argument_group("what a deployment holds and pays")
    deploy.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION,
                        help="share of each target GPU vLLM may take (KV capacity; default %(default)s)")
    deploy.add_argument("--device-memory-gib", type=float, help="one target GPU's memory (default: the curve "
                        "file's device_memory_bytes, or its device's data-sheet figure)")
    deploy.add_argument("--runtime-reserve-gib", type=float, default=DEFAULT_RUNTIME_RESERVE_BYTES / GIB,
                        help="per GPU, outside weights and KV: activations, CUDA graphs (an estimate; default "
                        "%(default)s)")
    deploy.add_argument("--no-kv-limit", action="store_true", help="leave KV capacity out (every load runs)")
    deploy.add_argument("--target-device", help=f"the target's GPU kind: one of {', '.join(DEVICES)} (default: the "
                        "curve file's device); another device's costs are a labelled roofline estimate")
    deploy.add_argument("--drafter-device", help=f"the drafter's own device (placement own): one of "
                        f"{', '.join(DEVICES)} (default: the curve file's device); another device's costs are a "
                        "labelled roofline estimate from the measured ones")
    deploy.add_argument("--drafter-curves", help="the drafter measured alone on its own device (`minedraft profile "
                        "--drafter-only`): the engine's drafter costs and device from it, instead of a roofline")
    deploy.add_argument("--rpc-round-trip-ms", type=float, default=DEFAULT_RPC_ROUND_TRIP_MS,
                        help="TP > 1: one round trip to the tensor-parallel workers; each step makes "
                        f"{TP_ROUND_TRIPS_PER_STEP} (execute, sample, a discarded draft-token fetch), added to its "
                        "host work (an estimate, default %(default)s)")
    deploy.add_argument("--prices", help="price table, minedraft-prices/v1 JSON (default: example prices, "
                        "labelled as such)")
    parser.add_argument("--max-tpot-ms", type=float, help="rate planning: only loads whose p50 time per output "
                        "token stays within this")
    parser.add_argument("--max-concurrency", type=int, default=256,
                        help="rate planning: the largest per-replica load swept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", help="write the regime map (PNG) here")
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")


def add_subcommands(sub: Any) -> None:
    parser = sub.add_parser("plan", help="which mode, k and how many replicas, from GPU cost curves (the twin)",
                            description=__doc__)
    add_arguments(parser)
    parser.set_defaults(func=cmd_plan)


def run_plan(args: argparse.Namespace) -> dict[str, Any]:
    from minedraft.engine.settings import MAX_LOOKAHEAD_FANOUT
    from minedraft.twin.plan import Band, parse_trace, plan_band
    from minedraft.twin.run import LookaheadOptions, Workload
    from minedraft.twin.sweep import SweepSettings, sweep

    given = [name for name in ("concurrency", "rate", "trace") if getattr(args, name)]
    if len(given) != 1:
        raise CurveError("load", "give exactly one of --concurrency, --rate or --trace")
    curves = load_curves(args.curves)
    target, drafter = pick_model(curves, "target", args.target), pick_model(curves, "drafter", args.drafter)
    prices = load_prices(args.prices) if args.prices else EXAMPLE_PRICES
    try:
        model = deployment_model(
            curves, target, drafter, _hardware(args, curves_on_cpu(curves)), prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens, prefill_ms_per_token=args.prefill_ms_per_token,
            gpu_memory_utilization=args.gpu_memory_utilization, device_memory_gib=args.device_memory_gib,
            runtime_reserve_bytes=int(args.runtime_reserve_gib * GIB), kv_limited=not args.no_kv_limit,
            target_device=args.target_device, drafter_device=args.drafter_device, prices=prices,
            drafter_curves=load_curves(args.drafter_curves, drafters_only=True) if args.drafter_curves else None,
            rpc_round_trip_ms=args.rpc_round_trip_ms)
    except ValueError as exc:
        if isinstance(exc, CurveError):
            raise
        raise CurveError(str(exc).split(":", 1)[0], str(exc).split(":", 1)[-1].strip()) from None
    costs = model.costs
    if args.acceptance_from:
        acceptance = acceptance_from_bench(Path(args.acceptance_from))
    else:
        acceptance = AcceptanceModel.parse(args.acceptance)
    ks = _ints("draft_lengths", args.draft_lengths) if args.draft_lengths else tuple(
        range(1, max(costs.drafter.measured_ks) + 1))
    try:
        workload = Workload(args.prompt_tokens, args.output_tokens)
    except ValueError as exc:
        raise CurveError("workload", str(exc)) from None
    families = tuple(f.strip() for f in args.modes.split(",") if f.strip())
    bands: list[Band] = []
    if args.concurrency:
        concurrencies = _ints("concurrency", args.concurrency)
    else:
        if args.rate:
            bands = [Band(None, rate) for rate in _floats("rate", args.rate)]
        else:
            try:
                bands = parse_trace(Path(args.trace).read_text())
            except OSError as exc:
                raise CurveError("trace", f"cannot read {args.trace}: {exc.strerror}") from None
            except ValueError as exc:
                raise CurveError("trace", str(exc)) from None
        concurrencies = tuple(c for c in DEFAULT_RATE_CONCURRENCIES if c <= args.max_concurrency) or (1,)
    try:
        fanout = args.lookahead_fanout
        if fanout is not None and not 1 <= fanout <= MAX_LOOKAHEAD_FANOUT:
            raise CurveError("lookahead_fanout", f"must be between 1 and {MAX_LOOKAHEAD_FANOUT}, got {fanout}")
        settings = SweepSettings(concurrencies=concurrencies, ks=ks, families=families, with_auto=not args.no_auto,
                                 workload=workload, seed=args.seed, confirm=args.confirm,
                                 lookahead=LookaheadOptions() if fanout is None else LookaheadOptions(fanout=fanout))
    except ValueError as exc:
        raise CurveError(str(exc).split(":", 1)[0], str(exc).split(":", 1)[-1].strip()) from None
    loads = model.sweep(acceptance, settings, sweep)
    result: dict[str, Any] = {"loads": [load.to_json() for load in loads]}
    model.annotate(result)
    # Additions to the first interface (tools reading `loads` are unaffected): what the figures assume.
    result["host_work"] = {"step_overhead_ms": costs.hardware.step_overhead_ms,
                           "vllm_async_scheduling": costs.hardware.vllm_async_scheduling, "note": HOST_WORK_NOTE}
    if costs.hardware.tensor_parallel_size > 1:  # what TP > 1 adds, from the code path (see twin.deploy)
        result["host_work"].update(tp_round_trips_per_step=TP_ROUND_TRIPS_PER_STEP,
                                   rpc_round_trip_ms=args.rpc_round_trip_ms)
    if bands:
        result["bands"] = [{**plan_band(loads, band, args.output_tokens, args.max_tpot_ms),
                            **model.price_band(loads, band, args.output_tokens, args.max_tpot_ms)} for band in bands]
    if args.plot:
        from minedraft.twin.plot import regime_map

        hardware = costs.hardware
        regime_map(loads, Path(args.plot), title=f"{target} + {drafter}, {curves.device}, "
                   f"TP={hardware.tensor_parallel_size}, drafter {hardware.drafter_placement}")
    extrapolated = sorted(costs.extrapolations(max(concurrencies), args.prompt_tokens + args.output_tokens, ks))
    if extrapolated:
        print(f"plan: beyond the measured grid in {', '.join(extrapolated)} (extrapolated linearly from the nearest "
              "measurements)", file=sys.stderr)
    return result


def cmd_plan(args: argparse.Namespace) -> int:
    result = run_plan(args)
    if args.json:
        print(json.dumps(result))
        return 0
    print(render(result))
    return 0


def describe(label: str, mode: dict[str, Any] | None = None) -> str:
    """A mode label for people: plain vLLM is not the engine at all; lookahead with its fan-out and hit rate."""
    if label == "vllm-ar":
        return "plain vLLM (vllm-ar)"
    if mode is not None and "fanout" in mode:
        return f"{label} (F={mode['fanout']:g}, hits {mode['branch_hit_rate']:.2f})"
    return label


def _kinds(devices: dict[str, float]) -> str:
    return " + ".join(f"{count:g} {kind}" for kind, count in devices.items())


def render(result: dict[str, Any]) -> str:
    host = result.get("host_work")
    lines = [f"Host work per step: {host['step_overhead_ms']:g} ms; {host['note']}.", ""] if host else []
    lines += ["| concurrency | fastest fixed mode | tok/s | most tok/s per GPU | tok/s/GPU | auto runs | auto tok/s |",
              "|---|---|---|---|---|---|---|"]
    for load in result["loads"]:
        modes = {label: m for label, m in load["modes"].items() if label != "auto"}
        fastest = max(modes, key=lambda label: modes[label]["tokens_per_s"])
        thrifty = max(modes, key=lambda label: modes[label]["tokens_per_s_per_gpu"])
        auto = load["modes"].get("auto")
        auto_runs = (f"{auto['mode']}" + (f" k={auto['k']}" if auto["mode"] != "ar" else "")) if auto else "-"
        auto_rate = f"{auto['tokens_per_s']:.0f}" if auto else "-"
        lines.append(f"| {load['concurrency']} | {describe(fastest, modes[fastest])} | "
                     f"{modes[fastest]['tokens_per_s']:.0f} | {describe(thrifty, modes[thrifty])} | "
                     f"{modes[thrifty]['tokens_per_s_per_gpu']:.0f} | {auto_runs} | {auto_rate} |")
    for band in result.get("bands", []):
        run = band["run"]
        lines.append("")
        lines.append(f"{band['requests_per_s']:g} requests/s ({band['demand_tokens_per_s']:.0f} output tokens/s):")
        if run is None:
            lines.append("  no measured load serves it within the limits")
            continue
        lines.append(f"  run {describe(run['mode'])}: {run['replicas']} replica(s), {run['gpus']} GPUs, "
                     f"{run['tokens_per_s_per_gpu']:.0f} tok/s per GPU, ~{run['concurrency_per_replica']:.0f} requests "
                     "in flight per replica")
        for family, choice in band["by_family"].items():
            if choice is not None:
                lines.append(f"    {family:8s} best {choice['mode']}: {choice['replicas']} replica(s), "
                             f"{choice['gpus']} GPUs, {choice['tokens_per_s_per_gpu']:.0f} tok/s per GPU")
        cheapest = band.get("recommended")
        if cheapest:
            lines.append(f"  cheapest: {describe(cheapest['mode'])} ({cheapest['placement']}), "
                         f"${cheapest['usd_per_million_tokens']:.3f} per million tokens, {cheapest['replicas']} "
                         f"replica(s) on {_kinds(cheapest['gpus_by_kind'])}, p50 TPOT {cheapest['tpot_ms_p50']} ms")
            for family, d in band.get("deployments", {}).items():
                lines.append(f"    {family:9s} {d['mode']}: ${d['usd_per_million_tokens']:.3f}/M tokens, holds "
                             f"{d['max_concurrency']} requests per replica, {_kinds(d['gpus_by_kind'])}, "
                             f"{d['tokens_per_s_per_target_gpu']:.0f} tok/s per target GPU")
    return "\n".join(lines)
