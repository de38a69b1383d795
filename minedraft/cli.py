"""The `minedraft` command: one CLI, subcommands. Machine-readable output goes to stdout, logs to stderr."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import time
from pathlib import Path

# vLLM logs to stdout unless told otherwise; `--json` output must stay clean. Set before vLLM is imported.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


from minedraft.engine_options import (
    _cores,
    _pair_dir,
    add_engine_arguments,
    constructed_pair,
    ensure_pair,
    settings_from_args,
)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

__all__ = ["add_engine_arguments", "build_parser", "constructed_pair", "ensure_pair", "main", "settings_from_args"]


# -- models --------------------------------------------------------------------------------------------------------


def cmd_models_build(args: argparse.Namespace) -> int:
    from minedraft.models.build import build_pair
    from minedraft.models.spec import PAIR_NAME, cache_root

    out = Path(args.output) if args.output else cache_root() / "models" / PAIR_NAME
    report = build_pair(out, threads=args.threads)
    print(json.dumps(report, indent=2))
    return 0


def cmd_models_build_constructed(args: argparse.Namespace) -> int:
    from minedraft.models.constructed import ConstructedRecipe, build_constructed_pair, constructed_pair_dir
    from minedraft.models.spec import cache_root

    out = Path(args.output) if args.output else constructed_pair_dir(cache_root(), args.acceptance)
    report = build_constructed_pair(out, ensure_pair(_pair_dir(args.pair)) / "target",
                                    ConstructedRecipe(acceptance=args.acceptance))
    print(json.dumps({"output": str(out), **report}, indent=2))
    return 0


def cmd_models_check(args: argparse.Namespace) -> int:
    from minedraft.models.check import check_pair

    pair_dir = ensure_pair(_pair_dir(args.pair))
    report = check_pair(pair_dir, with_vllm=not args.no_vllm)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    acceptance = report["acceptance"]
    print(f"pair: {pair_dir}")
    print(f"greedy acceptance at k={acceptance['num_speculative_tokens']} on {acceptance['num_prompts']} "
          f"held-out prompts: {acceptance['acceptance_rate']:.3f} "
          f"(mean accepted length {acceptance['mean_accepted_length']:.2f} tokens per verification)")
    print(f"target/draft cost ratio: {report['cost_ratio']:.2f}x "
          f"({report['target_forward_seconds'] * 1000:.1f} ms vs {report['draft_forward_seconds'] * 1000:.1f} ms "
          f"per forward of 8x128 tokens; {report['target_params']:,} vs {report['draft_params']:,} parameters)")
    for role, result in report.get("vllm", {}).items():
        print(f"vLLM {role}: loaded in {result['load_seconds']}s, generated {result['num_tokens']} tokens: "
              f"{result['prompt']!r} -> {result['completion']!r}")
    ok = 0.5 <= acceptance["acceptance_rate"] <= 0.9
    print("acceptance within 0.5-0.9: " + ("yes" if ok else "NO"))
    return 0 if ok else 1


# -- generate / run ------------------------------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    from minedraft.engine.core import Engine
    from minedraft.engine.requests import Completion, SamplingSettings

    settings = settings_from_args(args)
    prompts = [line.rstrip("\n") for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    sampling_base = SamplingSettings(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed_request)
    sampling_base.validate()
    engine = Engine(settings)
    try:
        engine.wait_for_drafter()
        completions: dict[str, Completion] = {}
        for index, prompt in enumerate(prompts):
            request_id = f"prompt-{index}"
            seed = None if args.seed_request is None else args.seed_request + index
            sampling = SamplingSettings(max_tokens=args.max_tokens, temperature=args.temperature, seed=seed)
            engine.add_request(request_id, engine.encode_prompt(prompt), sampling)
            completions[request_id] = Completion(request_id)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                completions[delta.request_id].add(delta)
        for index in range(len(prompts)):
            c = completions[f"prompt-{index}"]
            print(json.dumps({"index": index, "token_ids": c.token_ids, "text": c.text,
                              "finish_reason": c.finish_reason}), flush=True)
    finally:
        engine.shutdown()
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Stream one completion from the local pair to the terminal (the README's quick start)."""
    import asyncio

    from minedraft.engine.async_engine import AsyncEngine
    from minedraft.engine.requests import SamplingSettings

    settings = settings_from_args(args)

    async def main() -> None:
        print(f"starting the {settings.mode.value} engine (target {settings.model}) ...", file=sys.stderr)
        engine = await AsyncEngine.create(settings)
        try:
            started = time.perf_counter()
            print(args.prompt, end="", flush=True)
            final = None
            async for delta in engine.generate(args.prompt, SamplingSettings(max_tokens=args.max_tokens)):
                print(delta.text, end="", flush=True)
                final = delta
            elapsed = time.perf_counter() - started
            print()
            if final is not None:
                rate = final.num_accepted_tokens / final.num_draft_tokens if final.num_draft_tokens else 0.0
                print(f"[{final.num_output_tokens} tokens in {elapsed:.2f}s, finish: {final.finish_reason}, "
                      f"drafted {final.num_draft_tokens}, accepted {final.num_accepted_tokens} ({rate:.0%})]",
                      file=sys.stderr)
        finally:
            await engine.shutdown()

    asyncio.run(main())
    return 0


# -- bench ---------------------------------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    if not args.json:
        # Optional only so that `minedraft bench steps|stall` (which write their own files) parse without it.
        print("minedraft bench: error: the following arguments are required: --json (or a subcommand: "
              f"{', '.join(BENCH_SUBCOMMANDS)})", file=sys.stderr)
        return 2
    from minedraft.bench.runner import BenchConfig, run_bench, write_outputs
    from minedraft.bench.workload import bench_prompts
    from minedraft.engine.settings import Mode, SettingsError

    settings = settings_from_args(args)
    pair_dir = ensure_pair(_pair_dir(args.pair))
    modes = [Mode.parse(m.strip()) for m in args.modes.split(",") if m.strip()]
    concurrencies = [int(c) for c in str(args.concurrency).split(",")]
    if args.trace:
        from minedraft.bench.workload import Trace

        try:
            trace = Trace.parse(args.trace, ["x"], args.max_tokens)
        except ValueError as exc:
            raise SettingsError("trace", str(exc)) from None
        concurrencies_needed = [*concurrencies, *(p.concurrency for p in trace.phases)]
    else:
        concurrencies_needed = concurrencies
    needed_prompts = max(args.num_prompts, args.requests_per_concurrency * max(concurrencies))
    if args.constructed_acceptance is not None:
        regime = args.regime or "cost-realistic (constructed 12 x 1024 float32 target, 2 x 256 draft)"
        source = f"constructed weights, per-position acceptance {args.constructed_acceptance} (lossless)"
    else:
        regime = args.regime or "local trained pair"
        source = "real (trained pair)"
    config = BenchConfig(
        base=settings.with_changes(max_num_seqs=max(max(concurrencies_needed), settings.max_num_seqs)),
        modes=modes,
        concurrencies=concurrencies,
        prompts=bench_prompts(pair_dir, needed_prompts),
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        baseline_cpu_cores=_cores(args.baseline_cores, tuple(sorted(os.sched_getaffinity(0)))),
        requests_per_concurrency=args.requests_per_concurrency,
        min_requests=args.min_requests,
        trace=args.trace,
        labels={"regime": regime, "acceptance_source": source,
                "command": "minedraft " + " ".join(sys.argv[1:])},
    )
    report = run_bench(config)
    write_outputs(report, Path(args.json))
    print(Path(args.json).with_suffix(".md").read_text(), file=sys.stderr)
    return 0 if report["greedy_outputs_identical"] else 3


# `minedraft bench NAME`: module under minedraft.bench with add_arguments(parser) and run(args, command) -> exit code.
BENCH_SUBCOMMANDS = {
    "steps": "where a decode step's time goes at 32 requests and long contexts (forward, engine work, waits, overlap)",
    "stall": "inter-token gaps of every stream while the drafter is SIGSTOPped, and the hung-drafter restart path",
}


def recorded_command(argv: list[str]) -> str:
    """The command line a result records: without --log-level, which changes what is printed, not what is measured
    (so the command that regenerates a result matches it however the run was logged)."""
    kept: list[str] = []
    skip_value = False
    for arg in argv:
        if skip_value:
            skip_value = False
        elif arg == "--log-level":
            skip_value = True
        elif not arg.startswith("--log-level="):
            kept.append(arg)
    return "minedraft " + " ".join(kept)


def cmd_bench_module(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"minedraft.bench.{args.bench_command}")
    return int(module.run(args, command=recorded_command(args.argv)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minedraft", description=__doc__)
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                        default=os.environ.get("MINEDRAFT_LOG_LEVEL", "INFO").upper(),
                        help="for MineDraft's logs and vLLM's (the engine, its workers and the drafter process)")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="the local target/draft model pair").add_subparsers(
        dest="models_command", required=True)
    build = models.add_parser("build", help="train the tokenizer, target and distilled draft")
    build.add_argument("--output", help="directory (default: the user cache)")
    build.add_argument("--threads", type=int)
    build.set_defaults(func=cmd_models_build)
    check = models.add_parser("check", help="measure acceptance and cost ratio; load both in vLLM")
    check.add_argument("--pair")
    check.add_argument("--no-vllm", action="store_true")
    check.add_argument("--json", action="store_true")
    check.set_defaults(func=cmd_models_check)
    constructed = models.add_parser(
        "build-constructed", help="the cost-realistic pair: a 160M float32 target and a draft whose per-position "
        "acceptance is fixed by construction (no training)")
    constructed.add_argument("--acceptance", type=float, default=0.8)
    constructed.add_argument("--output", help="directory (default: the user cache)")
    constructed.add_argument("--pair", help="local pair whose tokenizer to use")
    constructed.set_defaults(func=cmd_models_build_constructed)

    gen = sub.add_parser("generate", help="one JSON line per prompt of a file")
    add_engine_arguments(gen)
    gen.add_argument("--prompts-file", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed-request", type=int, dest="seed_request",
                     help="per-request sampling seed (request i uses seed + i)")
    gen.add_argument("--json", action="store_true", help="JSON lines on stdout (the only output format)")
    gen.set_defaults(func=cmd_generate)

    run = sub.add_parser("run", help="stream a completion from the local pair")
    add_engine_arguments(run)
    run.add_argument("--prompt", default="def parse_args(argv):\n")
    run.add_argument("--max-tokens", type=int, default=96)
    run.set_defaults(func=cmd_run)

    bench = sub.add_parser("bench", help="modes side by side on the same prompts")
    add_engine_arguments(bench)
    bench.add_argument("--modes", default="ar,vllm-sd,sd,psd")
    bench.add_argument("--concurrency", default="16", help="one value or a comma-separated list")
    bench.add_argument("--num-prompts", type=int, default=64)
    bench.add_argument("--max-tokens", type=int, default=64)
    bench.add_argument("--rounds", type=int, default=2)
    bench.add_argument("--baseline-cores", help="cores for ar and vllm-sd (default: all this process may use)")
    bench.add_argument("--requests-per-concurrency", type=int, default=0,
                       help="run max(--min-requests, this x concurrency) requests per load instead of --num-prompts")
    bench.add_argument("--min-requests", type=int, default=4)
    bench.add_argument("--trace", help="also run a load that changes over time: phases C:N,C:N,... (N requests at "
                       "concurrency C each, back to back)")
    bench.add_argument("--regime", help="label for the results (default: from the model pair)")
    bench.add_argument("--json", help="output JSON path (.md and .png written beside it); required without a "
                       "subcommand")
    bench.set_defaults(func=cmd_bench)
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="{" + ",".join(BENCH_SUBCOMMANDS) + "}",
                                     help="other engine benchmarks (without one: modes side by side)")
    for name, help_text in BENCH_SUBCOMMANDS.items():
        sub_parser = bench_sub.add_parser(name, help=help_text, description=help_text)
        # Light imports only at parse time: the modules import the engine inside run().
        importlib.import_module(f"minedraft.bench.{name}").add_arguments(sub_parser)
        sub_parser.set_defaults(func=cmd_bench_module)
    importlib.import_module("minedraft.operator.cli").add_subcommands(sub)  # operator: run, render, crd
    importlib.import_module("minedraft.operator.autoscale.cli").add_subcommands(sub)  # autoscale simulate, compare
    importlib.import_module("minedraft.server.cli").add_subcommands(sub)  # serve
    importlib.import_module("minedraft.server.drafter_cli").add_subcommand(sub)  # drafter (shared service)
    importlib.import_module("minedraft.gateway.cli").add_subcommands(sub)  # gateway, bench-gateway
    importlib.import_module("minedraft.client").add_subcommands(sub)  # client generate
    importlib.import_module("minedraft.doctor").add_subcommands(sub)  # doctor
    importlib.import_module("minedraft.profile.cli").add_subcommands(sub)  # profile (torch only)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded in benchmark results
    # vLLM configures its own loggers from VLLM_LOGGING_LEVEL when it is first imported (here or in a worker or
    # drafter process, which inherit the environment), so basicConfig alone would leave its INFO lines on.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", args.log_level)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from minedraft.engine.requests import RequestError
    from minedraft.engine.settings import SettingsError

    try:
        return int(args.func(args))
    except (SettingsError, RequestError) as exc:
        print(f"minedraft: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
