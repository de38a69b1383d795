"""The GPU regime through the twin (the engine's own planner, drafter link, wait policy and auto controller on
simulated time), from the H200 cost curves measured for Qwen3-32B + Qwen3-1.7B, and from curve files of other shapes.

Writes benchmarks/results/gpu-twin/{h200.json,h200.md,h200.png}. Usage (from the repository root):
    python benchmarks/twin_gpu.py            # about 10 minutes on a contended 2-core machine

Sections: every mode at 1-256 requests (the regime map); psd/sd against the arithmetic of the curves; auto against
the best fixed mode per load, over load-varying traces (diurnal, bursts), and on an eager-drafter file and an
A100-like roofline; the same sweep at TP = 4 with the drafter on its own GPU (the paper's layout).

Host work per step (not in the curves) is HOST_MS everywhere but in the arithmetic check: the engine's synchronous
steps (ar, sd, psd, auto) pay it in series, plain vLLM (vllm-ar), vLLM's colocated SD and psd with async steps
overlap it with the forward pass. Auto is judged against two baselines, both reported: the best of the engine's
synchronous fixed modes (ar, sd, psd at any k: what auto chooses among), and the best of any fixed mode, psd with
async steps and plain vLLM included.
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

from minedraft.engine.control.auto import AutoSettings  # noqa: E402
from minedraft.twin.costs import (  # noqa: E402
    DEFAULT_GPU_HOST_MS_PER_STEP,
    FIXED_FAMILIES,
    AcceptanceModel,
    Hardware,
    StepCosts,
)
from minedraft.twin.curves import load_curves, parse_curves  # noqa: E402
from minedraft.twin.plot import regime_map  # noqa: E402
from minedraft.twin.run import Phase, Workload, run_concurrency, run_phases  # noqa: E402
from minedraft.twin.sweep import BASELINE_FAMILIES, SYNC_FAMILIES, SweepSettings, sweep  # noqa: E402
from minedraft.twin.synthetic import A100_LIKE, roofline_curves, slow_drafter  # noqa: E402

CURVES = ROOT / "benchmarks" / "curves" / "h200-qwen3-32b.json"
OUT = ROOT / "benchmarks" / "results" / "gpu-twin"
CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ACCEPTANCE = 0.8
COMMAND = "python benchmarks/twin_gpu.py"
PLAN_COMMAND = ("minedraft plan --curves benchmarks/curves/h200-qwen3-32b.json --target qwen3-32b "
                "--drafter qwen3-1.7b --concurrency 1,2,4,8,16,32,64,128,256 "
                "--modes ar,vllm-ar,sd,psd,psd-async,vllm-sd --json "
                "--plot benchmarks/results/gpu-twin/h200.png")
TRACES = {
    # A day in 12 phases (requests in flight on one replica), then bursts on a quiet baseline.
    "diurnal": (2, 4, 8, 16, 64, 128, 256, 128, 64, 16, 8, 4),
    "bursts": (4, 192, 4, 192, 8, 256, 8),
}
PHASE_SECONDS = 10.0
# Host work per step (ms): the default of `minedraft plan`, an estimate from the engine's code, not measured; the
# sensitivity section reruns the deciding modes at the ends of the estimated range.
HOST_MS = DEFAULT_GPU_HOST_MS_PER_STEP
HOST_RANGE_MS = (1.7, 3.3)


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
        for mode, k in [("ar", 0), ("vllm-ar", 0)] + [(m, k) for m in ("sd", "psd") for k in ks]:
            label = mode if mode in ("ar", "vllm-ar") else f"{mode}-k{k}"
            fixed[label] = run_phases(costs, acceptance, mode, k, phases).tokens_per_s
        auto = run_phases(costs, acceptance, "auto", 0, phases, auto=AutoSettings(k_candidates=ks))
        engine = {label: v for label, v in fixed.items() if label != "vllm-ar"}
        best = max(engine, key=lambda label: engine[label])
        overall = max(fixed, key=lambda label: fixed[label])
        out[name] = {"phases": list(concurrencies), "phase_seconds": PHASE_SECONDS,
                     "fixed_tokens_per_s": {k: round(v, 1) for k, v in fixed.items()}, "best_fixed": best,
                     "best_any": overall,
                     "auto_tokens_per_s": round(auto.tokens_per_s, 1),
                     "auto_over_best_fixed": round(auto.tokens_per_s / fixed[best], 3),
                     "auto_over_best_any": round(auto.tokens_per_s / fixed[overall], 3),
                     "auto_steps_by_setting": auto.steps_by_setting}
        log(f"trace {name}: auto {auto.tokens_per_s:.0f} vs {best} {fixed[best]:.0f}, {overall} {fixed[overall]:.0f} "
            "tok/s")
    return out


def auto_rows(loads: list[Any]) -> list[dict[str, Any]]:
    """Auto against the best of the engine's synchronous fixed modes, and against the best of any fixed mode (psd
    with async steps and plain vLLM included, where the sweep ran them)."""
    rows = []
    for load in loads:
        best = load.best(SYNC_FAMILIES)
        overall = load.best(BASELINE_FAMILIES)
        mode, k = load.auto.main_setting
        rows.append({"concurrency": load.concurrency, "best_fixed": best.mode,
                     "best_fixed_tokens_per_s": round(best.tokens_per_s, 1),
                     "best_any": overall.mode, "best_any_tokens_per_s": round(overall.tokens_per_s, 1),
                     "auto_tokens_per_s": round(load.auto.tokens_per_s, 1), "auto_runs": f"{mode}" + (
                         f"-k{k}" if mode != "ar" else ""),
                     "auto_over_best_fixed": round(load.auto.tokens_per_s / best.tokens_per_s, 3),
                     "auto_over_best_any": round(load.auto.tokens_per_s / overall.tokens_per_s, 3)})
        if load.auto_async is not None:
            mode, k = load.auto_async.main_setting
            rows[-1].update({"auto_async_runs": f"{mode}" + (f"-k{k}" if mode != "ar" else ""),
                             "auto_async_tokens_per_s": round(load.auto_async.tokens_per_s, 1),
                             "auto_async_over_best_any": round(load.auto_async.tokens_per_s / overall.tokens_per_s, 3)})
    return rows


AUTO_COLUMNS = ["concurrency", "best_fixed", "best_fixed_tokens_per_s", "best_any", "best_any_tokens_per_s",
                "auto_runs", "auto_tokens_per_s", "auto_over_best_fixed", "auto_over_best_any"]
# The H200 map also runs auto with the engine's async PSD steps on (psd's steps scheduled ahead once auto runs psd).
AUTO_ASYNC_COLUMNS = [*AUTO_COLUMNS, "auto_async_runs", "auto_async_tokens_per_s", "auto_async_over_best_any"]


def host_sensitivity(curves: Any, loads: list[Any], acceptance: AcceptanceModel) -> list[dict[str, Any]]:
    """At the ends of the estimated host-work range: the engine's best synchronous setting at HOST_MS against plain
    vLLM (whose host work hides behind the forward, so only the engine's figure moves)."""
    rows = []
    for host_ms in HOST_RANGE_MS:
        costs = StepCosts.from_curves(curves, "qwen3-32b", "qwen3-1.7b", Hardware(step_overhead_ms=host_ms))
        for load in loads:
            best = load.best(SYNC_FAMILIES)
            mode, k = (best.mode, 0) if best.mode == "ar" else (best.mode.rsplit("-k", 1)[0], best.k)
            engine = run_concurrency(costs, acceptance, mode, k, load.concurrency)
            plain = run_concurrency(costs, acceptance, "vllm-ar", 0, load.concurrency)
            rows.append({"host_ms": host_ms, "concurrency": load.concurrency, "engine_setting": best.mode,
                         "engine_tokens_per_s": round(engine.tokens_per_s, 1),
                         "plain_vllm_tokens_per_s": round(plain.tokens_per_s, 1),
                         "plain_vllm_over_engine": round(plain.tokens_per_s / engine.tokens_per_s, 3)})
    return rows


def shapes() -> dict[str, Any]:
    h200 = json.loads(CURVES.read_text())
    out: dict[str, Any] = {}
    files = {"eager drafter (H200 curves, drafter x6)": slow_drafter(h200, 6.0),
             "A100-like roofline": roofline_curves(A100_LIKE)}
    for name, data in files.items():
        costs = StepCosts.from_curves(parse_curves(data, name), "qwen3-32b", "qwen3-1.7b",
                                      Hardware(step_overhead_ms=HOST_MS))
        loads = sweep(costs, AcceptanceModel.constant(ACCEPTANCE),
                      SweepSettings(concurrencies=(4, 16, 64, 128), ks=(1, 3, 5),
                                    families=("ar", "vllm-ar", "sd", "psd")),
                      progress=log)
        out[name] = auto_rows(loads)
    return out


def table(rows: list[dict[str, Any]], columns: list[str]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return lines


def main(argv: list[str] | None = None) -> int:
    # A parser, so that --help (or a stray argument) explains instead of running and overwriting the results.
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    curves = load_curves(CURVES)
    costs = StepCosts.from_curves(curves, "qwen3-32b", "qwen3-1.7b", Hardware(step_overhead_ms=HOST_MS))
    acceptance = AcceptanceModel.constant(ACCEPTANCE)
    ks = (1, 2, 3, 4, 5)
    log(f"sweep: H200, TP=1, drafter on its own GPU, host work {HOST_MS} ms per step")
    loads = sweep(costs, acceptance, SweepSettings(concurrencies=CONCURRENCIES, ks=ks, families=FIXED_FAMILIES,
                                                   with_auto_async=True), progress=log)
    OUT.mkdir(parents=True, exist_ok=True)
    regime_map(loads, OUT / "h200.png", title="Qwen3-32B + Qwen3-1.7B on one H200 (measured curves), acceptance 0.8 "
               "per position; twin of the engine")
    log("psd/sd against the curves' arithmetic (no host work: the curves' own arithmetic)")
    checks = arithmetic(StepCosts.from_curves(curves, "qwen3-32b", "qwen3-1.7b", Hardware()))
    log(f"host work at {HOST_RANGE_MS} ms: the engine's best setting against plain vLLM")
    sensitivity = host_sensitivity(curves, loads, acceptance)
    log("traces")
    trace_results = traces(costs, ks)
    log("other curve shapes")
    shape_results = shapes()
    log("TP=4 (paper layout: drafter on its own GPU)")
    tp4 = StepCosts.from_curves(curves, "qwen3-32b", "qwen3-1.7b",
                                Hardware(tensor_parallel_size=4, step_overhead_ms=HOST_MS))
    tp4_loads = sweep(tp4, acceptance, SweepSettings(concurrencies=(4, 16, 64, 128), ks=(1, 3, 5),
                                                     families=("ar", "vllm-ar", "sd", "psd", "vllm-sd")), progress=log)
    report: dict[str, Any] = {
        "command": COMMAND, "plan_command": PLAN_COMMAND,
        "curves": {"file": "benchmarks/curves/h200-qwen3-32b.json", "device": curves.device,
                   "execution": curves.execution, "measured": "measured on an H200, 2026-12-04"},
        "assumptions": {"acceptance_per_position": ACCEPTANCE, "prompt_tokens": Workload().prompt_tokens,
                        "output_tokens_mean": Workload().output_tokens, "prefill": "not modelled",
                        "step_overhead_ms": HOST_MS, "tensor_parallel_size": 1, "drafter": "own GPU",
                        "host_work": "the engine's ar, sd, psd and auto pay it after each forward (sd before its "
                                     "next draft job); vllm-ar, vllm-sd and psd-async overlap it with the forward",
                        "baselines": {"auto_over_best_fixed": "best of the engine's synchronous ar, sd, psd at any k "
                                                              "(what auto chooses among)",
                                      "auto_over_best_any": "best of those, psd-async and plain vLLM (vllm-ar); "
                                                            "traces: ar, sd, psd and plain vLLM"}},
        "loads": [load.to_json() for load in loads],
        "auto_vs_best_fixed": auto_rows(loads),
        "psd_over_sd_vs_arithmetic": checks,
        "host_sensitivity": sensitivity,
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
          "outputs 128-384; prefill not modelled; TP = 1, drafter on its own GPU (psd, sd, auto hold 2 GPUs; ar, "
          "plain vLLM and vLLM's colocated sd 1).", "",
          f"**Host work per step: {HOST_MS} ms** (scheduling, planning, input preparation, output processing; not in "
          "the curves; an estimate of 1.7-3.3 ms at TP = 1 read from the engine's code, not measured on a GPU). The "
          "engine's synchronous steps (ar, sd, psd, auto) pay it after each forward pass, sd before its next draft "
          "job; plain vLLM (`vllm-ar`: the target alone in vLLM itself, async scheduling), vLLM's colocated SD and "
          "the engine's psd with `--async-psd-steps` (`psd-async`) overlap it with the forward pass. Only the "
          "psd/sd arithmetic check leaves it out (it checks the curves' own arithmetic).", "",
          "**Baselines.** `best_fixed` / `auto_over_best_fixed`: the best of the engine's synchronous fixed modes "
          "(ar, sd, psd at any k), what auto chooses among, like for like. `best_any` / `auto_over_best_any`: the "
          "best of any fixed mode, psd with async steps and plain vLLM (the faster plain decoding on a GPU) "
          "included. Where plain vLLM is the best, the engine should not run at all: run vLLM. vLLM's colocated SD "
          "is left out of both (it needs no drafter GPU; compare it per GPU below). `auto` runs synchronous steps "
          "(the engine's default); `auto-async` is auto with `--async-psd-steps`: once it runs psd, psd's steps are "
          "scheduled ahead as in psd-async (its cost model reads those steps apart and prices psd by them), and a "
          "switch waits for the step in flight.", "",
          "## Best per load, and auto", ""]
    md += table(report["auto_vs_best_fixed"], AUTO_ASYNC_COLUMNS)
    md += ["", "## Tokens/s per replica and per GPU (best k per family)", "",
           "| concurrency | ar | plain vLLM | sd | psd | psd-async | vllm-sd (colocated) | per GPU: ar | plain vLLM | "
           "sd | psd | psd-async | vllm-sd |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    families = ("ar", "vllm-ar", "sd", "psd", "psd-async", "vllm-sd")
    for load in loads:
        cells = []
        for per_gpu in (False, True):
            for family in families:
                options = [(r.tokens_per_s_per_gpu if per_gpu else r.tokens_per_s, label)
                           for label, r in load.runs.items()
                           if (label == family if family in ("ar", "vllm-ar") else
                               label.startswith(family + "-k") and not label.startswith("psd-async-k")
                               if family == "psd" else label.startswith(family + "-k"))]
                value, label = max(options)
                cells.append(f"{value:.0f}" + ("" if family in ("ar", "vllm-ar") else f" ({label.rsplit('-', 1)[1]})"))
        md.append(f"| {load.concurrency} | " + " | ".join(cells) + " |")
    md += ["", "## Host work per step at the ends of the estimated range", "",
           "The engine's best synchronous setting at each load (from the sweep above) rerun with 1.7 and 3.3 ms of "
           "host work per step, against plain vLLM (whose host work hides behind the forward at either value):", ""]
    md += table(sensitivity, ["host_ms", "concurrency", "engine_setting", "engine_tokens_per_s",
                              "plain_vllm_tokens_per_s", "plain_vllm_over_engine"])
    md += ["", "## psd/sd: twin against the curves' arithmetic (same k, same concurrency; no host work)", ""]
    md += table(checks, ["k", "concurrency", "curves_psd_over_sd", "twin_psd_over_sd"])
    md += ["", f"## Load-varying traces (phases of {PHASE_SECONDS:g} s, requests in flight per phase)", "",
           "| trace | phases | best engine mode | its tok/s | plain vLLM tok/s | auto tok/s | "
           "auto / best engine mode | auto / best incl. plain vLLM (no psd-async here) |",
           "|---|---|---|---|---|---|---|---|"]
    for name, t in trace_results.items():
        md.append(f"| {name} | {','.join(map(str, t['phases']))} | {t['best_fixed']} | "
                  f"{t['fixed_tokens_per_s'][t['best_fixed']]} | {t['fixed_tokens_per_s']['vllm-ar']} | "
                  f"{t['auto_tokens_per_s']} | {t['auto_over_best_fixed']} | {t['auto_over_best_any']} |")
    for name, rows in shape_results.items():
        md += ["", f"## Other curve shape: {name} (k 1, 3, 5; host work {HOST_MS} ms)", ""]
        md += table(rows, AUTO_COLUMNS)
    md += ["", "## TP = 4, drafter on a fifth GPU (stated model: forward / 4 + 25 us per layer; host work "
           f"{HOST_MS} ms, likely more at TP > 1)", ""]
    md += table(report["tp4_auto_vs_best_fixed"], AUTO_COLUMNS)
    (OUT / "h200.md").write_text("\n".join(md) + "\n")
    log(f"wrote {OUT}/h200.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
