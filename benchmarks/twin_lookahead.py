"""Lookahead in the twin (the engine's own core, planner, drafter link and auto on simulated time) on the H200 curves
for Qwen3-32B + Qwen3-1.7B (TP = 1, the drafter on its own GPU, 2.5 ms host work per step), against sd and every
fixed mode, and auto (AutoSettings' defaults: ar, sd, psd and lookahead) against the best fixed mode and vLLM's
colocated SD (`vllm-sd`, the drafter on the target's GPU, per replica) on the shared curves and on curve files auto
was not tuned on.

Hit rates are not chosen: the twin simulates token ids (minedraft/twin/tokens.py) and the core takes a branch only
where its tail matches the committed tokens. The simulated target's token is the drafter's top choice with the
acceptance model's rate (0.8 per position for this pair) and otherwise the drafter's rank-r candidate with the local
pair's measured P(rank = r | rank >= 2) (benchmarks/lookahead_coverage.py); the hit rate that follows is reported.
The band section replaces that rank distribution with others (after a miss of its top choice, the target's token is
the drafter's second choice with probability c, else a token no candidate list holds) to span hit rates.

Sections (each writes its own JSON under benchmarks/results/gpu-twin/; `report` writes lookahead.md from them):
    python benchmarks/twin_lookahead.py vs-sd     # lookahead at its best k vs sd at its best k, 8-64 requests
    python benchmarks/twin_lookahead.py band      # the same across coverage (hit rates ~0.55-0.85)
    python benchmarks/twin_lookahead.py auto [--curves NAME ...] [--loads 1,2,...] [--auto-only]
                                                  # auto vs the best fixed mode and vllm-sd at 1-256, ten curve files
    python benchmarks/twin_lookahead.py fanout8   # lookahead with --lookahead-fanout 8 (no backups)
    python benchmarks/twin_lookahead.py report
    python benchmarks/twin_lookahead.py all       # every section, then the report
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minedraft.engine.control.auto import AutoSettings  # noqa: E402
from minedraft.engine.control.cost_model import LOCAL_PAIR_RANK_GIVEN_REJECTION, branch_hit_rate  # noqa: E402
from minedraft.twin.costs import DEFAULT_GPU_HOST_MS_PER_STEP, AcceptanceModel, Hardware, StepCosts  # noqa: E402
from minedraft.twin.curves import load_curves, parse_curves  # noqa: E402
from minedraft.twin.run import LookaheadOptions, RunResult, run_concurrency  # noqa: E402
from minedraft.twin.sweep import SweepSettings, sweep  # noqa: E402
from minedraft.twin.synthetic import flatter_target, slow_drafter  # noqa: E402

CURVES = ROOT / "benchmarks" / "curves" / "h200-qwen3-32b.json"
OUT = ROOT / "benchmarks" / "results" / "gpu-twin"
ACCEPTANCE = 0.8
KS = (1, 2, 3, 4, 5)
LOADS = (8, 16, 32, 64)
AUTO_LOADS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Lookahead's variants: the engine's defaults (--lookahead-fanout 6, a miss verified with a backup branch), and
# --no-lookahead-backups (a miss verified without drafts, its root drafted for the next round).
VARIANTS = {"default": LookaheadOptions(), "no_backups": LookaheadOptions(backups=False),
            "no_backups_f8": LookaheadOptions(fanout=8, backups=False)}
BAND = (0.0, 0.25, 0.5, 0.75, 1.0)
COMMAND = "python benchmarks/twin_lookahead.py"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def costs_of(curves: Any, drafter: str = "qwen3-1.7b") -> StepCosts:
    return StepCosts.from_curves(curves, "qwen3-32b", drafter, Hardware(step_overhead_ms=DEFAULT_GPU_HOST_MS_PER_STEP))


def best(runs: list[RunResult]) -> RunResult:
    return max(runs, key=lambda r: r.tokens_per_s)


def run_row(run: RunResult) -> dict[str, Any]:
    row: dict[str, Any] = {"mode": run.mode, "tokens_per_s": round(run.tokens_per_s, 1)}
    if run.mean_fanout:
        row.update(fanout=round(run.mean_fanout, 2), branch_hit_rate=round(run.branch_hit_rate, 3))
    return row


def vs_sd(costs: StepCosts, ranks: tuple[float, ...] = LOCAL_PAIR_RANK_GIVEN_REJECTION,
          variants: tuple[str, ...] = ("default", "no_backups"), loads: tuple[int, ...] = LOADS,
          sd_cache: dict[int, RunResult] | None = None) -> list[dict[str, Any]]:
    acceptance = AcceptanceModel.constant(ACCEPTANCE)
    rows = []
    for c in loads:
        sd = sd_cache.get(c) if sd_cache is not None else None
        if sd is None:
            sd = best([run_concurrency(costs, acceptance, "sd", k, c) for k in KS])
            if sd_cache is not None:
                sd_cache[c] = sd
        row: dict[str, Any] = {"concurrency": c, "sd": run_row(sd)}
        for variant in variants:
            options = dataclasses.replace(VARIANTS[variant], rank_given_rejection=ranks)
            runs = [run_concurrency(costs, acceptance, "lookahead", k, c, lookahead=options) for k in KS]
            top = best(runs)
            row[f"lookahead_{variant}"] = {**run_row(top), "over_sd": round(top.tokens_per_s / sd.tokens_per_s, 3),
                                           "by_k": {r.mode: run_row(r) for r in runs}}
            log(f"c={c} {variant}: {top.mode} {top.tokens_per_s:.0f} tok/s (hits {top.branch_hit_rate:.2f}, "
                f"F {top.mean_fanout:.1f}) vs {sd.mode} {sd.tokens_per_s:.0f}: "
                f"{top.tokens_per_s / sd.tokens_per_s:.3f}x")
        rows.append(row)
    return rows


def derived_table() -> dict[str, Any]:
    """The cost model's derived hit share (the engine's branch policy, steady state) at 0.8 acceptance and the local
    pair's ranks: what auto prices lookahead with before it has run."""
    conditionals = [ACCEPTANCE] * 8
    return {f"k{k}": {f"F{f}": round(branch_hit_rate(conditionals, k, f), 3) for f in (1, 2, 3, 4, 6, 8)} for k in KS}


def section_vs_sd() -> dict[str, Any]:
    costs = costs_of(load_curves(CURVES))
    return {"command": f"{COMMAND} vs-sd", "curves": str(CURVES.relative_to(ROOT)), "acceptance": ACCEPTANCE,
            "host_ms_per_step": DEFAULT_GPU_HOST_MS_PER_STEP, "rank_given_rejection": LOCAL_PAIR_RANK_GIVEN_REJECTION,
            "derived_hit_share": derived_table(), "rows": vs_sd(costs)}


def section_band() -> dict[str, Any]:
    costs = costs_of(load_curves(CURVES))
    cache: dict[int, RunResult] = {}
    points = []
    for c_value in BAND:
        ranks = (c_value,) if c_value else ()
        log(f"band: rank-2 share after a miss {c_value}")
        points.append({"rank2_after_miss": c_value, "rows": vs_sd(costs, ranks, sd_cache=cache)})
    return {"command": f"{COMMAND} band", "curves": str(CURVES.relative_to(ROOT)), "acceptance": ACCEPTANCE,
            "points": points}


def section_fanout8() -> dict[str, Any]:
    costs = costs_of(load_curves(CURVES))
    return {"command": f"{COMMAND} fanout8", "curves": str(CURVES.relative_to(ROOT)), "acceptance": ACCEPTANCE,
            "rows": vs_sd(costs, variants=("no_backups_f8",))}


# The curve files auto is judged on: the shared H200 curves, and files it was not tuned on (drafter slowed x2, eager
# drafting x6, a drafter twice as fast, a flatter verify curve: the target's growth above its floor halved).
AUTO_FILES = {
    "shared": "h200 (shared curves)",
    "drafter-x2": "h200, drafter x2 (perturbed)",
    "eager": "h200, eager drafter (drafts x6)",
    "drafter-x0.5": "h200, drafter x0.5 (a cheaper drafter)",
    "flat-verify": "h200, flatter verify (target's growth above its floor x0.5)",
    # Five more, first run as a probe of files auto had not been tuned on (docs/gpu.md: one cell at 0.865, 64
    # requests on growth x0.25); committed since, so no longer unseen.
    "drafter-x3": "h200, drafter x3",
    "drafter-x0.25": "h200, drafter x0.25 (sd's regime: drafting nearly free)",
    "steep-verify": "h200, steeper verify (target's growth above its floor x2)",
    "flatter-verify": "h200, flatter still (target's growth above its floor x0.25)",
    "drafter-0.6b": "h200, the curves' Qwen3-0.6B as drafter (acceptance 0.8 kept)",
}
# The drafter each file runs with (the 1.7B where not named).
AUTO_DRAFTERS = {"drafter-0.6b": "qwen3-0.6b"}


def auto_curves(name: str) -> dict[str, Any]:
    shared = json.loads(CURVES.read_text())
    return {"shared": lambda: shared, "drafter-x2": lambda: slow_drafter(shared, 2.0),
            "eager": lambda: slow_drafter(shared, 6.0),
            "drafter-x0.5": lambda: slow_drafter(shared, 0.5, "faster drafter"),
            "flat-verify": lambda: flatter_target(shared, 0.5),
            "drafter-x3": lambda: slow_drafter(shared, 3.0, "slower drafter"),
            "drafter-x0.25": lambda: slow_drafter(shared, 0.25, "faster drafter"),
            "steep-verify": lambda: flatter_target(shared, 2.0),
            "flatter-verify": lambda: flatter_target(shared, 0.25),
            "drafter-0.6b": lambda: shared}[name]()


def auto_costs(name: str) -> StepCosts:
    return costs_of(parse_curves(auto_curves(name), name), AUTO_DRAFTERS.get(name, "qwen3-1.7b"))


def auto_sweep(costs: StepCosts, lookahead: LookaheadOptions | None = None,
               loads: tuple[int, ...] = AUTO_LOADS) -> list[dict[str, Any]]:
    """Every fixed mode at every k (vLLM's colocated SD beside), auto with AutoSettings' defaults (ar, sd, psd and
    lookahead: `auto`), and auto among ar, sd and psd (`auto_without_lookahead`). `lookahead`: lookahead's options
    (default: the engine's)."""
    settings = SweepSettings(concurrencies=loads, ks=KS, families=("ar", "sd", "psd", "lookahead", "vllm-sd"),
                             lookahead=lookahead or LookaheadOptions(), auto=AutoSettings(k_candidates=KS),
                             confirm=True)
    acceptance = AcceptanceModel.constant(ACCEPTANCE)
    rows = []
    for load in sweep(costs, acceptance, settings, progress=log):
        top = load.best(("ar", "sd", "psd", "lookahead"))
        vllm = load.best(("vllm-sd",))
        auto = load.auto
        assert auto is not None
        by_family = {}
        for family in ("ar", "sd", "psd", "lookahead"):
            runs = [r for label, r in load.runs.items() if label.split("-k")[0] == family]
            by_family[family] = run_row(best(runs))
        without = run_concurrency(costs, acceptance, "auto", 0, load.concurrency, settings.workload,
                                  settings.auto_warmup_steps, settings.auto_measure_steps, settings.seed,
                                  auto=AutoSettings(k_candidates=KS, allowed_modes=("ar", "sd", "psd")))
        row = {"concurrency": load.concurrency, "best_fixed": run_row(top), "by_family": by_family,
               "vllm_sd": run_row(vllm)}
        for name, run in (("auto", auto), ("auto_without_lookahead", without)):
            row[name] = auto_entry(run, top.tokens_per_s, vllm.tokens_per_s)
        log(f"c={load.concurrency}: auto {auto.tokens_per_s:.0f} ({auto.tokens_per_s / top.tokens_per_s:.3f}x best "
            f"{top.mode}, {auto.tokens_per_s / vllm.tokens_per_s:.3f}x {vllm.mode}); without lookahead "
            f"{without.tokens_per_s:.0f} ({without.tokens_per_s / top.tokens_per_s:.3f}x)")
        rows.append(row)
    return rows


def auto_entry(run: RunResult, best_tokens_per_s: float, vllm_tokens_per_s: float) -> dict[str, Any]:
    mode, k = run.main_setting
    return {"tokens_per_s": round(run.tokens_per_s, 1), "runs": f"{mode}-k{k}" if k else mode,
            "steps_by_setting": run.steps_by_setting,
            "over_best_fixed": round(run.tokens_per_s / best_tokens_per_s, 3),
            "over_vllm_sd": round(run.tokens_per_s / vllm_tokens_per_s, 3)}


def section_auto_again(name: str, loads: tuple[int, ...] = AUTO_LOADS) -> dict[str, Any]:
    """Auto (both entries) run again on one curve file against the fixed modes its JSON holds: what a change to auto
    alone moves (the fixed modes do not run auto's code), in a fraction of the whole section's time."""
    log(f"auto again: {AUTO_FILES[name]}, loads {loads}")
    path = OUT / f"lookahead-auto-{name}.json"
    data = json.loads(path.read_text())
    costs = auto_costs(name)
    settings = SweepSettings(concurrencies=loads, ks=KS)
    acceptance = AcceptanceModel.constant(ACCEPTANCE)
    for row in data["rows"]:
        if row["concurrency"] not in loads:
            continue
        for entry, modes in (("auto", None), ("auto_without_lookahead", ("ar", "sd", "psd"))):
            auto = AutoSettings(k_candidates=KS) if modes is None else AutoSettings(k_candidates=KS,
                                                                                  allowed_modes=modes)
            run = run_concurrency(costs, acceptance, "auto", 0, row["concurrency"], settings.workload,
                                  settings.auto_warmup_steps, settings.auto_measure_steps, settings.seed, auto=auto,
                                  lookahead=LookaheadOptions())
            row[entry] = auto_entry(run, row["best_fixed"]["tokens_per_s"], row["vllm_sd"]["tokens_per_s"])
        log(f"c={row['concurrency']}: auto {row['auto']['tokens_per_s']:.0f} "
            f"({row['auto']['over_best_fixed']:.3f}x best, {row['auto']['over_vllm_sd']:.3f}x vllm-sd)")
    data["auto_command"] = f"{COMMAND} auto --curves {name} --auto-only"
    return data


def section_auto(name: str, loads: tuple[int, ...] = AUTO_LOADS) -> dict[str, Any]:
    """Auto on one curve file; rows for loads already in its JSON and not rerun are kept (a file's loads can be run
    in parts)."""
    log(f"auto: {AUTO_FILES[name]}, loads {loads}")
    path = OUT / f"lookahead-auto-{name}.json"
    kept = [r for r in json.loads(path.read_text())["rows"] if r["concurrency"] not in loads] if path.exists() else []
    rows = sorted([*kept, *auto_sweep(auto_costs(name), loads=loads)],
                  key=lambda r: r["concurrency"])
    return {"command": f"{COMMAND} auto --curves {name} [--loads ...]", "curves": AUTO_FILES[name],
            "acceptance": ACCEPTANCE, "host_ms_per_step": DEFAULT_GPU_HOST_MS_PER_STEP, "rows": rows}


def report() -> str:
    lines = ["# Lookahead in the twin (H200 curves, Qwen3-32B + Qwen3-1.7B, TP = 1, drafter on its own GPU)", "",
             "Written by `python benchmarks/twin_lookahead.py report` from the sections' JSON (each names its "
             "command). Acceptance 0.8 per position; 2.5 ms host work per step (an estimate, in series with each "
             "of the engine's steps); 1024-token prompts, ~256-token outputs, closed loop. Hit rates come from the "
             "core's own matching of branch tails against simulated token ids: the drafter's rank of the target's "
             "token after a miss of its top choice is the local pair's, measured "
             "(`lookahead-coverage.json`: P(rank 2..8 | rank >= 2) = 0.55, 0.21, 0.07, 0.04, 0.02, 0.03, 0.01).", ""]
    for name, title, note in (
            ("vs-sd", "Lookahead at its best k vs sd at its best k",
             "`default`: the engine's defaults (--lookahead-fanout 6, which its core lowers where its measured "
             "drafter time per branch would not hide behind the verification; a miss verified with a backup "
             "branch); `no backups`: --no-lookahead-backups (a miss verified without drafts, its root drafted)."),
            ("fanout8", "Lookahead with --lookahead-fanout 8 and --no-lookahead-backups",
             "The core chooses up to 8 branches per request where measured times say they pay.")):
        path = OUT / f"lookahead-{name}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        ran = [v for v in VARIANTS if f"lookahead_{v}" in data["rows"][0]]
        lines += [f"## {title}", "", note, "",
                  "| requests | sd (best k) | tok/s | "
                  + " | ".join(f"lookahead, {v.replace('_', ' ')} | tok/s | hits | F used | x sd" for v in ran) + " |",
                  "|---" * (3 + 5 * len(ran)) + "|"]
        for row in data["rows"]:
            cells = [str(row["concurrency"]), row["sd"]["mode"], f"{row['sd']['tokens_per_s']:.0f}"]
            for variant in ran:
                la = row[f"lookahead_{variant}"]
                cells += [la["mode"], f"{la['tokens_per_s']:.0f}", f"{la['branch_hit_rate']:.2f}",
                          f"{la['fanout']:.1f}", f"**{la['over_sd']:.2f}**"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        if "derived_hit_share" in data:
            lines += ["The cost model's derived hit share at 0.8 acceptance (steady state of the engine's branch "
                      "policy, what auto prices lookahead with before it runs): " + ", ".join(
                          f"k={k[1:]}: " + "/".join(f"{v:.2f}" for v in row.values())
                          for k, row in data["derived_hit_share"].items()) + " for F = 1, 2, 3, 4, 6, 8.", ""]
    path = OUT / "lookahead-band.json"
    if path.exists():
        data = json.loads(path.read_text())
        lines += ["## Across coverage (hit rates)", "", *([data["note"], ""] if "note" in data else []),
                  "After a miss of the drafter's top choice the target's token is its second choice with "
                  "probability c (else no candidate's); lookahead at its best k against sd at its best k, "
                  "each cell: hit rate, lookahead / sd (best k).", ""]
        for variant in [v for v in VARIANTS if f"lookahead_{v}" in data["points"][0]["rows"][0]]:
            lines += [f"Lookahead `{variant}`:", "",
                      "| c | " + " | ".join(f"{r['concurrency']} requests" for r in data["points"][0]["rows"]) + " |",
                      "|---|" + "---|" * len(data["points"][0]["rows"])]
            for point in data["points"]:
                cells = [f"{point['rank2_after_miss']:g}"]
                for row in point["rows"]:
                    la = row[f"lookahead_{variant}"]
                    cells.append(f"{la['branch_hit_rate']:.2f}, {la['over_sd']:.2f}x ({la['mode']})")
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
    summary: list[str] = []
    for slug, title in AUTO_FILES.items():
        path = OUT / f"lookahead-auto-{slug}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        rows = data["rows"]
        lines += [f"## Auto vs the best fixed mode and vLLM's colocated SD: {title}", "",
                  f"`{data['command']}`"
                  + (f" (auto's entries from `{data['auto_command']}`)" if "auto_command" in data else "")
                  + ". Best fixed: the best of ar, sd, psd and lookahead at any k (the engine's "
                  "synchronous modes, its drafter on a GPU of its own); vllm-sd: vLLM's SD with the drafter on the "
                  "target's GPU (per replica, best k). Auto: AutoSettings' defaults (ar, sd, psd, lookahead); "
                  "auto (ar, sd, psd): without lookahead. Every fixed setting runs 40 + 200 steps (at least 8,000 "
                  "tokens); those within 3% of their family's best run again over auto's own window (300 + 1,200 "
                  "steps, same seed), so that the best of some twenty short windows, biased upward, is not what auto "
                  "is held to.", "",
                  "| requests | best fixed | tok/s | ar | sd | psd | lookahead | vllm-sd | auto runs | tok/s | "
                  "auto / best | auto / vllm-sd | auto (ar, sd, psd) runs | its / best |", "|---" * 14 + "|"]
        for row in rows:
            fam, auto, other = row["by_family"], row["auto"], row["auto_without_lookahead"]
            lines.append(
                f"| {row['concurrency']} | {row['best_fixed']['mode']} | {row['best_fixed']['tokens_per_s']:.0f} | "
                + " | ".join(f"{fam[f]['tokens_per_s']:.0f} ({fam[f]['mode']})" for f in ("ar", "sd", "psd",
                                                                                           "lookahead"))
                + f" | {row['vllm_sd']['tokens_per_s']:.0f} ({row['vllm_sd']['mode']}) | {auto['runs']} | "
                f"{auto['tokens_per_s']:.0f} | **{auto['over_best_fixed']:.3f}** | **{auto['over_vllm_sd']:.3f}** | "
                f"{other['runs']} | {other['over_best_fixed']:.3f} |")
        lines.append("")
        ratios = [r["auto"]["over_best_fixed"] for r in rows]
        vllm = [r["auto"]["over_vllm_sd"] for r in rows]
        loads = ", ".join(str(r["concurrency"]) for r in rows)
        summary.append(f"| {title} | {loads} | {min(ratios):.3f} | {max(ratios):.3f} | {min(vllm):.3f} | "
                       f"{max(vllm):.3f} |")
    if summary:
        lines += ["## Auto at a glance", "",
                  "| curves | requests run | auto / best fixed, min | max | auto / vllm-sd, min | max |",
                  "|---|---|---|---|---|---|",
                  *summary, ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sections = {"vs-sd": section_vs_sd, "band": section_band, "fanout8": section_fanout8}
    parser.add_argument("section", choices=(*sections, "auto", "report", "all"))
    parser.add_argument("--curves", choices=tuple(AUTO_FILES), action="append",
                        help="auto: the curve files to run (default: every one)")
    parser.add_argument("--loads", help="auto: comma-separated requests (default 1-256); other loads' rows are kept")
    parser.add_argument("--auto-only", action="store_true",
                        help="auto: run auto again against the fixed modes already in each file's JSON")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    jobs: dict[str, Any] = {}
    if args.section in (*sections, "all"):
        jobs.update({name: fn for name, fn in sections.items() if args.section in (name, "all")})
    if args.section in ("auto", "all"):
        loads = tuple(int(x) for x in args.loads.split(",")) if args.loads else AUTO_LOADS
        for slug in args.curves or AUTO_FILES:
            section = section_auto_again if args.auto_only else section_auto
            jobs[f"auto-{slug}"] = lambda slug=slug, section=section: section(slug, loads)
    for name, fn in jobs.items():
        started = time.time()
        data = fn()
        data["seconds"] = round(time.time() - started)
        (OUT / f"lookahead-{name}.json").write_text(json.dumps(data, indent=1) + "\n")
        log(f"{name}: done in {data['seconds']} s")
    (OUT / "lookahead.md").write_text(report())


if __name__ == "__main__":
    main()
