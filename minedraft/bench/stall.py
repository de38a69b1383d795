"""What a stopped drafter costs the streams: inter-token gaps of every stream while the drafter is SIGSTOPped.

    minedraft bench stall --out benchmarks/results/drafter/stall [--streams 16] [--json]

One psd engine serves N streams (greedy, long outputs) and, per scenario, the drafter process is SIGSTOPped for a
few seconds mid-run, then SIGCONTed:
  stop   the stop is shorter than the engine's hang threshold (reported with the results): the drafter is never
         declared hung; steps whose drafts are late verify without them once their wait budget (a fraction of a measured
         step) runs out, and drafting must resume by itself after SIGCONT.
  hang   the hang threshold is lowered below the stop (until SIGCONT): the engine takes the silence for a hang, kills
         the drafter and starts a new one in the background while it keeps serving without drafts (the restart path).
  hang-own-core  the same, with the target kept off the drafter's cores throughout (as when the drafter has a
         device of its own): without drafts the engine otherwise widens the target onto the cores where the new
         drafter is loading.
Per stream it reports the largest inter-token gap while the drafter was stopped against the target "no stream's gap
above 2x the step time plus 100 ms", with the step time the median engine step before the stop; drafter restarts,
deadline misses, and whether (and how soon after SIGCONT) steps verified drafts again. The baseline phase before the
stop reports psd's overlap fraction. A gap is the time between two deliveries of tokens to one stream, measured at the
engine's step boundary (the in-process engine; no transport), so a stream verified every other step in psd sees
about two steps between tokens when nothing is wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minedraft.bench.output import stdout_to_stderr
from minedraft.bench.steps import overlap

TARGET_STEP_FACTOR = 2.0
TARGET_SLACK_SECONDS = 0.1


@dataclass(frozen=True)
class Scenario:
    name: str
    stop_seconds: float
    # Silence (with a draft job outstanding) after which the engine restarts the drafter; None: the engine's own.
    hang_seconds: float | None
    # False: the target never widens onto the drafter's cores (the paper's layout), not even while no drafter runs.
    widen: bool = True


@dataclass(frozen=True)
class Window:
    """Times on the bench's clock (time.perf_counter, the scheduler's too): baseline from..stop, stop..cont, ..end."""

    baseline_from: float
    stopped_at: float
    continued_at: float
    ended_at: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared by `minedraft bench stall` and `python -m minedraft.bench.stall`)."""
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/drafter/stall"),
                        help="path prefix of the .json, .md and .png results")
    parser.add_argument("--streams", type=int, default=16, help="concurrent streams")
    parser.add_argument("-k", "--k", type=int, default=3, dest="k")
    parser.add_argument("--warmup-seconds", type=float, default=2.0,
                        help="decoding left out of the baseline (the drafter's first jobs read whole prompts)")
    parser.add_argument("--baseline-seconds", type=float, default=6.0, help="serving before the stop, after warm-up")
    parser.add_argument("--stop-seconds", type=float, default=2.0,
                        help="the stop scenario's SIGSTOP (below the engine's hang threshold)")
    parser.add_argument("--hang-stop-seconds", type=float, default=4.0, help="the hang scenario's SIGSTOP")
    parser.add_argument("--hang-threshold-seconds", type=float, default=1.0,
                        help="the hang scenario's hang threshold (below --hang-stop-seconds: the restart path)")
    parser.add_argument("--after-seconds", type=float, default=12.0,
                        help="serving after SIGCONT (long enough for a restarted drafter to come up)")
    parser.add_argument("--resume-timeout-seconds", type=float, default=60.0,
                        help="after SIGCONT, serve on until steps verify drafts again, at most this long")
    parser.add_argument("--scenarios", default="stop,hang,hang-own-core")
    parser.add_argument("--deadline-seconds", type=float, default=5.0,
                        help="the engine's drafter deadline (the cap on a step's wait for drafts)")
    parser.add_argument("--prompt-chars", type=int, default=200)
    parser.add_argument("--pair-dir", type=Path, default=None)
    parser.add_argument("--json", action="store_true",
                        help="print the results as JSON on stdout (default: the Markdown report); progress on stderr")


def scenarios_from_args(args: argparse.Namespace) -> list[Scenario]:
    known = {
        "stop": Scenario("stop", args.stop_seconds, None),
        "hang": Scenario("hang", args.hang_stop_seconds, args.hang_threshold_seconds),
        "hang-own-core": Scenario("hang-own-core", args.hang_stop_seconds, args.hang_threshold_seconds, widen=False),
    }
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"--scenarios: expected some of {', '.join(known)}, got {args.scenarios!r}")
    return [known[n] for n in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args, command="python -m minedraft.bench.stall " + " ".join(sys.argv[1:] if argv is None else argv))


def run(args: argparse.Namespace, command: str) -> int:
    """Run the benchmark; write `<out>.json`, `.md` and `.png`; print the JSON (--json) or the report on stdout."""
    scenarios = scenarios_from_args(args)
    with stdout_to_stderr():
        results = _measure(args, scenarios, command)
        if results is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.with_suffix(".json").write_text(to_json(results))
            args.out.with_suffix(".md").write_text(markdown(results))
            plot(results, args.out.with_suffix(".png"))
    if results is None:
        return 1
    print(to_json(results) if args.json else markdown(results), flush=True)
    return 0


def to_json(results: dict[str, Any]) -> str:
    """Indented, except each scenario's timeline (tens of thousands of numbers), which goes on one line."""
    timelines = []
    shallow = {**results, "scenarios": []}
    for index, scenario in enumerate(results["scenarios"]):
        timelines.append(json.dumps(scenario.get("timeline"), separators=(",", ":")))
        shallow["scenarios"].append({**scenario, "timeline": f"@timeline-{index}@"})
    text = json.dumps(shallow, indent=1)
    for index, timeline in enumerate(timelines):
        text = text.replace(f'"@timeline-{index}@"', timeline, 1)
    return text


# -- analysis (pure: timestamps and step records in, figures out) ----------------------------------------------------


def gaps(deliveries: Sequence[float]) -> list[tuple[float, float]]:
    """(start, end) of each interval between successive deliveries of tokens to one stream."""
    return [(a, b) for a, b in itertools.pairwise(deliveries)]


def analyse(deliveries: dict[str, list[float]], records: Sequence[Any], window: Window,
            restarts: int, hangs: int, deadline_misses: int) -> dict[str, Any]:
    """Per-stream gaps around the stop against the target, and what the engine did meanwhile.

    `records` are the scenario's StepRecords (minedraft.engine.control.stats). The stop's gaps are those overlapping
    [stopped_at, continued_at] (a stream waiting through the stop shows as one long gap ending after it); the
    recovery's gaps start after continued_at.
    """
    baseline = [r for r in records if window.baseline_from <= r.started_at < window.stopped_at]
    decode_baseline = [r for r in baseline if r.num_decode_requests and not r.num_prefill_requests] or baseline
    step_seconds = statistics.median(r.step_seconds for r in decode_baseline) if decode_baseline else 0.0
    target_seconds = TARGET_STEP_FACTOR * step_seconds + TARGET_SLACK_SECONDS
    streams: list[dict[str, Any]] = []
    for stream, times in sorted(deliveries.items()):
        intervals = gaps(times)
        before = [b - a for a, b in intervals if a >= window.baseline_from and b <= window.stopped_at]
        during = [b - a for a, b in intervals if b > window.stopped_at and a < window.continued_at]
        after = [b - a for a, b in intervals if a >= window.continued_at and b <= window.ended_at]
        max_during = max(during, default=0.0)
        streams.append({
            "stream": stream,
            "median_gap_before_seconds": statistics.median(before) if before else None,
            "max_gap_before_seconds": max(before, default=None),
            "max_gap_during_stop_seconds": max_during if during else None,
            "tokens_during_stop": sum(1 for _, b in intervals if window.stopped_at < b <= window.continued_at),
            "max_gap_after_seconds": max(after, default=None),
            "ratio_to_target": max_during / target_seconds if during and target_seconds else None,
        })
    measured = [s for s in streams if s["ratio_to_target"] is not None]
    ratios: list[float] = [s["ratio_to_target"] for s in measured]
    resumed = [r for r in records if r.started_at >= window.continued_at and r.num_requests_with_drafts > 0]
    during_steps = [r for r in records if window.stopped_at <= r.started_at < window.continued_at]
    baseline_overlap = overlap(decode_baseline)
    return {
        "median_step_before_seconds": step_seconds,
        "target_gap_seconds": target_seconds,
        "max_gap_during_stop_seconds": max((s["max_gap_during_stop_seconds"] for s in measured), default=None),
        "max_ratio_to_target": max(ratios, default=None),
        "streams_over_target": sum(1 for ratio in ratios if ratio > 1.0),
        "streams_measured": len(measured),
        "median_step_during_stop_seconds": (statistics.median(r.step_seconds for r in during_steps)
                                            if during_steps else None),
        "max_wait_during_stop_seconds": max((r.wait_seconds for r in during_steps), default=None),
        "drafter_restarts": restarts,
        "drafter_hangs_detected": hangs,
        "deadline_misses": deadline_misses,
        "drafting_resumed": bool(resumed),
        "drafts_resumed_after_seconds": resumed[0].started_at - window.continued_at if resumed else None,
        "baseline_overlap_fraction": baseline_overlap["overlap_fraction"],
        "baseline_steady_overlap_fraction": baseline_overlap["steady_overlap_fraction"],
        "baseline_draft_per_verify": baseline_overlap["draft_per_verify"] or None,
        "baseline_wait_explained_share": baseline_overlap["wait_explained_share"],
        "streams": streams,
    }


# -- measurement -----------------------------------------------------------------------------------------------------


def run_scenario(engine: Any, prompts: list[list[int]], scenario: Scenario, baseline_seconds: float,
                 after_seconds: float, tag: str, resume_timeout_seconds: float = 60.0,
                 warmup_seconds: float = 0.0) -> dict[str, Any]:
    """Serve one stream per prompt; SIGSTOP the drafter `baseline_seconds` after every stream has its first token and
    `warmup_seconds` more (left out of the baseline), SIGCONT it `scenario.stop_seconds` later, serve `after_seconds`
    more (and on until steps verify drafts again, at most `resume_timeout_seconds`: a restarted drafter loads
    meanwhile), then abort what is left. A stream that reaches its length is replaced by a new one on the same
    prompt, so the load stays at one stream per prompt."""
    from minedraft.engine.requests import SamplingSettings

    scheduler = engine.psd_scheduler
    assert scheduler is not None and scheduler.drafter is not None
    link, drafter = scheduler.link, scheduler.drafter
    saved_hang, saved_placement = link.hang_seconds, scheduler.placement
    if not scenario.widen:
        from minedraft.engine.placement import ComputePlacement

        scheduler.placement = ComputePlacement(saved_placement.target_cores, ())
    if scenario.hang_seconds is not None:
        link.hang_seconds = scenario.hang_seconds
    restarts, hangs, misses = drafter.num_restarts, link.num_hangs, engine.totals().deadline_misses
    last_step = max((r.step for r in engine.step_records()), default=0)
    records: list[Any] = []
    live: dict[str, int] = {}  # request id -> prompt index

    def add(index: int, generation: int) -> None:
        request_id = f"{tag}-{index}" + (f"-r{generation}" if generation else "")
        room = engine.max_model_len - len(prompts[index]) - 1
        engine.add_request(request_id, prompts[index], SamplingSettings(max_tokens=room, ignore_eos=True))
        live[request_id] = index

    for index in range(len(prompts)):
        add(index, 0)
    generations = [0] * len(prompts)
    deliveries: dict[str, list[float]] = {request_id: [] for request_id in live}
    started = time.perf_counter()
    decoding_from = baseline_from = stopped_at = continued_at = ended_at = resumed_at = None
    pid = None
    try:
        while engine.has_unfinished_requests():
            for delta in engine.step():
                if delta.token_ids and delta.request_id in deliveries:
                    deliveries[delta.request_id].append(time.perf_counter())
                if delta.finished and delta.request_id in live:
                    index = live.pop(delta.request_id)
                    generations[index] += 1
                    add(index, generations[index])
                    deliveries[f"{tag}-{index}-r{generations[index]}"] = []
            now = time.perf_counter()
            # Collected as they come: the engine keeps a bounded history, and a long scenario outlasts it.
            new = engine.step_records(last_step)
            if new:
                records += new
                last_step = new[-1].step
            if continued_at is not None and resumed_at is None and any(r.num_requests_with_drafts for r in new):
                resumed_at = now
            if baseline_from is None:
                if decoding_from is None and all(deliveries[request_id] for request_id in live):
                    decoding_from = now  # every prompt prefilled
                    print(f"{scenario.name}: streams decoding after {now - started:.1f}s", file=sys.stderr)
                if decoding_from is not None and now - decoding_from >= warmup_seconds:
                    # The drafter has read every prompt (its first jobs carry them whole): steady decoding from here.
                    baseline_from = now
            elif stopped_at is None and now - baseline_from >= baseline_seconds:
                pid = drafter.pid()
                if pid is None or not scheduler.drafter_up:
                    raise RuntimeError("the drafter is not up at the stop: nothing to measure")
                os.kill(pid, signal.SIGSTOP)
                stopped_at = time.perf_counter()
                print(f"{scenario.name}: drafter {pid} stopped", file=sys.stderr)
            elif stopped_at is not None and continued_at is None and now - stopped_at >= scenario.stop_seconds:
                _continue(pid)
                continued_at = time.perf_counter()
                # The lowered threshold was for the stop; a replacement drafter's first jobs (whole contexts) may
                # legitimately take longer, and are judged by the engine's own threshold.
                link.hang_seconds = saved_hang
                print(f"{scenario.name}: drafter {pid} continued after {continued_at - stopped_at:.2f}s "
                      f"({drafter.num_restarts - restarts} restarts)", file=sys.stderr)
            elif continued_at is not None and now - continued_at >= after_seconds and (
                    resumed_at is not None or now - continued_at >= resume_timeout_seconds):
                ended_at = now
                break
        if ended_at is None:
            raise RuntimeError("every stream finished before the scenario did")
    finally:
        if stopped_at is not None and continued_at is None:
            _continue(pid)
        link.hang_seconds = saved_hang
        saved_placement.wide = None  # re-applied at the next step: the narrow placement moved the thread meanwhile
        scheduler.placement = saved_placement
        engine.abort(list(live))
        while engine.has_unfinished_requests():
            engine.step()
    assert baseline_from is not None and stopped_at is not None and continued_at is not None
    window = Window(baseline_from, stopped_at, continued_at, ended_at)
    summary = analyse(deliveries, records, window, drafter.num_restarts - restarts, link.num_hangs - hangs,
                      engine.totals().deadline_misses - misses)
    # Enough of the raw timeline to plot and to re-analyse: deliveries and steps relative to the scenario's start.
    timeline = {
        "deliveries": {rid: [round(t - started, 4) for t in times] for rid, times in deliveries.items()},
        "steps": [[round(r.started_at - started, 4), round(r.step_seconds, 4), round(r.wait_seconds, 4),
                   r.num_requests_with_drafts, int(r.drafter_up), round(r.wait_budget_seconds, 4),
                   round(r.verify_seconds, 4), round(r.draft_seconds, 4), r.num_decode_requests, int(r.widened)]
                  for r in records],
        "step_columns": ["started_at", "step_seconds", "wait_seconds", "requests_with_drafts", "drafter_up",
                         "wait_budget_seconds", "verify_seconds", "draft_seconds", "decode_requests", "widened"],
        "window": {name: round(getattr(window, name) - started, 4) for name in window.__dataclass_fields__},
    }
    return {"scenario": scenario.name, "stop_seconds": scenario.stop_seconds, "target_widens": scenario.widen,
            "hang_seconds": link.hang_seconds if scenario.hang_seconds is None else scenario.hang_seconds,
            "drafter_pid_stopped": pid, **summary, "timeline": timeline}


def _continue(pid: int | None) -> None:
    # The engine may have killed (and reaped) the stopped drafter already: the hang scenario's restart.
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def _measure(args: argparse.Namespace, scenarios: list[Scenario], command: str) -> dict[str, Any] | None:
    from minedraft.bench.workload import bench_prompts
    from minedraft.engine.core import Engine
    from minedraft.engine.settings import DrafterSettings, EngineSettings, Mode, default_core_split
    from minedraft.models.spec import default_pair_dir

    pair = args.pair_dir or default_pair_dir()
    target_cores, drafter_cores = default_core_split()
    settings = EngineSettings(
        model=str(pair / "target"),
        drafter=DrafterSettings(model=str(pair / "draft"), cpu_cores=drafter_cores,
                                deadline_seconds=args.deadline_seconds, backend="torch"),
        mode=Mode.PSD, num_speculative_tokens=args.k, max_num_seqs=args.streams,
        target_cpu_cores=target_cores,
    )
    engine = Engine(settings)
    try:
        if not engine.wait_for_drafter(600):
            print("drafter did not start", file=sys.stderr)
            return None
        prompts = [engine.encode_prompt(p) for p in bench_prompts(pair, args.streams, chars=args.prompt_chars)]
        results: dict[str, Any] = {
            "config": {"command": command, "streams": args.streams, "k": args.k,
                       "warmup_seconds": args.warmup_seconds, "baseline_seconds": args.baseline_seconds,
                       "after_seconds": args.after_seconds,
                       "deadline_seconds": args.deadline_seconds, "pair_dir": str(pair),
                       "cores": {"target": target_cores, "drafter": drafter_cores},
                       "target": f"max gap <= {TARGET_STEP_FACTOR:g} x median step before the stop + "
                                 f"{TARGET_SLACK_SECONDS * 1000:.0f} ms",
                       "machine": "shared 2-core CPU, contended by other jobs",
                       "load_average_at_start": os.getloadavg()[0]},
            "scenarios": [],
        }
        for scenario in scenarios:
            if not engine.wait_for_drafter(600):
                print(f"{scenario.name}: drafter not up", file=sys.stderr)
                return None
            row = run_scenario(engine, prompts, scenario, args.baseline_seconds, args.after_seconds,
                               f"stall-{scenario.name}", args.resume_timeout_seconds, args.warmup_seconds)
            results["scenarios"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("streams", "timeline")}), file=sys.stderr)
        results["config"]["load_average_at_end"] = os.getloadavg()[0]
        return results
    finally:
        engine.shutdown()


# -- reports -----------------------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def markdown(results: dict[str, Any]) -> str:
    lines = ["# A SIGSTOPped drafter: inter-token gaps of every stream", "",
             f"Config: `{json.dumps(results['config'])}`", "",
             "Target: no stream's inter-token gap while the drafter is stopped above 2x the engine's step time "
             "(median step before the stop) plus 100 ms.", "",
             "| scenario | stop s | hang threshold s | step before ms | target ms | max gap ms | max ratio | streams "
             "over | restarts | hangs | deadline misses | drafts resumed after s | baseline overlap | draft/verify | "
             "wait explained |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in results["scenarios"]:
        resumed = f"{s['drafts_resumed_after_seconds']:.2f}" if s["drafting_resumed"] else "never"
        ratio = "-" if s["max_ratio_to_target"] is None else f"{s['max_ratio_to_target']:.2f}"
        per_verify = "-" if s["baseline_draft_per_verify"] is None else f"{s['baseline_draft_per_verify']:.2f}"
        lines.append(
            f"| {s['scenario']} | {s['stop_seconds']:g} | {s['hang_seconds']:g} | "
            f"{_ms(s['median_step_before_seconds'])} | {_ms(s['target_gap_seconds'])} | "
            f"{_ms(s['max_gap_during_stop_seconds'])} | {ratio} | {s['streams_over_target']}/{s['streams_measured']} | "
            f"{s['drafter_restarts']} | {s['drafter_hangs_detected']} | {s['deadline_misses']} | {resumed} | "
            f"{s['baseline_overlap_fraction']:.2f} | {per_verify} | {s['baseline_wait_explained_share']:.2f} |")
    for s in results["scenarios"]:
        lines += ["", f"## {s['scenario']}: per stream (ms)", "",
                  "| stream | median gap before | max gap before | max gap during stop | tokens during stop | "
                  "max gap after | ratio to target |", "|---|---|---|---|---|---|---|"]
        for row in s["streams"]:
            ratio = "-" if row["ratio_to_target"] is None else f"{row['ratio_to_target']:.2f}"
            lines.append(f"| {row['stream']} | {_ms(row['median_gap_before_seconds'])} | "
                         f"{_ms(row['max_gap_before_seconds'])} | {_ms(row['max_gap_during_stop_seconds'])} | "
                         f"{row['tokens_during_stop']} | {_ms(row['max_gap_after_seconds'])} | {ratio} |")
    lines += ["", "Measured on a shared, contended 2-core machine: read ratios, not absolute times."]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = results["scenarios"]
    fig, axes = plt.subplots(len(scenarios), 1, figsize=(10, 3.6 * len(scenarios)), squeeze=False)
    for ax, s in zip(axes[:, 0], scenarios, strict=True):
        timeline = s["timeline"]
        window = timeline["window"]
        for times in timeline["deliveries"].values():
            ends = times[1:]
            ax.plot(ends, [(b - a) * 1000 for a, b in zip(times, ends, strict=False)], ".", markersize=2,
                    alpha=0.5)
        ax.axvspan(window["stopped_at"], window["continued_at"], color="red", alpha=0.15, label="drafter stopped")
        ax.axhline(s["target_gap_seconds"] * 1000, color="black", linestyle="--", linewidth=1,
                   label="target: 2 x step + 100 ms")
        down = [step[0] for step in timeline["steps"] if not step[4]]
        if down:
            # Along the bottom edge (axes coordinates), whatever the gaps' scale.
            ax.plot(down, [0.03] * len(down), "|", color="grey", transform=ax.get_xaxis_transform(),
                    label="steps with the drafter down")
        ax.set_xlim(window["baseline_from"] - 1, window["ended_at"])
        ax.set_yscale("log")
        ax.set_ylabel("inter-token gap (ms)")
        ax.set_title(f"{s['scenario']}: SIGSTOP {s['stop_seconds']:g}s, hang threshold {s['hang_seconds']:g}s, "
                     f"{len(timeline['deliveries'])} streams")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since the streams started (shared 2-core CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
