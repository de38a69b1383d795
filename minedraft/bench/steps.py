"""Where an engine step's time goes, at 32 requests with long contexts.

    python -m minedraft.bench.steps --out benchmarks/results/step-breakdown [--contexts 512,2048,8192]

Per decode step (prefill steps excluded) it reports, from the scheduler's step records and timers wrapped around
vLLM's model runner (this benchmark only):
  forward        the target's forward pass (vLLM's `_model_forward`)
  runner_states  the model runner's persistent-batch update (`_update_states`): requests left out of a step are
                 removed from vLLM's persistent batch and re-added when next scheduled, so PSD's alternating
                 sub-batches pay for it every step
  runner_inputs  building the step's inputs (`_prepare_inputs`)
  runner_other   the rest of the model runner's step (sampling, rejection sampling, output bookkeeping)
  schedule       our schedule() without the wait for drafts (planning, vLLM's scheduler)
  update         our update_from_output() (committing tokens, sub-batch bookkeeping, sending the draft job)
  wait           waiting for late drafts
and "engine_own" = everything but forward and wait, as a share of the step. From the worker's side (timestamps taken
in the model runner, where the device's work is issued): "worker_idle" is the time between the end of one step's work
(sampled tokens handed back) and the start of the next step's (execute_model), during which the target's device has
nothing to do (the engine's host work, and any wait for drafts, run there); "worker_idle_share" is that gap over the
gap plus the next step's worker time. On a GPU every millisecond of it is a millisecond the GPU sits idle. The gap is
split into "idle: drafts" (the part during which the engine waited for that step's drafts: the drafter being slower
than the target, not host overhead) and "idle: host" (the rest: the engine's own work, and "host: handoff", the part
after the step was scheduled: handing it over, at TP > 1 the worker answering the previous step and reading this one
from the executor's queue, which async steps cannot hide); "host share" is the latter
over itself plus the step; "drafts on time" takes only the gaps with no wait for drafts in them (after a late job the
rest of the step's scheduling, which needs the drafts, falls in the gap too). Worker steps are paired with
step records by order (with async steps the worker runs ahead of the engine's calls). The timeline and the runner's
timers live in the worker itself, installed and read back through vLLM's collective RPC: in-process at TP = 1, in
each worker process at TP > 1 (`--tensor-parallel-size 2`), where the rank-0 worker (the one whose output the engine
reads) is paired with the step records and every rank's idle share is reported too (`worker_idle_share_by_rank`).
The worker's clock is `time.perf_counter` (CLOCK_MONOTONIC: one clock for every process of the machine), so its
gaps split against the engine's wait for drafts as at TP = 1. At TP > 1 the layouts are not run (the ranks take every
core; nothing widens).
Modes run side by side on one engine: psd with delta draft jobs, psd-async (the same with async PSD steps: each step
scheduled while the previous one computes; "scheduled ahead" is the share of decode steps that were), psd with whole
contexts (the old protocol),
psd-churn (psd with the model runner's resident sub-batches off: vLLM's single persistent batch re-adds the other
sub-batch every step), and ar. A second
layout, the paper's (the drafter on a device the target may not use: here the target never widens onto the drafter's
core), runs psd, sd (and psd-async when asked for) beside the equal-cores layout and reports psd/sd against the ceiling
(t_draft + t_verify) / max(t_draft, t_verify).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minedraft.bench.output import stdout_to_stderr

# The options recorded in a result's config (the CLI's namespace also holds the `minedraft bench` parser's own).
_OPTION_NAMES = ("contexts", "requests", "max_tokens", "k", "modes", "tensor_parallel_size")
# A draft job that spent more than this share of its time before its first drafted token was catching up on context.
CATCH_UP_SHARE = 0.5
COLUMNS = ("forward", "runner_states", "runner_inputs", "runner_other", "schedule", "update", "wait")


class RunnerTimers:
    """Seconds spent in chosen model-runner methods, per step (wraps the bound methods of one runner)."""

    def __init__(self, runner: Any, names: dict[str, str]) -> None:
        self.totals = dict.fromkeys(names, 0.0)
        for label, method in names.items():
            setattr(runner, method, self._timed(label, getattr(runner, method)))

    def _timed(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[label] += time.perf_counter() - started
        return wrapper

    def take(self) -> dict[str, float]:
        out = dict(self.totals)
        for label in self.totals:
            self.totals[label] = 0.0
        return out


class WorkerTimeline:
    """Worker-side start and end of each step's work in one model runner (wraps its bound methods).

    A step starts when the runner's `execute_model` is entered and ends when the sampled tokens are handed back:
    when `sample_tokens` returns, or when `execute_model` returns an output itself (a step with nothing to sample)."""

    def __init__(self, runner: Any, clock: Callable[[], float] = time.perf_counter,
                 on_end: Callable[[], dict[str, float]] | None = None) -> None:
        self._clock = clock
        self._started: float | None = None
        self.steps: list[tuple[float, float]] = []
        # Per step, what `on_end` returned when it ended (the runner timers' totals of that step): with async steps
        # the worker runs on a thread of its own, so per-step figures are taken where the step ends, not per call.
        self._on_end = on_end
        self.details: list[dict[str, float]] = []
        execute, sample = runner.execute_model, runner.sample_tokens

        def execute_model(*args: Any, **kwargs: Any) -> Any:
            self._started = self._clock()
            output = execute(*args, **kwargs)
            if output is not None:
                self._end()
            return output

        def sample_tokens(*args: Any, **kwargs: Any) -> Any:
            output = sample(*args, **kwargs)
            self._end()
            return output

        runner.execute_model, runner.sample_tokens = execute_model, sample_tokens

    def _end(self) -> None:
        if self._started is not None:
            self.steps.append((self._started, self._clock()))
            self.details.append(self._on_end() if self._on_end is not None else {})
            self._started = None

    def take(self) -> list[tuple[float, float]]:
        steps, self.steps = self.steps, []
        return steps

    def take_details(self) -> list[dict[str, float]]:
        details, self.details = self.details, []
        return details


def idle_split(gap: tuple[float, float], wait: tuple[float, float]) -> tuple[float, float]:
    """(waiting for drafts, host work) of a worker idle gap: the part of the gap during which the engine thread was
    waiting for the step's drafts, and the rest. With async steps the wait mostly falls while the previous step
    computes, outside the gap. Pure."""
    start, end = gap
    idle = max(0.0, end - start)
    waiting = max(0.0, min(end, wait[1]) - max(start, wait[0]))
    return waiting, idle - waiting


def handoff_part(gap: tuple[float, float], sent_at: float) -> float:
    """The part of a worker idle gap after the engine had handed the step over (scheduled it: its scheduler output
    ready to send): the handoff itself (sending the step and, at TP > 1, the worker answering the previous step and
    reading this one from the executor's queue), not the engine's host work. With the step sent before the gap began
    (async steps), the whole gap. Pure."""
    start, end = gap
    return max(0.0, end - max(start, sent_at))


def idle_gaps(steps: list[tuple[float, float]], previous_end: float | None) -> list[tuple[float, float]]:
    """(idle before the step, the step's worker time) for each step, the idle being the time since the previous
    step's end (the first step of a run, without one, is left out). Pure."""
    out = []
    for start, end in steps:
        if previous_end is not None:
            out.append((max(0.0, start - previous_end), end - start))
        previous_end = end
    return out


RUNNER_TIMERS = {"forward": "_model_forward", "runner_states": "_update_states", "runner_inputs": "_prepare_inputs"}


def install_worker_probe(worker: Any) -> bool:
    """In a worker (through collective_rpc: each TP rank's process, or in-process at TP = 1): the runner's timers and
    the worker's step timeline, kept on its model runner. Once per runner."""
    runner = worker.model_runner
    if getattr(runner, "minedraft_step_probe", None) is None:
        timers = RunnerTimers(runner, RUNNER_TIMERS)
        runner.minedraft_step_probe = WorkerTimeline(runner, on_end=timers.take)
    return True


def take_worker_probe(worker: Any) -> tuple[list[tuple[float, float]], list[dict[str, float]]]:
    """In a worker: its steps since the last take ((start, end) of each) and the runner timers of each."""
    timeline: WorkerTimeline = worker.model_runner.minedraft_step_probe
    return timeline.take(), timeline.take_details()


def run_context(engine: Any, prompt_ids: list[int], num_requests: int, max_tokens: int,
                tag: str) -> dict[str, Any]:
    from minedraft.engine.requests import SamplingSettings

    sampling = SamplingSettings(max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_requests):
        # Requests share all but their last 16 tokens: the target's prefix cache spares most of the prefill (the
        # per-step costs measured here depend on context length, not content), and each context is still its own.
        tail = prompt_ids[16 * (i + 1): 16 * (i + 2)]
        engine.add_request(f"{tag}-{i}", prompt_ids[: len(prompt_ids) - len(tail)] + tail, sampling)
    first = engine.step_records()[-1].step if engine.step_records() else 0
    engine._llm.collective_rpc(take_worker_probe)
    while engine.has_unfinished_requests():
        engine.step()
    records = engine.step_records(first)
    # Per rank; rank 0's output is the one the engine reads.
    ranks = engine._llm.collective_rpc(take_worker_probe)
    worker, runner_steps = ranks[0]
    # One worker step per scheduled step, in order (with async steps the worker runs ahead of the engine's calls,
    # so they are paired by order, not by call).
    if len(worker) != len(records):
        print(f"{tag}: {len(worker)} worker steps for {len(records)} step records: idle not paired",
              file=sys.stderr)
        worker, runner_steps = [], []
    rows: list[dict[str, Any]] = []
    decode_records: list[Any] = []
    for index, record in enumerate(records):
        if record.num_prefill_requests or not record.num_decode_requests:
            continue
        decode_records.append(record)
        runner = runner_steps[index] if runner_steps else dict.fromkeys(("forward", "runner_states", "runner_inputs"),
                                                                        0.0)
        forward = runner["forward"]
        row: dict[str, Any] = {
            "forward": forward,
            "runner_states": runner["runner_states"],
            "runner_inputs": runner["runner_inputs"],
            "runner_other": max(0.0, record.verify_seconds - forward - runner["runner_states"]
                                - runner["runner_inputs"]),
            "schedule": record.schedule_seconds,
            "update": record.update_seconds,
            "wait": record.wait_seconds,
            "step": record.step_seconds,
            "draft": record.draft_seconds,
            "decode_requests": record.num_decode_requests,
            "with_drafts": record.num_requests_with_drafts,
            "output_tokens": record.num_output_tokens,
            # For re-reading the overlap step by step (steps.overlap): when, which side, how long each part took.
            "started_at": record.started_at,
            "step_number": record.step,
            "verified_group": -1 if record.verified_group is None else record.verified_group,
            "verify": record.verify_seconds,
            "draft_first_token": record.draft_first_token_seconds,
            "scheduled_ahead": record.scheduled_ahead,
            # None for a run's first step (no step before it to idle after).
            "worker_idle": None,
            "worker_busy": None,
        }
        if worker and index > 0:
            gap = (worker[index - 1][1], worker[index][0])
            waiting, host = idle_split(gap, (record.started_at, record.started_at + record.wait_seconds))
            # Scheduled at: the step's start, its wait for drafts and its scheduling (StepRecord.schedule_seconds).
            sent_at = record.started_at + record.wait_seconds + record.schedule_seconds
            row.update(worker_idle=waiting + host, worker_idle_drafts=waiting, worker_idle_host=host,
                       worker_idle_handoff=min(host, handoff_part(gap, sent_at)),
                       worker_busy=worker[index][1] - worker[index][0])
        rows.append(row)
    if not rows:
        return {"steps": 0}
    summary: dict[str, Any] = {"steps": len(rows)}
    for column in (*COLUMNS, "step", "draft", "decode_requests", "with_drafts"):
        summary[column] = statistics.median(r[column] for r in rows)
    summary["tokens_per_second"] = sum(r["output_tokens"] for r in rows) / sum(r["step"] for r in rows)
    summary["scheduled_ahead_share"] = sum(r["scheduled_ahead"] for r in rows) / len(rows)
    own = [r["step"] - r["forward"] - r["wait"] for r in rows]
    summary["engine_own"] = statistics.median(own)
    summary["engine_own_share"] = statistics.median(o / r["step"] for o, r in zip(own, rows, strict=True))
    idle = [r for r in rows if r["worker_idle"] is not None]
    if idle:
        summary["worker_idle"] = statistics.median(r["worker_idle"] for r in idle)
        summary["worker_idle_drafts"] = statistics.median(r["worker_idle_drafts"] for r in idle)
        summary["worker_idle_host"] = statistics.median(r["worker_idle_host"] for r in idle)
        summary["worker_idle_handoff"] = statistics.median(r["worker_idle_handoff"] for r in idle)

        def share(part: str, whole: str) -> float:
            return statistics.median(r[part] / (r[whole] + r["worker_busy"])
                                     if r[whole] + r["worker_busy"] else 0.0 for r in idle)

        summary["worker_idle_share"] = share("worker_idle", "worker_idle")
        # Host work against the step as it would be with drafts on time: the 5% goal is judged on this.
        summary["worker_idle_host_share"] = share("worker_idle_host", "worker_idle_host")
        # Gaps with no wait for drafts in them: the host's own gap when the drafts were on time. (After a late
        # draft job the rest of schedule() - planning, vLLM's scheduling - falls in the gap as host work too.)
        on_time = [r for r in idle if not r["worker_idle_drafts"]]
        summary["steps_drafts_on_time"] = len(on_time)
        if on_time:
            summary["worker_idle_host_on_time"] = statistics.median(r["worker_idle_host"] for r in on_time)
            summary["worker_idle_host_share_on_time"] = statistics.median(
                r["worker_idle_host"] / (r["worker_idle_host"] + r["worker_busy"]) for r in on_time)
    if len(ranks) > 1 and worker:
        summary["worker_idle_share_by_rank"] = [rank_idle_share(steps, records) for steps, _ in ranks]
    summary.update(overlap(decode_records))
    first_started = rows[0]["started_at"]
    summary["per_step"] = [{**r, "started_at": round(r["started_at"] - first_started, 5)} for r in rows]
    return summary


def rank_idle_share(steps: list[tuple[float, float]], records: list[Any]) -> float | None:
    """Median over decode steps of one rank's idle gap before the step over the gap plus the step (None: its steps
    do not pair with the records). Pure."""
    if len(steps) != len(records):
        return None
    shares = []
    for index, record in enumerate(records):
        if index == 0 or record.num_prefill_requests or not record.num_decode_requests:
            continue
        idle = max(0.0, steps[index][0] - steps[index - 1][1])
        busy = steps[index][1] - steps[index][0]
        shares.append(idle / (idle + busy) if idle + busy else 0.0)
    return statistics.median(shares) if shares else None


def overlap(records: list[Any]) -> dict[str, float]:
    """The overlap fraction (stats.py's definition, pooled over the steps) and what explains it.

    overlap = 1 - wait / draft: below 1 exactly when the verifier waited for drafts. In psd a job drafts while the
    other sub-batch verifies, so the wait is what drafting took beyond the rest of that step: the drafter's time
    against the verifier's (draft_per_verify > 1 means this k drafts longer than a verification takes: the wait is
    the imbalance, not a scheduling fault; at the balanced k the two are about equal). The ratio is taken over the
    steps that verified drafts; the overlap over every step given (a wait that ended without drafts counts).

    To tell imbalance from delay in the link, each wait is compared with what drafting alone explains: the job for
    step m's sub-batch was sent at the end of step m-2 (psd alternates), so it had until step m started to draft;
    `wait_explained_share` is the part of the total wait that max(0, draft - that time) accounts for. The drafter
    takes jobs in order, so a job sent while the previous one was still drafting starts when that one ended (the
    end of step m-1's wait, when it waited). Near 1: the waits are the drafter being slower than the verifier on
    those steps; well below 1: time lost outside drafting (sending, the drafter picking the job up, replies, the
    drafter's process not running: other load on its cores).
    """
    from minedraft.engine.control.stats import summarize

    drafted = [r for r in records if r.draft_seconds > 0]
    verify = sum(r.verify_seconds for r in drafted)
    by_step = {r.step: r for r in records}
    explained = waited = 0.0
    for r in drafted:
        sent = by_step.get(r.step - 2)
        if sent is None or sent.verified_group != r.verified_group or r.mode != "psd":
            continue
        job_started = sent.started_at + sent.step_seconds
        previous = by_step.get(r.step - 1)
        if previous is not None and previous.wait_seconds > 0:
            job_started = max(job_started, previous.started_at + previous.wait_seconds)
        available = r.started_at - job_started
        waited += r.wait_seconds
        explained += min(r.wait_seconds, max(0.0, r.draft_seconds - available))
    # Catch-up jobs: most of the drafter's time went to reading context (a new request's whole prompt) rather than
    # drafting k tokens. A run of a few steps starts with them; steady decoding has none.
    steady = [r for r in records if not r.draft_first_token_seconds > CATCH_UP_SHARE * r.draft_seconds]
    return {
        "overlap_fraction": float(summarize(records)["overlap_fraction"]) if records else 0.0,
        "steady_overlap_fraction": float(summarize(steady)["overlap_fraction"]) if steady else 0.0,
        "catch_up_steps": len(records) - len(steady),
        "draft_per_verify": sum(r.draft_seconds for r in drafted) / verify if verify else 0.0,
        "steps_with_drafts_share": len(drafted) / len(records) if records else 0.0,
        "wait_explained_share": explained / waited if waited else 1.0,
    }


def _pair_for_context(pair: Path, positions: int) -> Path:
    """The pair itself, or (for contexts beyond its position table, e.g. the local pair's 2048) a temporary copy whose
    configs allow `positions`: weights linked, configs rewritten. Random-position RoPE extrapolation changes what the
    models say, not what a step costs, which is all this benchmark measures."""
    import tempfile

    configs = {role: json.loads((pair / role / "config.json").read_text()) for role in ("target", "draft")}
    if all(c.get("max_position_embeddings", positions) >= positions for c in configs.values()):
        return pair
    copy = Path(tempfile.mkdtemp(prefix="minedraft-long-pair-"))
    for item in pair.iterdir():
        if item.name not in configs:  # the pair's own files (held-out prompts, metadata)
            (copy / item.name).symlink_to(item.resolve())
    for role, config in configs.items():
        (copy / role).mkdir()
        for item in (pair / role).iterdir():
            if item.name != "config.json":
                (copy / role / item.name).symlink_to(item.resolve())
        config["max_position_embeddings"] = positions
        (copy / role / "config.json").write_text(json.dumps(config, indent=2))
    print(f"contexts beyond the pair's positions: using {copy} (max_position_embeddings {positions})",
          file=sys.stderr)
    return copy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared by `minedraft bench steps` and `python -m minedraft.bench.steps`)."""
    parser.add_argument("--out", type=Path, required=True, help="path prefix of the .json and .md results")
    parser.add_argument("--contexts", default="512,2048,8192", help="context lengths in tokens, comma-separated")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("-k", "--k", type=int, default=3, dest="k")
    parser.add_argument("--modes", default="psd,psd-async,psd-full,ar,layout")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="target ranks (CPU: one worker process per rank, each bound to its own cores; the "
                        "layouts are not run at TP > 1)")
    parser.add_argument("--pair-dir", type=Path, default=None)
    parser.add_argument("--json", action="store_true",
                        help="print the results as JSON on stdout (default: the Markdown table); progress on stderr")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args, command="python -m minedraft.bench.steps " + " ".join(sys.argv[1:] if argv is None else argv))


def run(args: argparse.Namespace, command: str) -> int:
    """Run the benchmark; write `<out>.json` and `<out>.md`; print the JSON (--json) or the table on stdout."""
    with stdout_to_stderr():
        results = _measure(args, command)
    if results is None:
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    args.out.with_suffix(".md").write_text(markdown(results))
    print(json.dumps(results, indent=2) if args.json else markdown(results), flush=True)
    return 0


def _measure(args: argparse.Namespace, command: str) -> dict[str, Any] | None:
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # the local pair says 2048; RoPE extrapolates
    from minedraft.engine.core import Engine
    from minedraft.engine.settings import DrafterSettings, EngineSettings, Mode, default_core_split
    from minedraft.models.spec import default_pair_dir

    contexts = [int(c) for c in args.contexts.split(",")]
    source_pair = args.pair_dir or default_pair_dir()
    pair = _pair_for_context(source_pair, max(contexts) + args.max_tokens + 128)
    target_cores, drafter_cores = default_core_split()
    if args.tensor_parallel_size > 1:
        # One worker process per rank, each bound to its own core(s) of all this process may use (placement's
        # cpu_thread_binding); the drafter keeps its half, so it shares a core with a rank on a small machine.
        target_cores = ()
    settings = EngineSettings(
        model=str(pair / "target"),
        drafter=DrafterSettings(model=str(pair / "draft"), cpu_cores=drafter_cores, kv_cache_gib=1,
                                deadline_seconds=30.0, backend="torch"),
        mode=Mode.PSD, num_speculative_tokens=args.k, max_num_seqs=args.requests,
        max_model_len=max(contexts) + args.max_tokens + 64,
        kv_cache_gib=max(2.0, 8e-6 * args.requests * (max(contexts) + args.max_tokens) + 1),
        target_cpu_cores=target_cores,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    engine = Engine(settings)
    try:
        return _runs(engine, args, command, source_pair, pair, contexts, (target_cores, drafter_cores))
    finally:
        engine.shutdown()
        if pair != source_pair:
            shutil.rmtree(pair, ignore_errors=True)


def _runs(engine: Any, args: argparse.Namespace, command: str, source_pair: Path, pair: Path, contexts: list[int],
          cores: tuple[tuple[int, ...], tuple[int, ...]]) -> dict[str, Any] | None:
    from minedraft.bench.workload import bench_prompts
    from minedraft.engine.placement import ComputePlacement
    from minedraft.engine.settings import Mode

    if not engine.wait_for_drafter(600):
        print("drafter did not start", file=sys.stderr)
        return None
    modes = args.modes.split(",")
    target_cores, drafter_cores = cores
    scheduler = engine.psd_scheduler
    assert scheduler is not None
    engine._llm.collective_rpc(install_worker_probe)
    tensor_parallel = engine.settings.tensor_parallel_size > 1
    # The held-out text lies beside the models, and the long-context copy has only the models.
    text = " ".join(bench_prompts(source_pair, 64, chars=400))
    base_ids = list(engine.tokenizer.encode(text))
    wide_placement = scheduler.placement
    narrow_placement = ComputePlacement(wide_placement.target_cores, ())
    options = {k: v for k, v in vars(args).items() if k in _OPTION_NAMES}
    results: dict[str, Any] = {"config": {"command": command, **options, "out": str(args.out), "pair_dir": str(pair),
                                          "cores": {"target": target_cores, "drafter": drafter_cores},
                                          "machine": "shared 2-core CPU, contended by other jobs",
                                          "load_average_at_start": os.getloadavg()[0]},
                               "runs": []}
    for context in contexts:
        prompt = (base_ids * (context // len(base_ids) + 1))[:context]
        plan: list[tuple[str, str, Mode, bool]] = []
        if "psd" in modes:
            plan.append(("psd", "equal-cores", Mode.PSD, True))
        if "psd-async" in modes:
            plan.append(("psd-async", "equal-cores", Mode.PSD, True))
        if "psd-full" in modes:
            plan.append(("psd-full-context", "equal-cores", Mode.PSD, False))
        if "psd-churn" in modes:
            plan.append(("psd-churn", "equal-cores", Mode.PSD, True))
        if "ar" in modes:
            plan.append(("ar", "equal-cores", Mode.AR, True))
        if "layout" in modes and not tensor_parallel:
            plan += [("sd", "equal-cores", Mode.SD, True), ("psd", "own-drafter-core", Mode.PSD, True),
                     ("sd", "own-drafter-core", Mode.SD, True)]
            if "psd-async" in modes:
                plan.append(("psd-async", "own-drafter-core", Mode.PSD, True))
        for label, layout, mode, deltas in plan:
            engine.set_mode(mode, args.k, 0)
            scheduler.core.planner.send_deltas = deltas
            engine.set_resident_sub_batches(label != "psd-churn")
            engine.set_async_psd_steps(label == "psd-async")
            placement = narrow_placement if layout == "own-drafter-core" else wide_placement
            # Forget what the placement last applied: the other one may have moved the thread's cores since.
            placement.wide = None
            scheduler.placement = placement
            # Start each run from an empty drafter and cache state of this engine: nothing carried between runs.
            summary = run_context(engine, prompt, args.requests, args.max_tokens, f"{label}-{layout}-{context}")
            row = {"context": context, "mode": label, "layout": layout, **summary}
            results["runs"].append(row)
            print(json.dumps(row), file=sys.stderr)
    results["config"]["load_average_at_end"] = os.getloadavg()[0]
    return results


def markdown(results: dict[str, Any]) -> str:
    ms = 1000.0
    lines = [
        "# Per-step breakdown (median per decode step, milliseconds)",
        "",
        f"Config: `{json.dumps(results['config'])}`",
        "",
        "| context | mode | layout | steps | step | forward | runner_states | runner_inputs | runner_other | schedule"
        " | update | wait | engine own | own share | verified w/ drafts | draft | draft/verify | overlap | steady"
        " overlap (catch-up steps) | wait explained | worker idle | worker idle share | idle: drafts | idle: host"
        " | host share | host, drafts on time (steps) | host share, drafts on time | scheduled ahead | host: handoff"
        " | tokens/s | idle share by rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        "---|---|---|",
    ]
    for r in results["runs"]:
        if not r.get("steps"):
            continue
        lines.append(
            f"| {r['context']} | {r['mode']} | {r['layout']} | {r['steps']} | {r['step'] * ms:.1f} | "
            + " | ".join(f"{r[c] * ms:.2f}" for c in COLUMNS)
            + f" | {r['engine_own'] * ms:.2f} | {r['engine_own_share']:.1%} | "
            f"{r['with_drafts']:.0f}/{r['decode_requests']:.0f} | {r['draft'] * ms:.1f} | "
            + (f"{r['draft_per_verify']:.2f} | {r['overlap_fraction']:.2f} | {r['steady_overlap_fraction']:.2f} "
               f"({r['catch_up_steps']}) | {r['wait_explained_share']:.2f} |"
               if r.get("draft_per_verify") else "- | - | - | - |")
            + (f" {r['worker_idle'] * ms:.2f} | {r['worker_idle_share']:.1%} | {r['worker_idle_drafts'] * ms:.2f} | "
               f"{r['worker_idle_host'] * ms:.2f} | {r['worker_idle_host_share']:.1%} |"
               if "worker_idle_host" in r else " - | - | - | - | - |")
            + (f" {r['worker_idle_host_on_time'] * ms:.2f} ({r['steps_drafts_on_time']}) |"
               f" {r['worker_idle_host_share_on_time']:.1%} |" if "worker_idle_host_on_time" in r else " - | - |")
            + f" {r.get('scheduled_ahead_share', 0.0):.0%} |"
            + (f" {r['worker_idle_handoff'] * ms:.2f} |" if "worker_idle_handoff" in r else " - |")
            + f" {r['tokens_per_second']:.0f} |"
            + (" " + ", ".join("-" if x is None else f"{x:.1%}" for x in r["worker_idle_share_by_rank"]) + " |"
               if r.get("worker_idle_share_by_rank") else " - |")
        )
    ceilings = []
    for context in sorted({r["context"] for r in results["runs"]}):
        by = {(r["mode"], r["layout"]): r for r in results["runs"] if r["context"] == context and r.get("steps")}
        for layout in ("equal-cores", "own-drafter-core"):
            psd, sd = by.get(("psd", layout)), by.get(("sd", layout))
            if psd and sd and sd["tokens_per_second"]:
                # sd drafts then verifies: its wait is the draft time, the rest of its step the verification.
                t_draft, t_verify = sd["wait"], sd["step"] - sd["wait"]
                ceiling = (t_draft + t_verify) / max(t_draft, t_verify) if max(t_draft, t_verify) else 0.0
                speedup = psd["tokens_per_second"] / sd["tokens_per_second"]
                ceilings.append(f"| {context} | {layout} | {speedup:.2f} | {ceiling:.2f} |")
    if ceilings:
        lines += ["", "psd/sd output tokens per second of decode steps, against the ceiling "
                  "(t_draft + t_verify) / max(t_draft, t_verify) measured from sd's steps:", "",
                  "| context | layout | psd/sd | ceiling |", "|---|---|---|---|", *ceilings]
    lines += ["", "Measured on a shared, contended 2-core machine: read ratios, not absolute times."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
