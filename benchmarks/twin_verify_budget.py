"""Adaptive draft lengths (--draft-length adaptive) vs fixed k in the twin (the engine's own core, planner and
drafter link on simulated time) on the H200 curves for Qwen3-32B + Qwen3-1.7B (TP = 1, the drafter on its own GPU,
2.5 ms host work per step), for sd and psd, at 1-256 requests.

Each side at its best k: fixed runs k = 1..5 and reports the best; adaptive runs with k = 1..5 as each request's
longest draft and reports the best. Two acceptance cases:
    heterogeneous: each request its own per-position acceptance rate, uniform in 0.5-0.95, seeded by the request's id
                   (the same requests draw the same rates in every run: code and chat prompts differ this widely);
    homogeneous:   every request 0.8 per position (the rate the twin uses for this pair).
Noise: the best fixed k rerun with another seed (other requests, lengths and draws), its ratio to seed 0's reported
beside; adaptive's ratio is within noise where it lies inside that spread around 1.

    python benchmarks/twin_verify_budget.py           # writes benchmarks/results/gpu-twin/verify-budget.{json,md}
    python benchmarks/twin_verify_budget.py --loads 16,64 --modes sd
    python benchmarks/twin_verify_budget.py --report  # only rewrite the .md from the .json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minedraft.twin.costs import DEFAULT_GPU_HOST_MS_PER_STEP, AcceptanceModel, Hardware, StepCosts  # noqa: E402
from minedraft.twin.curves import load_curves  # noqa: E402
from minedraft.twin.run import RunResult, run_concurrency  # noqa: E402

CURVES = ROOT / "benchmarks" / "curves" / "h200-qwen3-32b.json"
OUT = ROOT / "benchmarks" / "results" / "gpu-twin"
KS = (1, 2, 3, 4, 5)
LOADS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MODES = ("sd", "psd")
CASES: dict[str, tuple[float, tuple[float, ...]]] = {
    # name: (the acceptance model's rate, the per-request spread; () = every request at the model's rate)
    "heterogeneous": (0.8, (0.5, 0.95)),
    "homogeneous": (0.8, ()),
}
COMMAND = "python benchmarks/twin_verify_budget.py"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def best(runs: list[RunResult]) -> RunResult:
    return max(runs, key=lambda r: r.tokens_per_s)


def measure(costs: StepCosts, case: str, mode: str, load: int) -> dict[str, Any]:
    rate, spread = CASES[case]
    acceptance = AcceptanceModel.constant(rate)
    by_k: dict[str, dict[str, float]] = {}
    runs: dict[str, list[RunResult]] = {"fixed": [], "adaptive": []}
    for draft_length in runs:
        for k in KS:
            run = run_concurrency(costs, acceptance, mode, k, load, draft_length=draft_length,
                                  acceptance_spread=spread)
            runs[draft_length].append(run)
            by_k.setdefault(f"k{k}", {})[draft_length] = round(run.tokens_per_s, 1)
    fixed, adaptive = best(runs["fixed"]), best(runs["adaptive"])
    noise = run_concurrency(costs, acceptance, mode, fixed.k, load, seed=1, acceptance_spread=spread)
    row = {
        "requests": load,
        "fixed": {"k": fixed.k, "tokens_per_s": round(fixed.tokens_per_s, 1)},
        "adaptive": {"k": adaptive.k, "tokens_per_s": round(adaptive.tokens_per_s, 1)},
        "adaptive_over_fixed": round(adaptive.tokens_per_s / fixed.tokens_per_s, 3),
        "fixed_seed1_over_seed0": round(noise.tokens_per_s / fixed.tokens_per_s, 3),
        "by_k": by_k,
    }
    log(f"{case} {mode} {load}: fixed k{fixed.k} {fixed.tokens_per_s:.0f}, adaptive k{adaptive.k} "
        f"{adaptive.tokens_per_s:.0f} tok/s: {row['adaptive_over_fixed']:.3f}x (noise {row['fixed_seed1_over_seed0']})")
    return row


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Adaptive draft lengths vs fixed k in the twin (H200 curves)",
        "",
        f"Command: `{result['command']}`. Curves: `{result['curves']}` (Qwen3-32B + Qwen3-1.7B, TP = 1, drafter on its "
        f"own GPU), {result['host_ms_per_step']} ms host work per step. Output tokens per second of one replica at a "
        "fixed number of requests; each side at its best k of 1-5 (adaptive: k is each request's longest draft).",
        "`noise`: the best fixed k rerun with another seed (other requests, lengths and draws), over seed 0. "
        "`at k3`: adaptive over fixed both at k = 3, the engine's default (what a fixed k costs where it is not "
        "the best one).",
        "",
        "Not modelled: the twin prices a step by its tokens per request whatever their spread; on a GPU, steps whose",
        "requests verify different numbers of tokens run vLLM's piecewise CUDA graphs instead of full ones (as",
        "auto's steps already do), which costs more at small batches than this shows.",
        "psd at 32 requests (16 per sub-batch): the curves' verify time at 16 requests falls from 4 to 6 tokens",
        "per request (24.6 to 24.0 ms), so fixed k's padding buys a cheaper step there; adaptive steps are not padded.",
    ]
    for case, (rate, spread) in CASES.items():
        what = (f"per-request acceptance uniform in {spread[0]}-{spread[1]}" if spread
                else f"every request {rate} per position")
        lines += ["", f"## {case}: {what}", "",
                  "| requests | " + " | ".join(f"{m} fixed (k) | {m} adaptive (k) | {m} ratio | {m} noise | "
                                               f"{m} at k3" for m in MODES) + " |",
                  "|---:|" + "---:|" * (5 * len(MODES))]
        rows = {m: {r["requests"]: r for r in result["cases"][case][m]} for m in MODES}
        for load in result["loads"]:
            cells = []
            for m in MODES:
                r = rows[m].get(load)
                if r is None:
                    cells += ["", "", "", "", ""]
                    continue
                at_k3 = r["by_k"]["k3"]
                cells += [f"{r['fixed']['tokens_per_s']:.0f} (k{r['fixed']['k']})",
                          f"{r['adaptive']['tokens_per_s']:.0f} (k{r['adaptive']['k']})",
                          f"**{r['adaptive_over_fixed']:.3f}**", f"{r['fixed_seed1_over_seed0']:.3f}",
                          f"{at_k3['adaptive'] / at_k3['fixed']:.3f}"]
            lines.append(f"| {load} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loads", default=",".join(map(str, LOADS)))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--report", action="store_true", help="only rewrite verify-budget.md from the JSON")
    args = parser.parse_args()
    out = Path(args.out)
    if args.report:
        (out / "verify-budget.md").write_text(markdown(json.loads((out / "verify-budget.json").read_text())))
        return
    loads = [int(x) for x in args.loads.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    curves = load_curves(CURVES)
    costs = StepCosts.from_curves(curves, "qwen3-32b", "qwen3-1.7b",
                                  Hardware(step_overhead_ms=DEFAULT_GPU_HOST_MS_PER_STEP))
    command = COMMAND if (loads == list(LOADS) and modes == list(MODES)) else \
        f"{COMMAND} --loads {args.loads} --modes {args.modes}"
    result: dict[str, Any] = {
        "command": command, "curves": str(CURVES.relative_to(ROOT)), "host_ms_per_step": DEFAULT_GPU_HOST_MS_PER_STEP,
        "ks": list(KS), "loads": loads, "cases": {case: {m: [] for m in MODES} for case in CASES},
    }
    for case in CASES:
        for mode in modes:
            for load in loads:
                result["cases"][case][mode].append(measure(costs, case, mode, load))
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify-budget.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "verify-budget.md").write_text(markdown(result))
    log(f"wrote {out / 'verify-budget.json'} and {out / 'verify-budget.md'}")


if __name__ == "__main__":
    main()
