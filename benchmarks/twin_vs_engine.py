"""Cross-check the twin against the real engine, in one run on this machine:

1. cost curves measured now through the engine itself (`minedraft.bench.calibrate`: ar and sd loads at batches
   1-16, every decode step's verification and every draft job timed by the engine; vLLM's kernels, the engine's
   drafter process, its host work per step and its prefill cost per prompt token);
2. the engine benched now in the same session: ar, sd and psd at three concurrencies, closed-loop loads of N requests
   through `minedraft bench`'s own load runner (output tokens over the makespan), interleaved with the calibration's
   loads round by round so that both see the machine alike (the best round counts: on a shared machine
   interference only ever slows the engine, and the calibration takes each shape's least contended load alike);
3. the twin on those curves, with the acceptance per position the bench measured, at the same loads;
and, as the old baseline, the twin on the profiler's eager-torch curves (benchmarks/curves/cpu-local-pair.json).

    python benchmarks/twin_vs_engine.py            # ~8 minutes on a contended 2-core machine (4 rounds)
    python benchmarks/twin_vs_engine.py --twin-only   # seconds: today's twin against the committed engine figures
    python benchmarks/twin_vs_engine.py --twin-only --measure-catch-up   # + the drafter's catch-up price, measured
    python benchmarks/twin_vs_engine.py --twin-only --measure-catch-up --drafter-spread   # + its time spread and
                                                    # each load's catch-up price, as draftless_steps.py measured them

Both the calibration and the bench run the layout the twin models: the target on core 0, the drafter on core 1,
the target never widening onto the drafter's core (sd leaves the drafter's device idle while it verifies), and ar on
the target's core alone. Writes benchmarks/results/gpu-twin/cpu-vs-engine.{json,md} and the calibrated curves
beside them (cpu-vs-engine-curves.json). The twin runs the same closed loops (N requests, C in flight, fixed
output length, prefill priced at the calibrated cost per prompt token).
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minedraft.twin.costs import AcceptanceModel, Hardware, StepCosts  # noqa: E402
from minedraft.twin.curves import load_curves, parse_curves  # noqa: E402
from minedraft.twin.run import Workload, run_closed_loop  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "gpu-twin"
EAGER_CURVES = ROOT / "benchmarks" / "curves" / "cpu-local-pair.json"
TARGET, DRAFTER = "pair-v1-target", "pair-v1-draft"
COMMAND = "python benchmarks/twin_vs_engine.py"
GOAL = 0.15
ARCHS: dict[str, Any] = {}
DEVICE = "CPU (this machine): target core 0, drafter core 1"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def acceptance_of(records: list[Any]) -> AcceptanceModel:
    """Per-position survival pooled over the evaluation's drafted steps (as the engine reports it)."""
    drafted: list[int] = []
    accepted: list[int] = []
    for record in records:
        for counts, values in ((drafted, record.drafted_per_position), (accepted, record.accepted_per_position)):
            counts.extend([0] * (len(values) - len(counts)))
            for i, value in enumerate(values):
                counts[i] += value
    return AcceptanceModel(tuple(a / d for a, d in zip(accepted, drafted, strict=False) if d > 0))


def _ms(seconds: list[float]) -> float | None:
    return round(statistics.mean(seconds) * 1000, 2) if seconds else None


def hardware_of(doc: dict[str, Any]) -> Hardware:
    """The engine's host work per step (by decoding requests, ar's and sd's) and its prefill cost, as measured."""
    by_batch = doc.get("step_overhead_ms_by_batch", {})

    def table(mode: str) -> tuple[tuple[float, float], ...]:
        return tuple((float(row["batch"]), float(row["ms"])) for row in by_batch.get(mode, []))

    overhead = doc["step_overhead_ms"]
    return Hardware(step_overhead_ms=overhead.get("ar", overhead.get("all", 0.0)),
                    drafting_step_overhead_ms=overhead.get("sd"), step_overhead_ms_by_batch=table("ar"),
                    drafting_step_overhead_ms_by_batch=table("sd"),
                    prefill_ms_per_token=doc.get("prefill_ms_per_token") or 0.0)


def own_costs(doc: dict[str, Any], records: list[Any], mode: str, k: int, context: int) -> StepCosts:
    """The calibrated curves with the shapes this load ran, its host work and its prefill replaced by what this
    load's own steps measured (at the same moment as its throughput)."""
    from minedraft.bench.calibrate import curves_from_records

    own = curves_from_records({"sd" if mode != "ar" else "ar": [records]}, (TARGET, ARCHS[TARGET]),
                              (DRAFTER, ARCHS[DRAFTER]), context, k, "", "")
    merged = json.loads(json.dumps(doc))
    for name, key, third in ((TARGET, "forward_ms", "new_tokens"), (DRAFTER, "draft_loop_ms", "k")):
        replaced = {(r["batch"], r[third]) for r in own["models"][name][key]}
        rows = [r for r in merged["models"][name][key] if (r["batch"], r[third]) not in replaced]
        merged["models"][name][key] = sorted(rows + own["models"][name][key], key=lambda r: (r[third], r["batch"]))
    kind = "ar" if mode == "ar" else "sd"
    merged["step_overhead_ms"].update({k: v for k, v in own["step_overhead_ms"].items() if k == kind})
    merged["step_overhead_ms_by_batch"].update(own["step_overhead_ms_by_batch"])
    merged["prefill_ms_per_token"] = own.get("prefill_ms_per_token") or doc.get("prefill_ms_per_token")
    return StepCosts.from_curves(parse_curves(merged), TARGET, DRAFTER, hardware_of(merged))


def twin_rows(measured: Any, costs: dict[str, StepCosts], acceptances: dict[int, AcceptanceModel], k: int,
              workload: Workload, num_requests: Any, doc: dict[str, Any], context: int) -> list[dict[str, Any]]:
    rows = []
    for (mode, concurrency), rates in sorted(measured.tokens_per_s.items(), key=lambda item: (item[0][1], item[0][0])):
        best_round = max(range(len(rates)), key=lambda i: rates[i])
        engine = rates[best_round]  # the least contended round (interference only ever slows the engine)
        round_records = measured.records[(mode, concurrency)][best_round]
        records = [r for r in round_records if r.num_decode_requests > 0]
        row: dict[str, Any] = {"concurrency": concurrency, "mode": mode, "engine_tokens_per_s": round(engine, 1),
                               "engine_tokens_per_s_by_round": [round(r, 1) for r in rates],
                               "engine_verify_ms_per_step": _ms([r.verify_seconds for r in records]),
                               "engine_draft_ms_per_step": _ms([r.draft_seconds for r in records
                                                                if r.draft_job_requests]),
                               "engine_wait_ms_per_step": _ms([r.wait_seconds for r in records])}
        load_costs = {**costs, "own_steps": own_costs(doc, round_records, mode, k, context)}
        for name, step_costs in load_costs.items():
            twin = run_closed_loop(step_costs, acceptances[concurrency], mode, k, concurrency,
                                   num_requests(concurrency), workload)
            row[f"twin_{name}_tokens_per_s"] = round(twin.tokens_per_s, 1)
            row[f"twin_{name}_over_engine"] = round(twin.tokens_per_s / engine, 3)
        rows.append(row)
    return rows


def measure_catch_up_ms_per_token(k: int, prompt_tokens: int, batches: tuple[int, ...] = (4, 8, 16),
                                  jobs_per_batch: int = 60, seed: int = 0) -> float | None:
    """The drafter's price per catch-up token, measured on the engine's CPU drafter (the torch backend over the
    local pair's draft model, pinned to the drafter's core 1 with one thread, as the calibration's layout runs it):
    jobs of 4-16 requests, each carrying 1 to k + 1 committed tokens per request (a verification's accepted tokens
    and bonus) and, every few jobs, a newcomer's whole prompt; fitted from each job's time to its first drafted
    token by the engine's own CatchUpPrice (the same fit the calibration makes of the engine's jobs)."""
    import os
    import random

    import torch

    from minedraft.engine.control.cost_model import CatchUpPrice
    from minedraft.engine.drafter.torch_backend import TorchLlamaDrafter
    from minedraft.engine_options import _pair_dir, ensure_pair

    os.sched_setaffinity(0, {1} if 1 in os.sched_getaffinity(0) else os.sched_getaffinity(0))
    torch.set_num_threads(1)
    pair = ensure_pair(_pair_dir(None))
    drafter = TorchLlamaDrafter(str(pair / "draft"), max_slots=2 * max(batches) + 8, max_model_len=2048)
    rng = random.Random(seed)
    price = CatchUpPrice(decay=1.0)
    vocab = min(drafter.vocab_size, 30000)
    serial = 0
    for batch in batches:
        contexts: dict[str, list[int]] = {}
        for _ in range(batch):
            serial += 1
            contexts[f"r{serial}"] = [rng.randrange(vocab) for _ in range(prompt_tokens)]
        drafter.draft([(rid, ctx, k) for rid, ctx in contexts.items()], False)  # every prompt in (not timed)
        for job in range(jobs_per_batch + 5):
            carried = 0
            if job % 4 == 1:  # a request finishes, a newcomer takes its place: its whole prompt rides in this job
                drafter.forget([next(iter(contexts))])
                del contexts[next(iter(contexts))]
                serial += 1
                contexts[f"r{serial}"] = [rng.randrange(vocab) for _ in range(prompt_tokens)]
                carried += prompt_tokens - 1
            for rid, ctx in contexts.items():
                if len(ctx) > prompt_tokens or job % 4 != 1 or rid != f"r{serial}":
                    new = rng.randint(1, k + 1)
                    ctx.extend(rng.randrange(vocab) for _ in range(new))
                    carried += new - 1
            drafter.draft([(rid, ctx, k) for rid, ctx in contexts.items()], False)
            if job >= 5:  # (the first jobs warm the allocator up)
                price.observe(batch, k, carried, drafter.last_first_token_seconds)
        drafter.forget(list(contexts))
    seconds = price.seconds_per_token()
    return None if seconds is None else seconds * 1000.0


def _with_catch_up_price(doc: dict[str, Any], ms_per_token: float, accepted_per_request: float) -> dict[str, Any]:
    """The curves with the drafter's catch-up priced: its loops net of the steady catch-up they hold (each request's
    accepted tokens since its last job, at the price), which the twin now charges per job instead."""
    priced = json.loads(json.dumps(doc))
    drafter = priced["models"][DRAFTER]
    drafter["catch_up_ms_per_token"] = ms_per_token
    for row in drafter["draft_loop_ms"]:
        row["ms"] = max(0.1 * row["ms"], row["ms"] - ms_per_token * row["batch"] * accepted_per_request)
    return priced


def drafter_spreads(path: Path) -> dict[tuple[str, int], tuple[float, ...]]:
    """The drafter's time spread per (mode, requests) as `benchmarks/draftless_steps.py` measured it in the engine
    (each load's deciles of a job's drafting time over its shape's median, the drafter's own measure; per decile the
    median over the rounds), and under ("*", 0) the same over every load (for loads it did not run). Its start
    delays are left out: measured from the engine's side they include the engine's own work before it reads a reply
    (tried: the twin then fell to 0.45-0.84x the engine at 1 and 4 requests)."""
    rows = [row for row in json.loads(path.read_text()) if row.get("draft_time_spread_deciles")]

    def pooled(chosen: list[dict[str, Any]]) -> tuple[float, ...]:
        # p0, p10, ..., p90: ten equally likely draws (the maximum left out).
        return tuple(round(statistics.median(row["draft_time_spread_deciles"][i] for row in chosen), 3)
                     for i in range(10))

    spreads = {(mode, c): pooled([r for r in rows if (r["mode"], r["concurrency"]) == (mode, c)])
               for mode, c in {(r["mode"], r["concurrency"]) for r in rows}}
    if rows:
        spreads[("*", 0)] = pooled(rows)
    return spreads


def load_catch_up_prices(path: Path) -> dict[tuple[str, int], float]:
    """A newcomer's catch-up price per (mode, requests) as the engine's own jobs showed it (draftless_steps.py: the
    median over the rounds). It grows with the job's size (the torch drafter is not linear in it), which one price
    for every load cannot show."""
    rows = [row for row in json.loads(path.read_text()) if row.get("newcomer_catch_up_ms_per_token")]
    return {(mode, c): statistics.median(r["newcomer_catch_up_ms_per_token"] for r in rows
                                         if (r["mode"], r["concurrency"]) == (mode, c))
            for mode, c in {(r["mode"], r["concurrency"]) for r in rows}}


def twin_only(path: Path, catch_up_ms_per_token: float | None = None, spread_path: Path | None = None) -> str:
    """The twin on the engine's curves now, against the engine's figures of the committed run (Markdown); with a
    catch-up price, beside the twin on the same curves with that price (one run: before and after); with the
    drafter's time spread measured in the engine (draftless_steps.py's results), beside that too (with the price,
    where given)."""
    report = json.loads(path.read_text())
    doc = json.loads(path.with_name(report["curves_file"]).read_text())
    costs = StepCosts.from_curves(parse_curves(doc), TARGET, DRAFTER, hardware_of(doc))
    spreads = drafter_spreads(spread_path) if spread_path is not None else {}
    load_prices = load_catch_up_prices(spread_path) if spread_path is not None else {}
    workload = Workload(prompt_tokens=report["prompt_tokens_mean"], output_tokens=report["max_tokens"],
                        output_spread=0.0)
    priced = catch_up_ms_per_token is not None
    header = "| concurrency | mode | engine tok/s | twin/engine then | twin/engine now |"
    if priced:
        header += (f" twin/engine now, catch-up at {catch_up_ms_per_token:.4f} ms/token | twin's late draft jobs "
                   "(unpriced, priced) |")
    if spreads:
        header += (" twin/engine, + the drafter's time spread and this load's catch-up price, as measured | "
                   "its late draft jobs |")
    lines = [f"Twin on the engine's curves now (`{COMMAND} --twin-only`) against the engine's figures recorded in "
             f"{path.name}:", "", header, "|---|---|---|---|---|" + ("---|---|" if priced else "")
             + ("---|---|" if spreads else "")]
    within = within_priced = within_spread = 0
    for row in report["rows"]:
        concurrency = row["concurrency"]
        acceptance = AcceptanceModel(tuple(report["acceptance_per_position"][str(concurrency)]))
        twin = run_closed_loop(costs, acceptance, row["mode"], report["k"], concurrency,
                               report["requests_per_load"][str(concurrency)], workload)
        ratio = twin.tokens_per_s / row["engine_tokens_per_s"]
        within += abs(ratio - 1) <= GOAL
        line = (f"| {concurrency} | {row['mode']} | {row['engine_tokens_per_s']} | "
                f"{row['twin_engine_curves_over_engine']} | {ratio:.3f} |")
        misses = twin.deadline_misses
        if catch_up_ms_per_token is not None:
            accepted = acceptance.expected_accepted_length(report["k"]) - 1.0
            priced_doc = _with_catch_up_price(doc, catch_up_ms_per_token, accepted)
            priced_costs = StepCosts.from_curves(parse_curves(priced_doc), TARGET, DRAFTER, hardware_of(priced_doc))
            twin = run_closed_loop(priced_costs, acceptance, row["mode"], report["k"], concurrency,
                                   report["requests_per_load"][str(concurrency)], workload)
            priced_ratio = twin.tokens_per_s / row["engine_tokens_per_s"]
            within_priced += abs(priced_ratio - 1) <= GOAL
            line += f" {priced_ratio:.3f} | {misses}, {twin.deadline_misses} |"
        if spreads:
            load_price = load_prices.get((row["mode"], concurrency), catch_up_ms_per_token)
            base_doc = doc if load_price is None else _with_catch_up_price(
                doc, load_price, acceptance.expected_accepted_length(report["k"]) - 1.0)
            spread = spreads.get((row["mode"], concurrency), spreads.get(("*", 0), ()))
            hardware = replace(hardware_of(base_doc), drafter_time_spread=spread)
            spread_costs = StepCosts.from_curves(parse_curves(base_doc), TARGET, DRAFTER, hardware)
            twin = run_closed_loop(spread_costs, acceptance, row["mode"], report["k"], concurrency,
                                   report["requests_per_load"][str(concurrency)], workload)
            spread_ratio = twin.tokens_per_s / row["engine_tokens_per_s"]
            within_spread += abs(spread_ratio - 1) <= GOAL
            line += f" {spread_ratio:.3f} | {twin.deadline_misses} |"
        lines.append(line)
    lines += ["", f"{within}/{len(report['rows'])} within {GOAL:.0%} now (then: {report['points_within_goal']})"
              + (f"; {within_priced}/{len(report['rows'])} with the catch-up priced" if priced else "")
              + (f"; {within_spread}/{len(report['rows'])} with the drafter's time spread and each load's price"
                 if spreads else "")
              + "."]
    if spreads:
        lines += ["", "Drafter time spreads used (multipliers of a job's time, ten equally likely draws each, from "
                  f"{spread_path.name if spread_path else ''}; `*`: pooled, for loads it did not run): "
                  + "; ".join(f"{mode} at {c}: {', '.join(str(v) for v in values)}"
                              for (mode, c), values in sorted(spreads.items())),
                  "", "Catch-up prices per load used there (ms per token, a newcomer's as the engine's own jobs showed "
                  "it; loads not measured: the price above): "
                  + "; ".join(f"{mode} at {c}: {price:.4f}" for (mode, c), price in sorted(load_prices.items()))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--concurrency", default="1,4,16", help="the bench's loads (three, comma-separated)")
    parser.add_argument("--batches", default="1,2,4,8,16", help="the calibration's batch grid")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=str(OUT / "cpu-vs-engine.json"))
    parser.add_argument("--session", help="pickle the engine session's measurements here (or, if the file exists, "
                        "reuse them instead of starting the engine: to redo the twin's side only)")
    parser.add_argument("--twin-only", action="store_true",
                        help="start no engine: rerun the twin on the committed curves, loads and acceptance of --out "
                        "and print it beside the engine figures recorded there (after a change to the twin)")
    parser.add_argument("--catch-up-ms-per-token", type=float,
                        help="with --twin-only: also run the twin with the drafter's catch-up priced at this")
    parser.add_argument("--drafter-spread", nargs="?", const=str(OUT / "draftless-steps.json"),
                        help="with --twin-only: also run the twin with the drafter's time spread and each load's "
                        "catch-up price measured in the engine by benchmarks/draftless_steps.py (default: its "
                        "committed results)")
    parser.add_argument("--measure-catch-up", action="store_true",
                        help="with --twin-only: measure that price on the engine's CPU drafter first (~1 minute)")
    args = parser.parse_args(argv)
    if args.twin_only:
        price = args.catch_up_ms_per_token
        if args.measure_catch_up:
            report = json.loads(Path(args.out).read_text())
            log("measuring the drafter's catch-up price (torch drafter, core 1)")
            price = measure_catch_up_ms_per_token(report["k"], report["prompt_tokens_mean"])
            log(f"catch-up price: {price} ms per token")
        print(twin_only(Path(args.out), price, Path(args.drafter_spread) if args.drafter_spread else None))
        return 0

    from minedraft.bench.calibrate import CalibrationSettings, calibrate, document
    from minedraft.bench.workload import bench_prompts
    from minedraft.cli import build_parser
    from minedraft.engine_options import _pair_dir, ensure_pair, settings_from_args
    from minedraft.profile.architecture import load_hf_config

    out = Path(args.out)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    batches = tuple(int(b) for b in args.batches.split(","))
    engine_args = build_parser().parse_args(["bench", "--json", str(out), "-k", str(args.k), "--kv-cache-gib", "1"])
    base = replace(settings_from_args(engine_args), lend_drafter_cores=False)
    base = base.with_changes(max_num_seqs=max(max(concurrencies), max(batches), base.max_num_seqs))
    pair = ensure_pair(_pair_dir(None))
    prompts = bench_prompts(pair, max(64, args.requests_per_concurrency * max(concurrencies), 3 * max(batches)))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(pair / "target"))
    prompt_tokens = round(statistics.mean(len(tokenizer(p)["input_ids"]) for p in prompts))
    context = prompt_tokens + args.max_tokens // 2
    ARCHS.update({TARGET: load_hf_config(pair / "target"), DRAFTER: load_hf_config(pair / "draft")})
    target, drafter = (TARGET, ARCHS[TARGET]), (DRAFTER, ARCHS[DRAFTER])

    log(f"one engine session, {args.rounds} rounds: calibration at batches {batches} (ar, sd k={args.k}), then "
        f"ar, sd, psd at {concurrencies}")
    started = time.perf_counter()
    settings = CalibrationSettings(k=args.k, batches=batches, max_tokens=args.max_tokens,
                                   requests_per_batch=args.requests_per_concurrency)
    session = Path(args.session) if args.session else None
    if session is not None and session.exists():
        _, measured, session_s = pickle.loads(session.read_bytes())
        doc = document(base, settings, measured, context, target, drafter, DEVICE, args.rounds)
        doc["command"] = COMMAND
    else:
        doc, measured = calibrate(base, settings, prompts, context, target, drafter,
                                  device=DEVICE,
                                  evaluate=concurrencies, rounds=args.rounds)
        doc["command"] = COMMAND
        session_s = time.perf_counter() - started
        if session is not None:
            session.write_bytes(pickle.dumps((doc, measured, session_s)))
    curves_path = out.with_name(out.stem + "-curves.json")
    curves_path.parent.mkdir(parents=True, exist_ok=True)
    curves_path.write_text(json.dumps(doc, indent=1) + "\n")
    log(f"session {session_s:.0f} s: host work per step {doc['step_overhead_ms']} ms; wrote {curves_path}")

    # Acceptance is the prompts' (content), not a cost: each load's, pooled over its sd and psd rounds.
    acceptances = {c: acceptance_of([r for (mode, cc), runs in measured.records.items() if mode != "ar" and cc == c
                                     for run in runs for r in run]) for c in concurrencies}
    acceptance = acceptance_of([r for key, runs in measured.records.items() if key[0] != "ar"
                                for run in runs for r in run])
    prefill_ms = float(doc.get("prefill_ms_per_token") or 0.0)
    engine_curves = parse_curves(doc, str(curves_path))
    costs = {
        "engine_curves": StepCosts.from_curves(engine_curves, TARGET, DRAFTER, hardware_of(doc)),
        "eager_curves": StepCosts.from_curves(load_curves(EAGER_CURVES), TARGET, DRAFTER, Hardware()),
    }
    workload = Workload(prompt_tokens=prompt_tokens, output_tokens=args.max_tokens, output_spread=0.0)
    rows = twin_rows(measured, costs, acceptances, args.k, workload, settings.num_requests, doc, context)
    within = [abs(r["twin_engine_curves_over_engine"] - 1) <= GOAL for r in rows]
    within_own = [abs(r["twin_own_steps_over_engine"] - 1) <= GOAL for r in rows]
    report = {
        "command": COMMAND, "k": args.k, "concurrencies": concurrencies, "max_tokens": args.max_tokens,
        "prompt_tokens_mean": prompt_tokens, "session_seconds": round(session_s), "rounds": args.rounds,
        "requests_per_load": {str(c): settings.num_requests(c) for c in concurrencies},
        "acceptance_per_position": {str(c): [round(v, 3) for v in a.survival] for c, a in acceptances.items()},
        "step_overhead_ms": doc["step_overhead_ms"], "prefill_ms_per_token": prefill_ms,
        "curves_file": curves_path.name, "goal": f"twin / engine within {1 - GOAL:.2f}-{1 + GOAL:.2f}",
        "points_within_goal": f"{sum(within)}/{len(within)}",
        "points_within_goal_own_steps": f"{sum(within_own)}/{len(within_own)}", "rows": rows,
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    md = ["# The twin against the real engine, same run (CPU, local pair)", "",
          f"Command: `{COMMAND}`. One engine session of {session_s:.0f} s ({args.rounds} rounds, each the "
          "calibration's loads then the evaluation's; the engine's tok/s is its best round and each curve point "
          "its least contended load's median, interference only ever slowing either; "
          f"{args.max_tokens} output tokens per request, prompts {prompt_tokens} tokens on average, k = {args.k}). "
          "Target on core 0, drafter on core 1, the target never widening onto the drafter's core; ar on core 0.", "",
          f"Inputs measured by the calibration (the engine's own steps): host work per step "
          f"{doc['step_overhead_ms']} ms (median over all steps), by decoding requests "
          f"{doc['step_overhead_ms_by_batch']} (the twin interpolates ar's for ar steps, sd's for sd and psd steps), "
          f"prefill {prefill_ms:.3f} ms per prompt token; acceptance per position (from the evaluation, each load's "
          f"own; pooled: {', '.join(f'{v:.2f}' for v in acceptance.survival)}).",
          "",
          "| requests | mode | engine verify ms/step | engine draft ms/step | engine tok/s | "
          "twin (engine curves) tok/s | twin / engine | twin (this load's own step costs) / engine | "
          "twin (eager torch curves) / engine |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['concurrency']} | {r['mode']} | {r['engine_verify_ms_per_step']} | "
                  f"{r['engine_draft_ms_per_step']} | {r['engine_tokens_per_s']} | "
                  f"{r['twin_engine_curves_tokens_per_s']} | {r['twin_engine_curves_over_engine']} | "
                  f"{r['twin_own_steps_over_engine']} | "
                  f"{r['twin_eager_curves_over_engine']} |")
    md += ["", f"Within {GOAL:.0%}: {sum(within)} of {len(within)} points on the calibrated curves, "
           f"{sum(within_own)} of {len(within_own)} on each load's own step costs."]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    log(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
