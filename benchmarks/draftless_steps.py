"""Why decode steps go without drafts in the real engine: each decoding request's step, classified by cause.

Runs the engine as `benchmarks/twin_vs_engine.py` does (the local pair on the CPU, target on core 0, drafter on core
1, k = 3, closed loops of 8 x C requests of 64 output tokens over the bench's short prompts) and watches its
scheduler from inside (the engine core runs in this process): every draft job the link sends (its items), every
reply (when, for which sub-batch, or none: abandoned), every abandonment at the wait budget, and per step every
verified request's proposal. Each decoding request's step without drafts gets one cause:

  no_room        its output budget leaves nothing to draft (the last token)
  abandoned      its draft was in the job the step gave up on at the wait budget
  not_sent       no draft job carried it since its last verification (a newcomer's first step, or a job refused)
  chunk          its last job only took in a chunk of its catch-up (drafts nothing)
  stale          a reply came but not for its current context
  other          anything else (counted, so that nothing is hidden)

    python benchmarks/draftless_steps.py                         # sd at 16 (~2 minutes with the engine's start)
    python benchmarks/draftless_steps.py --modes sd,psd --concurrency 4,16 --json out.json

Prints a table (Markdown) and, with --json, the per-load counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CAUSES = ("no_room", "abandoned", "not_sent", "chunk", "stale", "other")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Watch:
    """What the scheduler did, as seen from its own methods."""

    # Per request: (num_tokens at submission, num_draft_tokens) of the last job that carried it.
    last_item: dict[str, tuple[int, int]] = field(default_factory=dict)
    abandoned_now: bool = False
    abandoned_ids: frozenset[str] = frozenset()
    causes: Counter[str] = field(default_factory=Counter)
    first_decode_steps: int = 0
    first_decode_draftless: int = 0
    decode_request_steps: int = 0
    steps: int = 0
    steps_abandoned: int = 0
    job_sizes: list[int] = field(default_factory=list)
    job_catch_up: list[int] = field(default_factory=list)
    # Jobs carrying a newcomer's prompt that were abandoned.
    newcomer_jobs_abandoned: int = 0
    # Per job id: carried a newcomer's prompt.
    job_has_newcomer: dict[int, bool] = field(default_factory=dict)
    budgets_ms: list[float] = field(default_factory=list)
    waits_abandoned_ms: list[float] = field(default_factory=list)
    draft_ms_newcomer: list[float] = field(default_factory=list)
    draft_ms_steady: list[float] = field(default_factory=list)
    # Per job id: sent_at, catch-up tokens, requests, newcomer, abandoned, reply's draft seconds, reply's arrival,
    # the budget it was waited for (the fields of `JOB_FIELDS`).
    jobs: dict[int, dict[str, Any]] = field(default_factory=dict)


def instrument(scheduler: Any, watch: Watch) -> None:
    """Wrap the drafter link's send, abandon and poll and the core's schedule (instance attributes: `uninstrument`
    takes them off again)."""
    from minedraft.engine.psd.events import DraftsArrived

    link, core = scheduler.link, scheduler.core
    orig_send, orig_abandon, orig_poll = link.send, link.abandon, link.poll
    orig_schedule = scheduler.schedule

    def send(group: int, items: list[Any], want_logprobs: bool) -> bool:
        ok = orig_send(group, items, want_logprobs)
        if ok:
            ticket = link.jobs.get(group)
            assert ticket is not None
            newcomer = any(item.base_num_tokens == 0 for item in items)
            watch.job_has_newcomer[ticket.job_id] = newcomer
            watch.jobs[ticket.job_id] = {"sent_at": time.perf_counter(), "catch_up": ticket.catch_up_tokens,
                                         "requests": len(items), "newcomer": newcomer, "abandoned": False,
                                         "draft_s": None, "arrived_at": None, "budget_s": None, "idle_s": None}
            watch.job_sizes.append(len(items))
            watch.job_catch_up.append(ticket.catch_up_tokens)
            for item in items:
                watch.last_item[item.request_id] = (item.base_num_tokens + len(item.token_ids), item.num_draft_tokens)
        return bool(ok)

    def abandon(group: int) -> None:
        ticket = link.jobs.get(group)
        if ticket is not None:
            watch.abandoned_now = True
            watch.abandoned_ids = ticket.carried
            if watch.job_has_newcomer.get(ticket.job_id):
                watch.newcomer_jobs_abandoned += 1
            watch.waits_abandoned_ms.append(1000 * core.timing.wait_seconds)
            if ticket.job_id in watch.jobs:
                watch.jobs[ticket.job_id]["abandoned"] = True
                watch.jobs[ticket.job_id]["budget_s"] = core.timing.wait_budget_seconds
        orig_abandon(group)

    def poll(timeout_seconds: float) -> list[Any]:
        events = orig_poll(timeout_seconds)
        for event in events:
            if isinstance(event, DraftsArrived):
                newcomer = watch.job_has_newcomer.get(event.job_id, False)
                (watch.draft_ms_newcomer if newcomer else watch.draft_ms_steady).append(1000 * event.draft_seconds)
                job = watch.jobs.get(event.job_id)
                if job is not None:
                    job.update(draft_s=event.draft_seconds, arrived_at=time.perf_counter(),
                               idle_s=event.idle_seconds)
        return list(events)

    def schedule(*args: Any, **kwargs: Any) -> Any:
        watch.abandoned_now, watch.abandoned_ids = False, frozenset()
        output = orig_schedule(*args, **kwargs)
        timing = core.timing
        plan = core.launched()[-1].plan
        new_ids = {r.req_id for r in output.scheduled_new_reqs}
        decoding = [rid for rid in output.num_scheduled_tokens if rid not in new_ids]
        if plan.verified_group is None or not decoding:
            return output
        watch.steps += 1
        watch.steps_abandoned += watch.abandoned_now
        if timing.wait_budget_seconds:
            watch.budgets_ms.append(1000 * timing.wait_budget_seconds)
        for rid in decoding:
            request = scheduler.requests[rid]
            watch.decode_request_steps += 1
            first = request.num_output_tokens == 1
            watch.first_decode_steps += first
            if plan.drafted_lengths.get(rid, 0) > 0:
                continue
            watch.first_decode_draftless += first
            room = request.max_tokens - request.num_output_tokens - 1
            item = watch.last_item.get(rid)
            if room <= 0:
                cause = "no_room"
            elif watch.abandoned_now and rid in watch.abandoned_ids:
                cause = "abandoned"
            elif item is None or item[0] != request.num_tokens:
                cause = "not_sent"
            elif item[1] == 0:
                cause = "chunk"
            elif rid in core.planner.drafts:
                cause = "stale"
            else:
                cause = "other"
            watch.causes[cause] += 1
        return output

    link.send, link.abandon, link.poll = send, abandon, poll
    scheduler.schedule = schedule


def uninstrument(scheduler: Any) -> None:
    """Back to the classes' own methods before the next load wraps them again."""
    vars(scheduler).pop("schedule", None)
    for name in ("send", "abandon", "poll"):
        vars(scheduler.link).pop(name, None)


ABANDONED_KINDS = ("load_start", "queued_behind_abandoned", "newcomer_job_slow", "steady_job_slow", "late_start")


def abandoned_kinds(jobs: list[dict[str, Any]]) -> dict[str, int]:
    """Why each abandoned job was late, from the drafter's own timings (the engine handles a late reply only at its
    next poll, so arrival times say little): the first job of a load (every request's prompt at once); queued
    behind an abandoned job (the previous job was abandoned, and the drafter went from it to this one without
    idling, under 0.5 ms, or never started this one: it drops a job abandoned before it starts); its drafting alone
    longer than the budget (a job carrying a newcomer's prompt, or a steady one); or none of these: it started late,
    the drafter idle before it (its process waking up late on its loaded core), whether it then drafted within the
    budget or never started before being abandoned."""
    kinds = dict.fromkeys(ABANDONED_KINDS, 0)
    for i, job in enumerate(jobs):
        if not job["abandoned"]:
            continue
        started = job["draft_s"] is not None  # (no reply: the drafter dropped it unstarted when it was abandoned)
        if i == 0:
            kinds["load_start"] += 1
        elif jobs[i - 1]["abandoned"] and (not started or (job["idle_s"] is not None and job["idle_s"] < 0.0005)):
            kinds["queued_behind_abandoned"] += 1
        elif job["draft_s"] is not None and job["budget_s"] is not None and job["draft_s"] > job["budget_s"]:
            kinds["newcomer_job_slow" if job["newcomer"] else "steady_job_slow"] += 1
        else:
            kinds["late_start"] += 1
    return kinds


def draft_time_spread(jobs: list[dict[str, Any]]) -> list[float]:
    """Each answered job's drafting time (the drafter's own measure) over the median of the jobs of its size and
    kind (carrying a newcomer's prompt or not) in the same load: how much the drafter's time for one job shape
    varied. Deciles p0-p90, then the maximum. (Late starts are not in it: the twin models queueing, not waking.)"""
    groups: dict[tuple[int, bool], list[float]] = {}
    for job in jobs:
        if job["draft_s"] is not None:
            groups.setdefault((job["requests"], job["newcomer"]), []).append(job["draft_s"])
    ratios = sorted(s / statistics.median(times) for times in groups.values() if len(times) >= 5 for s in times)
    if not ratios:
        return []
    return [round(ratios[min(len(ratios) - 1, int(q * len(ratios) / 10))], 3) for q in range(10)] + [
        round(ratios[-1], 3)]


def start_delay_ms(jobs: list[dict[str, Any]]) -> list[float]:
    """How long after its sending a job's drafting began, where the drafter was idle (not queued behind another job)
    and the job was waited for and arrived: its reply's arrival less its drafting time (the drafter process waking
    up and reading it, and the reply's way back). Deciles p0-p90, then the maximum. Not a clean measure: a reply
    that came before the engine began waiting is read at its first poll, so the engine's own work after sending
    counts in (high); jobs that started later than the budget allowed were abandoned and are left out (low)."""
    delays = sorted(1000 * (job["arrived_at"] - job["sent_at"] - job["draft_s"]) for i, job in enumerate(jobs)
                    if not job["abandoned"] and job["arrived_at"] is not None and job["draft_s"] is not None
                    and i and not jobs[i - 1]["abandoned"] and (job["idle_s"] or 0.0) >= 0.0005)
    if not delays:
        return []
    return [round(max(0.0, delays[min(len(delays) - 1, int(q * len(delays) / 10))]), 3) for q in range(10)] + [
        round(delays[-1], 3)]


def newcomer_catch_up_ms_per_token(jobs: list[dict[str, Any]]) -> float | None:
    """What a newcomer's prompt costs the drafter per token in this load: among answered jobs of the load's usual
    size, the median drafting time of jobs carrying a newcomer's prompt less that of steady jobs, over the difference
    in their median catch-up tokens (a load's first job, every prompt at once, left out). The torch drafter takes a
    prompt over 16 tokens in a pass of its own, so this need not be the same at every job size."""
    answered = [job for job in jobs if job["draft_s"] is not None and job["catch_up"] < 1000]
    if not answered:
        return None
    size = statistics.mode(job["requests"] for job in answered)
    steady = [job for job in answered if job["requests"] == size and not job["newcomer"]]
    newcomer = [job for job in answered if job["requests"] == size and job["newcomer"]]
    if len(steady) < 5 or len(newcomer) < 3:
        return None
    tokens = statistics.median(j["catch_up"] for j in newcomer) - statistics.median(j["catch_up"] for j in steady)
    seconds = statistics.median(j["draft_s"] for j in newcomer) - statistics.median(j["draft_s"] for j in steady)
    return round(1000 * seconds / tokens, 4) if tokens > 0 else None


def summary(watch: Watch, mode: str, concurrency: int, tokens_per_s: float, records: list[Any],
            totals: Any) -> dict[str, Any]:
    decode = [r for r in records if r.num_decode_requests > 0]
    num_decode = sum(r.num_decode_requests for r in decode)
    with_drafts = sum(r.num_requests_with_drafts for r in decode)
    draftless = sum(watch.causes.values())
    return {
        "mode": mode, "concurrency": concurrency, "tokens_per_s": round(tokens_per_s, 1),
        "decode_request_steps": watch.decode_request_steps,
        "draftless_request_steps": draftless,
        "draftless_share": round(draftless / max(1, watch.decode_request_steps), 4),
        # The step records' own count (num_decode_requests vs num_requests_with_drafts), as the cross-check read it.
        "records_draftless_share": round(1 - with_drafts / max(1, num_decode), 4),
        "causes": {cause: watch.causes.get(cause, 0) for cause in CAUSES},
        "cause_shares": {cause: round(watch.causes.get(cause, 0) / max(1, draftless), 3) for cause in CAUSES},
        "first_decode_steps": watch.first_decode_steps, "first_decode_draftless": watch.first_decode_draftless,
        "steps": watch.steps, "steps_abandoned": watch.steps_abandoned,
        "jobs": len(watch.job_sizes), "jobs_with_newcomer": sum(watch.job_has_newcomer.values()),
        "newcomer_jobs_abandoned": watch.newcomer_jobs_abandoned,
        "mean_job_requests": round(statistics.mean(watch.job_sizes), 2) if watch.job_sizes else None,
        "mean_job_catch_up_tokens": round(statistics.mean(watch.job_catch_up), 1) if watch.job_catch_up else None,
        "max_job_catch_up_tokens": max(watch.job_catch_up, default=0),
        "wait_budget_ms_median": round(statistics.median(watch.budgets_ms), 2) if watch.budgets_ms else None,
        "draft_ms_median_steady_jobs": (round(statistics.median(watch.draft_ms_steady), 2)
                                        if watch.draft_ms_steady else None),
        "draft_ms_median_newcomer_jobs": (round(statistics.median(watch.draft_ms_newcomer), 2)
                                          if watch.draft_ms_newcomer else None),
        "verify_ms_median": round(1000 * statistics.median(r.verify_seconds for r in decode), 2) if decode else None,
        "deadline_misses": totals.deadline_misses, "drafter_restarts": totals.drafter_restarts,
        "abandoned_by_kind": abandoned_kinds([watch.jobs[i] for i in sorted(watch.jobs)]),
        "draft_time_spread_deciles": draft_time_spread([watch.jobs[i] for i in sorted(watch.jobs)]),
        "start_delay_ms_deciles": start_delay_ms([watch.jobs[i] for i in sorted(watch.jobs)]),
        "newcomer_catch_up_ms_per_token": newcomer_catch_up_ms_per_token(list(watch.jobs.values())),
        "job_log": [{"job_id": job_id, **job} for job_id, job in sorted(watch.jobs.items())],
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from minedraft.bench.workload import Workload, bench_prompts, run_workload
    from minedraft.cli import build_parser
    from minedraft.engine.async_engine import AsyncEngine
    from minedraft.engine.settings import Mode
    from minedraft.engine_options import _pair_dir, ensure_pair, settings_from_args

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    engine_args = build_parser().parse_args(["bench", "-k", str(args.k), "--kv-cache-gib", "1"])
    base = replace(settings_from_args(engine_args), lend_drafter_cores=False)
    base = base.with_changes(max_num_seqs=max(max(concurrencies), base.max_num_seqs))
    pair = ensure_pair(_pair_dir(None))
    prompts = bench_prompts(pair, max(64, args.requests_per_concurrency * max(concurrencies)))
    engine = await AsyncEngine.create(replace(base, mode=Mode.PSD, num_speculative_tokens=args.k))
    rows = []
    try:
        await run_workload(engine, Workload(prompts[:2], 2, args.max_tokens))  # warm-up
        scheduler = engine.engine.psd_scheduler
        for round_index, concurrency, mode_name in ((r, c, m) for r in range(args.rounds) for c in concurrencies
                                                    for m in args.modes.split(",")):
            mode = Mode(mode_name)
            await engine.call(lambda e, m=mode: e.set_mode(m, args.k))
            watch = Watch()
            instrument(scheduler, watch)
            before = engine.engine.totals()
            records = engine.engine.step_records()
            first = records[-1].step if records else 0
            chosen = [prompts[i % len(prompts)] for i in range(args.requests_per_concurrency * concurrency)]
            results, seconds = await run_workload(engine, Workload(chosen, concurrency, args.max_tokens))
            uninstrument(scheduler)
            after = engine.engine.totals()
            after.deadline_misses -= before.deadline_misses
            after.drafter_restarts -= before.drafter_restarts
            tokens = sum(len(r.token_ids) for r in results)
            row = summary(watch, mode.value, concurrency, tokens / seconds,
                          [r for r in engine.engine.step_records(first) if r.step > first], after)
            row["round"] = round_index + 1
            rows.append(row)
            log(json.dumps({key: value for key, value in row.items() if key != "job_log"}))
    finally:
        await engine.shutdown()
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| requests | mode | tok/s | request-steps | without drafts | " + " | ".join(CAUSES)
             + " | steps abandoned | abandoned: load start / queued behind one / newcomer job's drafting slow / "
             "steady job's drafting slow / late start | "
             "jobs (with a newcomer; of those abandoned) | wait budget ms | draft ms steady / newcomer jobs | "
             "a job's drafting time / its shape's median, p50 p90 max | start delay ms (idle drafter), p50 p90 | "
             "a newcomer's catch-up, ms per token |",
             "|---|---|---|---|---|" + "---|" * len(CAUSES) + "---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['concurrency']} | {r['mode']} | {r['tokens_per_s']} | {r['decode_request_steps']} | "
            f"{r['draftless_request_steps']} ({r['draftless_share']:.1%}) | "
            + " | ".join(f"{r['causes'][c]}" for c in CAUSES)
            + f" | {r['steps_abandoned']}/{r['steps']} | "
            + " / ".join(str(r["abandoned_by_kind"][k]) for k in ABANDONED_KINDS)
            + f" | {r['jobs']} ({r['jobs_with_newcomer']}; "
            f"{r['newcomer_jobs_abandoned']}) | {r['wait_budget_ms_median']} | "
            f"{r['draft_ms_median_steady_jobs']} / {r['draft_ms_median_newcomer_jobs']} | "
            + (" ".join(str(r["draft_time_spread_deciles"][i]) for i in (5, 9, 10))
               if r["draft_time_spread_deciles"] else "") + " | "
            + (" ".join(str(r["start_delay_ms_deciles"][i]) for i in (5, 9)) if r["start_delay_ms_deciles"] else "")
            + f" | {r['newcomer_catch_up_ms_per_token']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--modes", default="sd")
    parser.add_argument("--concurrency", default="16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1, help="every load this many times (interleaved)")
    parser.add_argument("--json", help="write the rows here (without the per-job log)")
    parser.add_argument("--md", help="write the table here, with the command")
    parser.add_argument("--job-log", help="write the rows with every job's log here")
    parser.add_argument("--rescore", help="start no engine: recompute the causes of abandonment and the spreads from "
                        "a --job-log file of an earlier run (after a change to how they are derived)")
    args = parser.parse_args(argv)
    if args.rescore:
        rows = json.loads(Path(args.rescore).read_text())
        for row in rows:
            row["abandoned_by_kind"] = abandoned_kinds(row["job_log"])
            row["draft_time_spread_deciles"] = draft_time_spread(row["job_log"])
            row["start_delay_ms_deciles"] = start_delay_ms(row["job_log"])
            row["newcomer_catch_up_ms_per_token"] = newcomer_catch_up_ms_per_token(row["job_log"])
    else:
        rows = asyncio.run(run(args))
    if args.job_log:
        Path(args.job_log).write_text(json.dumps(rows) + "\n")
    for row in rows:
        row.pop("job_log", None)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    table = markdown(rows)
    if args.md:
        command = "python benchmarks/draftless_steps.py " + " ".join(argv if argv is not None else sys.argv[1:])
        Path(args.md).write_text(f"# Decode steps without drafts in the engine, by cause\n\nCommand: `{command}`\n\n"
                                 f"{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
