"""The GPU regime through the twin (the engine's own planner, drafter link, wait policy and auto controller on
simulated time), from the H200 cost curves measured for Qwen3-32B + Qwen3-1.7B, and from curve files of other shapes.

Writes benchmarks/results/gpu-twin/{h200.json,h200.md,h200.png}. Usage (from the repository root):
    python benchmarks/twin_gpu.py            # about 10 minutes on a contended 2-core machine

Sections: every mode at 1-256 requests (the regime map); psd/sd against the arithmetic of the curves; auto against
the best fixed mode per load, over load-varying traces (diurnal, bursts), and on an eager-drafter file and an
A100-like roofline; the same sweep at TP = 4 with the drafter on its own GPU (the paper's layout).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minedraft.engine.control.auto import AutoSettings  # noqa: E402
from minedraft.twin.costs import AcceptanceModel, Hardware, StepCosts  # noqa: E402
from minedraft.twin.curves import load_curves, parse_curves  # noqa: E402
from minedraft.twin.plot import regime_map  # noqa: E402
from minedraft.twin.run import Phase, Workload, run_concurrency, run_phases  # noqa: E402
from minedraft.twin.sweep import SweepSettings, sweep  # noqa: E402
from minedraft.twin.synthetic import A100_LIKE, roofline_curves, slow_drafter  # noqa: E402

CURVES = ROOT / "benchmarks" / "curves" / "h200-qwen3-32b.json"
OUT = ROOT / "benchmarks" / "results" / "gpu-twin"
CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ACCEPTANCE = 0.8
COMMAND = "python benchmarks/twin_gpu.py"
PLAN_COMMAND = ("minedraft plan --curves benchmarks/curves/h200-qwen3-32b.json --target qwen3-32b "
                "--drafter qwen3-1.7b --concurrency 1,2,4,8,16,32,64,128,256 --json "
                "--plot benchmarks/results/gpu-twin/h200.png")
TRACES = {
    # A day in 12 phases (requests in flight on one replica), then bursts on a quiet baseline.
    "diurnal": (2, 4, 8, 16, 64, 128, 256, 128, 64, 16, 8, 4),
    "bursts": (4, 192, 4, 192, 8, 256, 8),
}
PHASE_SECONDS = 10.0


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def arithmetic(costs: StepCosts) -> list[dict[str, Any]]:
    rows = []
    acceptance = AcceptanceModel.constant(ACCEPTANCE)
    workload = Workload(prompt_tokens=1000, output_tokens=48)
    context = workload.prompt_tokens + workload.output_tokens / 2
    for k in (3, 5):
        for c in (4, 8, 16, 32, 64, 128):
            expected = ((costs.draft_ms(c, context, k) + costs.verify_ms(c, context, k + 1))
                        / (2 * max(costs.draft_ms(c / 2, context, k), costs.verify_ms(c / 2, context, k + 1))))
            sd = run_concurrency(costs, acceptance, "sd", k, c, workload)
            psd = run_concurrency(costs, acceptance, "psd", k, c, workload)
            rows.append({"k": k, "concurrency": c, "curves_psd_over_sd": round(expected, 3),
                         "twin_psd_over_sd": round(psd.tokens_per_s / sd.tokens_per_s, 3)})
    return rows


def traces(costs: StepCosts, ks: tuple[int, ...]) -> dict[str, Any]:
    acceptance = AcceptanceModel.constant(ACCEPTANCE)
    out: dict[str, Any] = {}
    for name, concurrencies in TRACES.items():
        phases = [Phase(c, PHASE_SECONDS) for c in concurrencies]
        fixed = {}
        for mode, k in [("ar", 0)] + [(m, k) for m in ("sd", "psd") for k in ks]:
            label = mode if mode == "ar" else f"{mode}-k{k}"
            fixed[label] = run_phases(costs, acceptance, mode, k, phases).tokens_per_s
        auto = run_phases(costs, acceptance, "auto", 0, phases, auto=AutoSettings(k_candidates=ks))
        best = max(fixed, key=lambda label: fixed[label])
        out[name] = {"phases": list(concurrencies), "phase_seconds": PHASE_SECONDS,
                     "fixed_tokens_per_s": {k: round(v, 1) for k, v in fixed.items()}, "best_fixed": best,
                     "auto_tokens_per_s": round(auto.tokens_per_s, 1),
                     "auto_over_best_fixed": round(auto.tokens_per_s / fixed[best], 3),
                     "auto_steps_by_setting": auto.steps_by_setting}
        log(f"trace {name}: auto {auto.tokens_per_s:.0f} vs {best} {fixed[best]:.0f} tok/s")
    return out


def auto_rows(loads: list[Any]) -> list[dict[str, Any]]:
    rows = []
    for load in loads:
        best = load.best(("ar", "sd", "psd"))
        mode, k = load.auto.main_setting
        rows.append({"concurrency": load.concurrency, "best_fixed": best.mode,
                     "best_fixed_tokens_per_s": round(best.tokens_per_s, 1),
                     "auto_tokens_per_s": round(load.auto.tokens_per_s, 1), "auto_runs": f"{mode}" + (
                         f"-k{k}" if mode != "ar" else ""),
                     "auto_over_best_fixed": round(load.auto.tokens_per_s / best.tokens_per_s, 3)})
    return rows


def shapes() -> dict[str, Any]:
    h200 = json.loads(CURVES.read_text())
    out: dict[str, Any] = {}
    files = {"eager drafter (H200 curves, drafter x6)": slow_drafter(h200, 6.0),
             "A100-like roofline": roofline_curves(A100_LIKE)}
    for name, data in files.items():
        costs = StepCosts.from_curves(parse_curves(data, name), "qwen3-32b", "qwen3-1.7b", Hardware())
        loads = sweep(costs, AcceptanceModel.constant(ACCEPTANCE),
                      SweepSettings(concurrencies=(4, 16, 64, 128), ks=(1, 3, 5), families=("ar", "sd", "psd")),
                      progress=log)
        out[name] = auto_rows(loads)
    return out


def table(rows: list[dict[str, Any]], columns: list[str]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return lines


def main() -> int:
    curves = load_curves(CURVES)
    costs = StepCosts.from_curves(curves, "qwen3-32b", "qwen3-1.7b", Hardware())
    acceptance = AcceptanceModel.constant(ACCEPTANCE)
    ks = (1, 2, 3, 4, 5)
    log("sweep: H200, TP=1, drafter on its own GPU")
    loads = sweep(costs, acceptance, SweepSettings(concurrencies=CONCURRENCIES, ks=ks), progress=log)
    OUT.mkdir(parents=True, exist_ok=True)
    regime_map(loads, OUT / "h200.png", title="Qwen3-32B + Qwen3-1.7B on one H200 (measured curves), acceptance 0.8 "
               "per position; twin of the engine")
    log("psd/sd against the curves' arithmetic")
    checks = arithmetic(costs)
    log("traces")
    trace_results = traces(costs, ks)
    log("other curve shapes")
    shape_results = shapes()
    log("TP=4 (paper layout: drafter on its own GPU)")
    tp4 = StepCosts.from_curves(curves, "qwen3-32b", "qwen3-1.7b", Hardware(tensor_parallel_size=4))
    tp4_loads = sweep(tp4, acceptance, SweepSettings(concurrencies=(4, 16, 64, 128), ks=(1, 3, 5),
                                                     families=("ar", "sd", "psd", "vllm-sd")), progress=log)
    report = {
        "command": COMMAND, "plan_command": PLAN_COMMAND,
        "curves": {"file": "benchmarks/curves/h200-qwen3-32b.json", "device": curves.device,
                   "execution": curves.execution, "measured": "measured on an H200, 2026-12-04"},
        "assumptions": {"acceptance_per_position": ACCEPTANCE, "prompt_tokens": Workload().prompt_tokens,
                        "output_tokens_mean": Workload().output_tokens, "prefill": "not modelled",
                        "step_overhead_ms": 0.0, "tensor_parallel_size": 1, "drafter": "own GPU"},
        "loads": [load.to_json() for load in loads],
        "auto_vs_best_fixed": auto_rows(loads),
        "psd_over_sd_vs_arithmetic": checks,
        "traces": trace_results,
        "other_shapes": shape_results,
        "tp4_loads": [load.to_json() for load in tp4_loads],
        "tp4_auto_vs_best_fixed": auto_rows(tp4_loads),
    }
    (OUT / "h200.json").write_text(json.dumps(report, indent=1) + "\n")
    md = ["# The GPU regime through the twin (H200 curves, Qwen3-32B + Qwen3-1.7B)", "",
          f"Command: `{COMMAND}` (the regime map alone: `{PLAN_COMMAND}`). Curves measured on an H200, 2026-12-04 "
          "(CUDA graphs, bf16); everything else is the twin: the engine's own planner, drafter link, wait policy "
          "and auto controller on simulated time. Acceptance 0.8 per position (conditional), prompts 1024 tokens, "
          "outputs 128-384; prefill and the engine's own per-step work not modelled; TP = 1, drafter on its own GPU "
          "(psd, sd, auto hold 2 GPUs; ar and vLLM's colocated sd 1).", "",
          "## Best per load, and auto", ""]
    md += table(report["auto_vs_best_fixed"], ["concurrency", "best_fixed", "best_fixed_tokens_per_s", "auto_runs",
                                               "auto_tokens_per_s", "auto_over_best_fixed"])
    md += ["", "## Tokens/s per GPU (best k per family)", "",
           "| concurrency | ar | sd | psd | vllm-sd (colocated) |", "|---|---|---|---|---|"]
    for load in loads:
        best = {}
        for family in ("ar", "sd", "psd", "vllm-sd"):
            options = [(r.tokens_per_s_per_gpu, label) for label, r in load.runs.items()
                       if (label == "ar" if family == "ar" else label.startswith(family + "-k"))]
            value, label = max(options)
            best[family] = f"{value:.0f} ({label})"
        md.append(f"| {load.concurrency} | {best['ar']} | {best['sd']} | {best['psd']} | {best['vllm-sd']} |")
    md += ["", "## psd/sd: twin against the curves' arithmetic (same k, same concurrency)", ""]
    md += table(checks, ["k", "concurrency", "curves_psd_over_sd", "twin_psd_over_sd"])
    md += ["", f"## Load-varying traces (phases of {PHASE_SECONDS:g} s, requests in flight per phase)", "",
           "| trace | phases | best fixed | its tok/s | auto tok/s | auto / best fixed |", "|---|---|---|---|---|---|"]
    for name, t in trace_results.items():
        md.append(f"| {name} | {','.join(map(str, t['phases']))} | {t['best_fixed']} | "
                  f"{t['fixed_tokens_per_s'][t['best_fixed']]} | {t['auto_tokens_per_s']} | "
                  f"{t['auto_over_best_fixed']} |")
    for name, rows in shape_results.items():
        md += ["", f"## Other curve shape: {name} (k 1, 3, 5)", ""]
        md += table(rows, ["concurrency", "best_fixed", "best_fixed_tokens_per_s", "auto_runs", "auto_tokens_per_s",
                           "auto_over_best_fixed"])
    md += ["", "## TP = 4, drafter on a fifth GPU (stated model: forward / 4 + 25 us per layer)", ""]
    md += table(report["tp4_auto_vs_best_fixed"], ["concurrency", "best_fixed", "best_fixed_tokens_per_s", "auto_runs",
                                                   "auto_tokens_per_s", "auto_over_best_fixed"])
    (OUT / "h200.md").write_text("\n".join(md) + "\n")
    log(f"wrote {OUT}/h200.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
