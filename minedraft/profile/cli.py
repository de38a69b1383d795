"""`minedraft profile` (and `python -m minedraft.profile`, the same command without the rest of the CLI's imports,
for machines that have torch and the repository's files only)."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from minedraft.profile import curves
from minedraft.profile.architecture import ArchitectureError, preset_names
from minedraft.profile.runner import ProfileSettings, grid_from, run_profile
from minedraft.profile.settings import TimingSettings
from minedraft.profile.shapes import SHAPE_PRESETS

HELP = ("measure cost curves (forward and draft-loop times by batch, context and tokens) for a model pair's "
        "architecture on this device, random weights; writes a minedraft-cost-curves/v1 file")


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    presets = ", ".join(preset_names())
    parser.add_argument("--target", default="pair-v1-target",
                        help=f"preset ({presets}), a config.json or model directory, or NAME=PATH")
    parser.add_argument("--drafter", action="append", dest="drafters",
                        help="as --target; repeat for several drafters (default: pair-v1-draft)")
    parser.add_argument("--shapes", default="cpu-small", choices=sorted(SHAPE_PRESETS),
                        help="shape grid: gpu (the H200 file's grid), cpu-small (the local pair on a CPU), tiny "
                             "(tests)")
    parser.add_argument("--batches", type=_ints, help="override the grid's batch sizes (comma-separated)")
    parser.add_argument("--contexts", type=_ints, help="override the grid's context lengths")
    parser.add_argument("--ks", type=_ints, help="override the grid's draft lengths")
    parser.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="weights and KV cache; auto = bfloat16 on CUDA, float32 on a CPU")
    parser.add_argument("--eager", action="store_true", help="on CUDA: no CUDA graphs")
    parser.add_argument("--drafter-only", action="store_true",
                        help="measure the drafters alone (on a device of their own; the target runs elsewhere): "
                        "the file keeps the target's shape without times, for `minedraft plan --drafter-curves`")
    parser.add_argument("--no-concurrent", action="store_true",
                        help="on CUDA: skip target + drafter on two streams")
    parser.add_argument("--repeats", type=int, default=3, help="timed blocks per measurement (median)")
    parser.add_argument("--replays", type=int, default=None,
                        help="calls per timed block (default 10 with CUDA graphs, 3 eager)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--min-block-ms", type=float, default=50.0,
                        help="eager timing: blocks of calls last at least this long (averages over a shared CPU's "
                             "time slices); 0: exactly --replays calls")
    parser.add_argument("--timeout-s", type=float, default=60.0, dest="timeout_s",
                        help="per measurement, enforced by killing its worker process")
    parser.add_argument("--setup-timeout-s", type=float, default=300.0, help="per worker: start, build the models")
    parser.add_argument("--budget-s", type=float, help="whole run; measurements left when it is spent are recorded "
                        "under timeouts (during: budget)")
    parser.add_argument("--threads", type=int, help="torch threads in the worker (CPU)")
    parser.add_argument("--output", "-o", help="cost-curve file to write (without it, the JSON goes to stdout)")
    parser.add_argument("--json", action="store_true", help="print the document on stdout (also with --output)")
    parser.add_argument("--plot", action="store_true", help="also draw the curves beside --output (.png)")


def _device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def settings_from_args(args: argparse.Namespace, command: str) -> ProfileSettings:
    if args.plot and not args.output:
        raise ValueError("plot: needs --output (the picture is written beside it)")
    device = _device(args.device)
    if not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
        raise ArchitectureError("device", f"expected auto, cpu, cuda or cuda:N, got {args.device!r}")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    graphs = device.startswith("cuda") and not args.eager
    replays = args.replays if args.replays is not None else (10 if graphs else 3)
    return ProfileSettings(
        target=args.target, drafters=tuple(args.drafters or ["pair-v1-draft"]),
        grid=grid_from(args.shapes, args.batches, args.contexts, args.ks),
        device=device, dtype=dtype, eager=args.eager, concurrent=not args.no_concurrent,
        timing=TimingSettings(repeats=args.repeats, replays=replays, warmup=args.warmup,
                              min_block_ms=args.min_block_ms if not graphs else 0.0),
        setup_timeout_s=args.setup_timeout_s, measurement_timeout_s=args.timeout_s, budget_s=args.budget_s,
        threads=args.threads, command=command, drafter_only=args.drafter_only)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    # An outer `timeout` sends SIGTERM: leave through the `finally` blocks, which kill the worker's process group
    # (a worker leads its own session, so it would otherwise outlive us and keep the GPU).
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace, command: str) -> int:
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _run(args, command)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace, command: str) -> int:
    try:
        settings = settings_from_args(args, command)
        checkpoint = (lambda doc: curves.write(doc, Path(args.output))) if args.output else None
        doc: dict[str, Any] = run_profile(settings, log=lambda line: print(line, file=sys.stderr, flush=True),
                                          checkpoint=checkpoint)
    except (ArchitectureError, ValueError) as exc:
        print(f"minedraft profile: error: {exc}", file=sys.stderr)
        return 2
    if args.output:
        curves.write(doc, Path(args.output))
        print(f"wrote {args.output}", file=sys.stderr)
        if args.plot:
            from minedraft.profile.plot import plot

            plot(doc, Path(args.output).with_suffix(".png"))
            print(f"wrote {Path(args.output).with_suffix('.png')}", file=sys.stderr)
    if args.json or not args.output:
        sys.stdout.write(curves.dumps(doc))
    measured = sum(len(m["forward_ms"]) + len(m.get("draft_loop_ms", [])) for m in doc["models"].values())
    return 0 if measured else 1


def _cmd(args: argparse.Namespace) -> int:
    return run(args, command="minedraft " + " ".join(getattr(args, "argv", sys.argv[1:])))


def add_subcommands(sub: Any) -> None:
    parser = sub.add_parser("profile", help=HELP, description=HELP)
    add_arguments(parser)
    parser.set_defaults(func=_cmd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minedraft.profile", description=HELP)
    add_arguments(parser)
    args = parser.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    return run(args, command="minedraft profile " + " ".join(argv))
