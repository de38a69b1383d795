"""The engine's step time with 64 streaming gRPC clients against no servers, engine in-process against in its own.

Four scenarios in one run, on one local pair and one load (64 requests at once, greedy, `--max-tokens` each with
ignore_eos so every request runs the same length):
- in-process, direct:   AsyncEngine (the step loop on a thread of this process), the requests driven in-process;
- in-process, grpc:     the same engine behind the engine's gRPC server (EngineServer, metrics export on), 64
                        streaming clients in another process;
- engine process, direct / grpc: the same two over EngineProcess (the engine core in a spawned process).
The target computes on its own cores; the servers and the clients on the drafter's (idle: the steps run ar), as on a
GPU host where the servers have cores of their own: between the servers and the engine's loop there is then only the
GIL (in-process) or nothing (engine process).
Both engines are loaded at once; every round runs the four scenarios in a rotating order. Per scenario: the p90 of
the scheduler's step time (StepRecord.step_seconds: schedule to update) and of the wall time between consecutive
steps' starts (everything the loop does per step: output processing, detokenisation where the engine does it
(in-process only: an engine process's front end detokenises), handing out deltas, and waiting for the GIL): each
round's p90, the quietest round's and the median over rounds. The figure of interest is the ratio grpc / direct per
front end: how much serving 64 streams slows the engine's steps.

Usage (from the repository root): python benchmarks/engine_process.py [--rounds 12] [--max-tokens 32]
Writes benchmarks/results/step-breakdown/engine-process.{json,md}. On a machine shared with other jobs the absolute
figures move; the ratios within one run hold up better.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "results" / "step-breakdown" / "engine-process"
CONCURRENCY = 64


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def grpc_clients(target: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """In a process of its own: every prompt as one streaming Generate at once; tokens received and the time."""
    import grpc

    from minedraft.api import pb, pb_grpc

    async def run() -> dict[str, Any]:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.GenerationStub(channel)

            async def one(index: int, prompt: list[int]) -> tuple[int, int]:
                request = pb.GenerateRequest(prompt_token_ids=prompt, request_id=f"bench-{index}",
                                             sampling_params=pb.SamplingParams(max_tokens=max_tokens,
                                                                               ignore_eos=True))
                tokens = messages = 0
                async for response in stub.Generate(request, timeout=600):
                    tokens += len(response.token_ids)
                    messages += 1
                return tokens, messages

            started = time.perf_counter()
            counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            return {"seconds": time.perf_counter() - started, "tokens": sum(t for t, _ in counts),
                    "messages": sum(m for _, m in counts)}

    return asyncio.run(run())


async def drive_direct(engine: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from minedraft.engine.requests import SamplingSettings

    sampling = SamplingSettings(max_tokens=max_tokens, ignore_eos=True)

    async def one(prompt: list[int]) -> tuple[int, int]:
        tokens = messages = 0
        async for delta in engine.generate(prompt, sampling):
            tokens += len(delta.token_ids)
            messages += 1
        return tokens, messages

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    return {"seconds": time.perf_counter() - started, "tokens": sum(t for t, _ in counts),
            "messages": sum(m for _, m in counts)}


async def drive_grpc(engine: Any, prompts: list[list[int]], max_tokens: int,
                     pool: ProcessPoolExecutor) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry

    from minedraft.server.app import EngineServer

    # As `minedraft serve` runs it: health, the engine-loop check and the metrics export polling the engine.
    server = EngineServer(replica_id="bench", registry=CollectorRegistry())
    port = await server.start("127.0.0.1:0")
    await server.attach(engine)
    try:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, grpc_clients, f"127.0.0.1:{port}", prompts, max_tokens)
    finally:
        await server.stop()


def summarize(runs: list[list[Any]]) -> dict[str, Any]:
    """Step times and intervals pooled over runs (an interval never spans two runs)."""
    steps = [r.step_seconds * 1e3 for records in runs for r in records]
    gaps = [(b.started_at - a.started_at) * 1e3 for records in runs for a, b in itertools.pairwise(records)]
    return {"steps": len(steps),
            "step_ms_p50": round(_percentile(steps, 0.5), 3), "step_ms_p90": round(_percentile(steps, 0.9), 3),
            "step_ms_mean": round(statistics.fmean(steps), 3) if steps else 0.0,
            "interval_ms_p50": round(_percentile(gaps, 0.5), 3), "interval_ms_p90": round(_percentile(gaps, 0.9), 3),
            "interval_ms_mean": round(statistics.fmean(gaps), 3) if gaps else 0.0}


async def run_scenario(engine: Any, scenario: str, prompts: list[list[int]], max_tokens: int,
                       pool: ProcessPoolExecutor) -> tuple[dict[str, Any], list[Any]]:
    """One run of the load; its result and the step records of its steps."""
    from minedraft.engine import calls

    before = await engine.call(calls.step_records)
    first = before[-1].step if before else 0
    run = (await drive_direct(engine, prompts, max_tokens) if scenario == "direct"
           else await drive_grpc(engine, prompts, max_tokens, pool))
    records = [r for r in await engine.call(partial(calls.step_records, since_step=first)) if r.step > first]
    run["steps"] = len(records)
    run.update({k: v for k, v in summarize([records]).items() if k != "steps"})
    return run, records


async def measure(settings: Any, prompts_text: list[str], args: argparse.Namespace, pool: ProcessPoolExecutor,
                  server_cores: tuple[int, ...]) -> dict[str, Any]:
    """Both engines loaded at once (one computes at a time), every round running all four scenarios in a rotating
    order: a machine whose load drifts (other jobs) shifts them alike."""
    from minedraft.engine import calls
    from minedraft.engine.async_engine import AsyncEngine
    from minedraft.engine.engine_process import EngineProcess
    from minedraft.engine.requests import encode_prompt
    from minedraft.engine.settings import Mode

    engines: dict[str, Any] = {}
    try:
        print("loading the in-process engine ...", file=sys.stderr, flush=True)
        engines["in-process"] = await AsyncEngine.create(settings)
        print("loading the engine process ...", file=sys.stderr, flush=True)
        engines["engine-process"] = await EngineProcess.create(settings)
        # The servers (this thread, and the gRPC threads each server starts from it) compute on cores of their own,
        # as on a GPU host: what is left between them and the engine is the GIL (in-process) or nothing.
        os.sched_setaffinity(0, server_cores)
        any_engine = engines["in-process"]
        prompts = [encode_prompt(any_engine.tokenizer, p, any_engine.vocab_size, any_engine.max_model_len)
                   for p in prompts_text]
        scenarios = [(front_end, scenario) for front_end in engines for scenario in ("direct", "grpc")]
        for engine in engines.values():
            await engine.call(partial(calls.set_mode, mode=Mode(args.mode), k=args.k))
        # Warm-up: the full load once per engine and path (first compilations and allocations at these shapes).
        for front_end, scenario in scenarios:
            await run_scenario(engines[front_end], scenario, prompts, args.max_tokens, pool)
        records: dict[tuple[str, str], list[list[Any]]] = {key: [] for key in scenarios}
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {key: [] for key in scenarios}
        for round_index in range(args.rounds):
            order = scenarios[round_index % len(scenarios):] + scenarios[:round_index % len(scenarios)]
            for front_end, scenario in order:
                run, run_records = await run_scenario(engines[front_end], scenario, prompts, args.max_tokens, pool)
                records[front_end, scenario].append(run_records)
                runs[front_end, scenario].append(run)
                print(f"round {round_index + 1}/{args.rounds} {front_end} {scenario}: {run['tokens']} tokens in "
                      f"{run['seconds']:.2f} s, {run['steps']} steps, step p90 {run['step_ms_p90']:.1f} ms, "
                      f"interval p90 {run['interval_ms_p90']:.1f} ms", file=sys.stderr, flush=True)
    finally:
        for engine in engines.values():
            await engine.shutdown()
    results: dict[str, Any] = {}
    for (front_end, scenario), scenario_runs in runs.items():
        results.setdefault(front_end, {})[scenario] = {
            **summarize(records[front_end, scenario]),
            # Robust to a burst of load from other jobs: the median over rounds of each round's p90.
            "median_run_step_ms_p90": round(statistics.median(r["step_ms_p90"] for r in scenario_runs), 3),
            "median_run_interval_ms_p90": round(statistics.median(r["interval_ms_p90"] for r in scenario_runs), 3),
            # The quietest round's: on a machine other jobs load in bursts, the closest to the path's own cost.
            "best_run_step_ms_p90": round(min(r["step_ms_p90"] for r in scenario_runs), 3),
            "best_run_interval_ms_p90": round(min(r["interval_ms_p90"] for r in scenario_runs), 3),
            "output_tokens_per_s": round(sum(r["tokens"] for r in scenario_runs)
                                         / sum(r["seconds"] for r in scenario_runs), 1),
            "runs": scenario_runs}
    return results


def markdown(report: dict[str, Any]) -> str:
    config = report["config"]
    lines = ["# The engine's step time with 64 streaming gRPC clients, engine in-process vs in its own process", "",
             f"Command: `{config['command']}`  ",
             f"Local pair, mode {config['mode']}, {CONCURRENCY} requests at once, {config['max_tokens']} tokens each "
             f"(ignore_eos), {config['rounds']} rounds of all four in a rotating order; {config['machine']} "
             f"(load average {config['load_average_at_start']:.1f} at start).", "",
             f"Target on cores {config['cores']['target']}, servers and clients on "
             f"{config['cores']['servers_and_clients']} (the drafter's, idle in ar).", "",
             "step = the scheduler's step time (schedule to update); interval = wall time between consecutive steps' "
             "starts (the whole loop turn: output processing, detokenisation (in-process only: an engine process's "
             "front end detokenises), deltas out, GIL waits).", "",
             "Per scenario, each round's p90: the quietest round's (best; on a machine other jobs load in bursts, the "
             "closest to the path's own cost) and the median over rounds.", "",
             "| engine | clients | steps | step p90 ms best | step p90 ms median | interval p90 ms best | "
             "interval p90 ms median | output tok/s |", "|---|---|---|---|---|---|---|---|"]
    for front_end, scenarios in report["results"].items():
        for scenario, s in scenarios.items():
            lines.append(f"| {front_end} | {scenario} | {s['steps']} | {s['best_run_step_ms_p90']:.1f} | "
                         f"{s['median_run_step_ms_p90']:.1f} | {s['best_run_interval_ms_p90']:.1f} | "
                         f"{s['median_run_interval_ms_p90']:.1f} | {s['output_tokens_per_s']:.0f} |")
    lines += ["", "Ratios grpc / direct on the same engine (1.0: serving the streams costs the steps nothing):", "",
              "| engine | step p90 best | interval p90 best | step p90 median | interval p90 median | output tok/s |",
              "|---|---|---|---|---|---|"]
    for front_end, ratio in report["ratios"].items():
        lines.append(f"| {front_end} | {ratio['best_step_p90']:.2f} | {ratio['best_interval_p90']:.2f} | "
                     f"{ratio['step_p90']:.2f} | {ratio['interval_p90']:.2f} | {ratio['output_tokens_per_s']:.2f} |")
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace, command: str) -> dict[str, Any]:
    from minedraft.bench.workload import bench_prompts
    from minedraft.engine.settings import DrafterSettings, EngineSettings, Mode, default_core_split
    from minedraft.models.spec import default_pair_dir

    pair = Path(args.pair_dir) if args.pair_dir else default_pair_dir()
    target_cores, drafter_cores = default_core_split()
    settings = EngineSettings(
        model=str(pair / "target"),
        drafter=DrafterSettings(model=str(pair / "draft"), cpu_cores=drafter_cores, kv_cache_gib=1, backend="torch"),
        mode=Mode.PSD, num_speculative_tokens=args.k, max_num_seqs=CONCURRENCY, max_model_len=512, kv_cache_gib=1,
        # The target stays on its own cores: widened onto the drafter's, its OpenMP threads wait on each other
        # whenever another job preempts one of them, and that (not the servers) would dominate the step times.
        target_cpu_cores=target_cores, lend_drafter_cores=False)
    prompts = bench_prompts(pair, CONCURRENCY, chars=args.prompt_chars)
    report: dict[str, Any] = {"config": {"command": command, "mode": args.mode, "k": args.k, "rounds": args.rounds,
                                         "max_tokens": args.max_tokens, "concurrency": CONCURRENCY,
                                         "prompt_chars": args.prompt_chars, "pair_dir": str(pair),
                                         "machine": "shared 2-core CPU, contended by other jobs",
                                         "cores": {"target": target_cores, "servers_and_clients": drafter_cores},
                                         "load_average_at_start": os.getloadavg()[0]},
                              "results": {}}
    # The clients' process starts once, before anything is timed.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=os.sched_setaffinity,
                             initargs=(0, drafter_cores)) as pool:
        pool.submit(os.getpid).result()
        report["results"] = await measure(settings, prompts, args, pool, drafter_cores)

    def ratio(s: dict[str, Any], key: str) -> float:
        return float(s["grpc"][key] / s["direct"][key])

    report["ratios"] = {
        front_end: {"best_step_p90": ratio(s, "best_run_step_ms_p90"),
                    "best_interval_p90": ratio(s, "best_run_interval_ms_p90"),
                    "step_p90": ratio(s, "median_run_step_ms_p90"),
                    "interval_p90": ratio(s, "median_run_interval_ms_p90"),
                    "pooled_step_p90": ratio(s, "step_ms_p90"),
                    "pooled_interval_p90": ratio(s, "interval_ms_p90"),
                    "output_tokens_per_s": ratio(s, "output_tokens_per_s")}
        for front_end, s in report["results"].items()}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--mode", default="ar", choices=("ar", "sd", "psd"),
                        help="the mode the steps run (ar: no drafter noise in the step times)")
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--prompt-chars", type=int, default=160)
    parser.add_argument("--pair-dir", help="the local pair (default: the committed copy or the cache)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    command = "python benchmarks/engine_process.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = asyncio.run(main_async(args, command.strip()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
