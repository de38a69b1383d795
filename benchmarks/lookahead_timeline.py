"""Where a step's time goes, sd against lookahead, on the local CPU pair in one engine (interleaved).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/lookahead_timeline.py [--modes sd,lookahead] [--tokens 128]

Per engine step (perf_counter, engine process): the wait for the draft job in schedule(), the rest of the core's
schedule (planning), vLLM's own scheduling, commit() (lookahead: the branch job built and sent), the target's
execute_model and sample_tokens, update_from_output (vLLM's and the core's), the rest of LLMEngine.step (output
processing); and per draft job: the drafter's own seconds, and its reply's arrival after it was sent (the rest is
start delay and IPC). Means in ms per step, over the steps of each mode's runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # (tests.component.driver, and this checkout's minedraft)

from minedraft.bench.workload import bench_prompts  # noqa: E402
from minedraft.engine.core import Engine  # noqa: E402
from minedraft.engine.requests import SamplingSettings  # noqa: E402
from minedraft.engine.settings import DrafterSettings, EngineSettings, Mode, default_core_split  # noqa: E402
from minedraft.engine.vllm_adapter.engine_core import in_process_core  # noqa: E402
from minedraft.models.spec import default_pair_dir  # noqa: E402
from tests.component.driver import Planned, drive  # noqa: E402

Clock = time.perf_counter


class Timeline:
    def __init__(self) -> None:
        self.spans: dict[str, list[float]] = defaultdict(list)
        self.current: dict[str, float] = defaultdict(float)
        self.jobs: list[tuple[float, float, float]] = []  # (round trip, drafter seconds, sent -> commit end)
        self.num_steps = 0

    def wrap(self, owner: Any, name: str, label: str, cpu: bool = False) -> None:
        """`cpu`: also the calling thread's CPU seconds (`label` cpu): below the wall seconds, the thread waited for
        a core (another process ran on it)."""
        inner: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started, started_cpu = Clock(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.current[label] += Clock() - started
                if cpu:
                    self.current[label + " cpu"] += time.thread_time() - started_cpu

        setattr(owner, name, timed)

    def end_step(self) -> None:
        self.num_steps += 1
        for label, seconds in self.current.items():
            self.spans[label].append(seconds)
        self.current.clear()

    def reset(self) -> None:
        self.spans.clear()
        self.current.clear()
        self.jobs.clear()
        self.num_steps = 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default="sd,lookahead,sd,lookahead",
                        help="lookahead@F: up to F branches; lookahead!: no refreshes; lookahead~: branch jobs sent "
                             "after vLLM's scheduling")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--fanout", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", help="write the runs here (and a .md beside it)")
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--nice", type=int, default=0,
                        help="run engine and drafter at this niceness (negative, as root: ahead of other processes on "
                             "a shared machine, to see the modes without their contention)")
    args = parser.parse_args()
    if args.nice:
        os.nice(args.nice)  # (before the engine starts: its threads and the drafter process inherit it)
    pair = default_pair_dir()
    target_cores, drafter_cores = default_core_split()
    engine = Engine(EngineSettings(
        model=str(pair / "target"),
        drafter=DrafterSettings(model=str(pair / "draft"), cpu_cores=drafter_cores, backend="torch"),
        mode=Mode.LOOKAHEAD, num_speculative_tokens=args.k, max_num_seqs=8, max_model_len=512, kv_cache_gib=1,
        target_cpu_cores=target_cores, dtype="float32", lookahead_fanout=args.fanout, lend_drafter_cores=False))
    assert engine.wait_for_drafter(300)
    print(f"cpu {os.cpu_count()} cores; engine affinity {sorted(os.sched_getaffinity(0))}; target cores "
          f"{target_cores}, drafter cores {drafter_cores}", flush=True)
    scheduler = engine.psd_scheduler
    assert scheduler is not None
    core = scheduler.core
    settings = core.settings
    timeline = Timeline()
    vllm_core = in_process_core(engine._llm)
    timeline.wrap(vllm_core.model_executor, "execute_model", "execute", cpu=True)
    timeline.wrap(vllm_core.model_executor, "sample_tokens", "sample")
    timeline.wrap(scheduler, "update_from_output", "update_from_output")
    timeline.wrap(core, "update", "core.update")
    timeline.wrap(scheduler, "schedule", "schedule")
    timeline.wrap(core, "schedule", "core.schedule")
    timeline.wrap(core, "commit", "core.commit")
    timeline.wrap(core.source, "wait_for", "wait_for")
    link = core.source
    inner_poll = link.poll
    sent: dict[int, float] = {}

    def poll(timeout_seconds: float) -> Any:
        events = inner_poll(timeout_seconds)
        now = Clock()
        for event in events:
            job = getattr(event, "job", None)
            seconds = getattr(event, "draft_seconds", None)
            if job is not None and seconds is not None:
                timeline.jobs.append((now - job.sent_at, seconds, 0.0))
        return events

    link.poll = poll  # type: ignore[method-assign]
    inner_step = engine.step

    def step() -> Any:
        started = Clock()
        try:
            return inner_step()
        finally:
            timeline.current["engine.step"] += Clock() - started
            timeline.end_step()

    engine.step = step  # type: ignore[method-assign]
    del sent
    prompts = [engine.encode_prompt(text) for text in bench_prompts(pair, 8, chars=160)]
    runs: list[dict[str, Any]] = []
    for number, concurrency in enumerate(int(c) for c in args.concurrency.split(",") for _ in range(args.rounds)):
        for spec in args.modes.split(","):
            # "lookahead@8": lookahead with up to 8 branches per request; "lookahead!": misses never refreshed;
            # "lookahead~": its branch job sent after vLLM's scheduling, never as soon as the step is planned.
            name, _, fanout = spec.rstrip("!~").partition("@")
            core.lookahead_fanout = int(fanout or args.fanout)
            core.settings = replace(settings, lookahead_refresh_misses=settings.lookahead_refresh_misses
                                    and "!" not in spec)
            core.early_branch_jobs = "~" not in spec
            engine.set_mode(Mode(name), args.k)
            records = engine.step_records()
            first = records[-1].step if records else 0
            timeline.reset()
            started = Clock()
            run = drive(engine, [Planned(f"{name}-{concurrency}-{i}-{time.monotonic_ns()}", prompts[i],
                                         SamplingSettings(max_tokens=args.tokens, ignore_eos=True))
                                 for i in range(concurrency)])
            seconds = Clock() - started
            steps = [r for r in engine.step_records(first) if r.num_decode_requests]
            tokens = sum(len(c.token_ids) for c in run.completions.values())

            def ms(values: list[float]) -> str:
                return f"{1000 * statistics.mean(values):.2f}" if values else "-"

            # (Per engine step: a span a step did not have counts 0.)
            spans = {label: f"{1000 * sum(values) / timeline.num_steps:.2f}"
                     for label, values in timeline.spans.items()}
            jobs = timeline.jobs
            line = (f"c={concurrency} {spec}: {tokens / seconds:.1f} tok/s, {len(steps)} decode steps, "
                    f"{tokens / max(1, len(steps)) / concurrency:.2f} tok/step/request; per step ms: "
                    + ", ".join(f"{label} {value}" for label, value in sorted(spans.items()))
                    + f"; jobs: round trip {ms([j[0] for j in jobs])}, drafter {ms([j[1] for j in jobs])}"
                    + f", record verify {ms([r.verify_seconds for r in steps])}"
                    + f" wait {ms([r.wait_seconds for r in steps])}")
            if name == Mode.LOOKAHEAD.value:
                hits = sum(r.num_branch_hits for r in steps)
                misses = sum(r.num_branch_misses for r in steps)
                shapes = [(r.lookahead_fanout, r.lookahead_depth) for r in steps]
                line += f"; hits {hits} misses {misses}; shapes {shapes[-4:]}"
            runs.append({"concurrency": concurrency, "round": number, "mode": spec,
                         "tokens_per_second": round(tokens / seconds, 1), "decode_steps": len(steps),
                         "tokens_per_step_per_request": round(tokens / max(1, len(steps)) / concurrency, 2),
                         "per_step_ms": {label: float(value) for label, value in spans.items()},
                         "drafter_job_ms": float(ms([j[1] for j in jobs]) if jobs else 0.0),
                         **({"hits": hits, "misses": misses} if name == Mode.LOOKAHEAD.value else {})})
            print(line, flush=True)
    engine.shutdown()
    if args.json:
        write(Path(args.json), runs, " ".join(["python", "benchmarks/lookahead_timeline.py", *sys.argv[1:]]))


def write(path: Path, runs: list[dict[str, Any]], command: str, load: tuple[float, ...] | None = None) -> None:
    """The runs, and per round each mode's tokens per second and target forward (execute) over sd's of that round."""
    ratios = []
    for key in dict.fromkeys((r["concurrency"], r["round"]) for r in runs):
        block = [r for r in runs if (r["concurrency"], r["round"]) == key]
        sd = next((r for r in block if r["mode"] == Mode.SD.value), None)
        if sd is None:
            continue
        ratios.append({"concurrency": key[0], **{
            r["mode"]: [round(r["tokens_per_second"] / sd["tokens_per_second"], 2),
                        round(r["per_step_ms"]["execute"] / sd["per_step_ms"]["execute"], 2)]
            for r in block if r is not sd}})
    load = load or os.getloadavg()
    # Over all rounds: each run makes the same tokens, so the ratio of the summed seconds per token.
    overall: dict[str, dict[str, float]] = {}
    for concurrency in dict.fromkeys(r["concurrency"] for r in runs):
        mine = [r for r in runs if r["concurrency"] == concurrency]
        sd_seconds = sum(1 / r["tokens_per_second"] for r in mine if r["mode"] == Mode.SD.value)
        overall[str(concurrency)] = {
            mode: round(sd_seconds / sum(1 / r["tokens_per_second"] for r in mine if r["mode"] == mode), 2)
            for mode in dict.fromkeys(r["mode"] for r in mine) if mode != Mode.SD.value}
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown") if Path("/proc/cpuinfo").exists() else "unknown"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"command": command, "cpu": cpu, "cores": os.cpu_count(),
                                "load_average": load,
                                "overall_ratio_to_sd": overall, "ratios_to_sd": ratios, "runs": runs}, indent=1))
    lines = [f"# Lookahead against sd on this CPU, step by step\n\n`{command}`\n",
             f"CPU: {cpu}, {os.cpu_count()} cores (load average at the end {load[0]:.1f}). One engine, "
             "the modes interleaved in each round; target and drafter on a core each, no lending. `lookahead!`: "
             "misses verified at once (no refresh); `lookahead@F`: up to F branches per request.\n",
             "Over all rounds, tokens per second over sd's (summed seconds for the same tokens): "
             + "; ".join(f"{c} request(s): " + ", ".join(f"{m} {v}x" for m, v in ratios_c.items())
                         for c, ratios_c in overall.items()) + ".\n",
             "Per round, tokens per second over sd's, and (after the slash) the target's forward per step over "
             "sd's:\n", "| requests | " + " | ".join(m for m in ratios[0] if m != "concurrency") + " |",
             "|---" * len(ratios[0]) + "|"]
    lines += [f"| {r['concurrency']} | " + " | ".join(f"{v[0]} / {v[1]}" for m, v in r.items() if m != "concurrency")
              + " |" for r in ratios]
    lines += ["", "| requests | mode | tok/s | tokens/step/request | step ms | execute ms | wait ms | drafter job ms "
              "| hits / misses |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['concurrency']} | {r['mode']} | {r['tokens_per_second']} | {r['tokens_per_step_per_request']} | "
              f"{r['per_step_ms'].get('engine.step', 0)} | {r['per_step_ms'].get('execute', 0)} | "
              f"{r['per_step_ms'].get('wait_for', 0)} | {r['drafter_job_ms']} | {r.get('hits', '')} / "
              f"{r.get('misses', '')} |" for r in runs]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
