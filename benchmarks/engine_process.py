"""The engine's step time with 64 streaming gRPC clients against no servers, engine in-process against in its own.

Four scenarios in one run, on one local pair and one load (64 requests at once, greedy, `--max-tokens` each with
ignore_eos so every request runs the same length):
- in-process, direct:   AsyncEngine (the step loop on a thread of this process), the requests driven in-process;
- in-process, grpc:     the same engine behind the engine's gRPC server (EngineServer, metrics export on), 64
                        streaming clients in another process;
- engine process, direct / grpc: the same two over EngineProcess (the engine core in a spawned process).
Rounds interleave direct and grpc. Per scenario: the p50/p90 of the scheduler's step time (StepRecord.step_seconds:
schedule to update) and of the wall time between consecutive steps' starts (everything the loop does per step:
output processing, detokenisation, handing out deltas, and waiting for the GIL). The figure of interest is the ratio
grpc / direct per front end: how much serving 64 streams slows the engine's steps.

Usage (from the repository root): python benchmarks/engine_process.py [--rounds 3] [--max-tokens 32]
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


async def measure(front_end: str, settings: Any, prompts_text: list[str], args: argparse.Namespace,
                  pool: ProcessPoolExecutor) -> dict[str, Any]:
    from minedraft.engine import calls
    from minedraft.engine.async_engine import AsyncEngine
    from minedraft.engine.engine_process import EngineProcess
    from minedraft.engine.requests import encode_prompt
    from minedraft.engine.settings import Mode

    print(f"[{front_end}] loading the engine ...", file=sys.stderr, flush=True)
    engine: Any = (await AsyncEngine.create(settings) if front_end == "in-process"
                   else await EngineProcess.create(settings))
    results: dict[str, Any] = {"direct": {"records": [], "runs": []}, "grpc": {"records": [], "runs": []}}
    try:
        await engine.call(partial(calls.set_mode, mode=Mode(args.mode), k=args.k))
        prompts = [encode_prompt(engine.tokenizer, p, engine.vocab_size, engine.max_model_len) for p in prompts_text]
        await drive_direct(engine, prompts[:8], 4)  # warm-up: first compilations and allocations
        for round_index in range(args.rounds):
            for scenario in ("direct", "grpc"):
                before = await engine.call(calls.step_records)
                first = before[-1].step if before else 0
                run = (await drive_direct(engine, prompts, args.max_tokens) if scenario == "direct"
                       else await drive_grpc(engine, prompts, args.max_tokens, pool))
                records = [r for r in await engine.call(partial(calls.step_records, since_step=first))
                           if r.step > first]
                results[scenario]["records"].append(records)
                run["steps"] = len(records)
                results[scenario]["runs"].append(run)
                print(f"[{front_end}] round {round_index + 1} {scenario}: {run['tokens']} tokens in "
                      f"{run['seconds']:.2f} s, {len(records)} steps, step p90 "
                      f"{summarize([records])['step_ms_p90']:.1f} ms", file=sys.stderr, flush=True)
    finally:
        await engine.shutdown()
    return {scenario: {**summarize(r["records"]), "runs": r["runs"],
                       "output_tokens_per_s": round(sum(x["tokens"] for x in r["runs"])
                                                    / sum(x["seconds"] for x in r["runs"]), 1)}
            for scenario, r in results.items()}


def markdown(report: dict[str, Any]) -> str:
    config = report["config"]
    lines = ["# The engine's step time with 64 streaming gRPC clients, engine in-process vs in its own process", "",
             f"Command: `{config['command']}`  ",
             f"Local pair, mode {config['mode']}, {CONCURRENCY} requests at once, {config['max_tokens']} tokens each "
             f"(ignore_eos), {config['rounds']} rounds interleaving direct and grpc; {config['machine']} (load average "
             f"{config['load_average_at_start']:.1f} at start).", "",
             "step = the scheduler's step time (schedule to update); interval = wall time between consecutive steps' "
             "starts (the whole loop turn: output processing, detokenisation, deltas out, GIL waits).", "",
             "| engine | clients | steps | step p50 ms | step p90 ms | interval p50 ms | interval p90 ms | "
             "output tok/s |", "|---|---|---|---|---|---|---|---|"]
    for front_end, scenarios in report["results"].items():
        for scenario, s in scenarios.items():
            lines.append(f"| {front_end} | {scenario} | {s['steps']} | {s['step_ms_p50']:.1f} | "
                         f"{s['step_ms_p90']:.1f} | {s['interval_ms_p50']:.1f} | {s['interval_ms_p90']:.1f} | "
                         f"{s['output_tokens_per_s']:.0f} |")
    lines += ["", "Ratios (grpc / direct, same engine; 1.0 = serving the streams costs the steps nothing):", "",
              "| engine | step p90 | interval p90 | output tok/s |", "|---|---|---|---|"]
    for front_end, ratio in report["ratios"].items():
        lines.append(f"| {front_end} | {ratio['step_p90']:.2f} | {ratio['interval_p90']:.2f} | "
                     f"{ratio['output_tokens_per_s']:.2f} |")
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
        target_cpu_cores=target_cores)
    prompts = bench_prompts(pair, CONCURRENCY, chars=args.prompt_chars)
    report: dict[str, Any] = {"config": {"command": command, "mode": args.mode, "k": args.k, "rounds": args.rounds,
                                         "max_tokens": args.max_tokens, "concurrency": CONCURRENCY,
                                         "prompt_chars": args.prompt_chars, "pair_dir": str(pair),
                                         "machine": "shared 2-core CPU, contended by other jobs",
                                         "load_average_at_start": os.getloadavg()[0]},
                              "results": {}}
    # The clients' process starts once, before anything is timed.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(os.getpid).result()
        for front_end in ("in-process", "engine-process"):
            report["results"][front_end] = await measure(front_end, settings, prompts, args, pool)
    report["ratios"] = {
        front_end: {"step_p90": s["grpc"]["step_ms_p90"] / s["direct"]["step_ms_p90"],
                    "interval_p90": s["grpc"]["interval_ms_p90"] / s["direct"]["interval_ms_p90"],
                    "output_tokens_per_s": s["grpc"]["output_tokens_per_s"] / s["direct"]["output_tokens_per_s"]}
        for front_end, s in report["results"].items()}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
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
