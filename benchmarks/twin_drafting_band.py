"""The twin's GPU conclusions against the price of drafting: over which band of drafting cost does each hold?

The H200 curves' drafter time is a bare CUDA-graph draft loop (no admission, scheduling, sampling or copy back); a
real drafter job costs more (how much is what the `drafter-job` stage of scripts/gpu_session.sh measures), and with
eager drafting several times more. This reruns the twin (the engine's own planner, link and wait policy on simulated
time) with every drafter time multiplied by a factor, at TP = 1 and TP = 4 (drafter on its own GPU), and reports per
load the best engine mode, psd/sd at k = 3 and psd-async against plain vLLM, and for each conclusion the factors it
holds at.

    python benchmarks/twin_drafting_band.py                      # a few minutes on this 2-core machine
    python benchmarks/twin_drafting_band.py --drafter-job DIR/drafter-job.json
        # also the factor a GPU session measured: its drafter job's wall time over the curves' draft loop at the
        # same batch (context 1024, k = 3), rerun at that factor

Writes benchmarks/results/gpu-twin/drafting-band.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minedraft.twin.costs import DEFAULT_GPU_HOST_MS_PER_STEP, AcceptanceModel, Hardware, StepCosts  # noqa: E402
from minedraft.twin.curves import parse_curves  # noqa: E402
from minedraft.twin.sweep import SweepSettings, sweep  # noqa: E402
from minedraft.twin.synthetic import slow_drafter  # noqa: E402

CURVES = ROOT / "benchmarks" / "curves" / "h200-qwen3-32b.json"
OUT = ROOT / "benchmarks" / "results" / "gpu-twin"
FACTORS = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
CONCURRENCIES = (4, 32, 128)
FAMILIES = ("ar", "vllm-ar", "sd", "psd", "psd-async")
ACCEPTANCE = 0.8


def session_factor(path: Path, curves: dict[str, Any]) -> float:
    """A GPU session's drafter job (wall time, context 1024, k = 3) over the curves' draft loop at the same batch:
    what a job costs beyond the bare loop (median over the batches both have)."""
    stage = json.loads(path.read_text())
    loops = {(row["batch"], row["context"], row["k"]): row["ms"]
             for row in curves["models"]["qwen3-1.7b"]["draft_loop_ms"]}
    ratios = [job["job_wall_ms"] / loops[(job["batch"], job["context"], job["k"])]
              for job in stage.get("results", []) if (job["batch"], job["context"], job["k"]) in loops]
    if not ratios:
        raise SystemExit(f"drafter-job: no job of {path} matches a draft loop of the curves (context 1024, k 3)")
    return round(statistics.median(ratios), 3)


def run(factors: tuple[float, ...], concurrencies: tuple[int, ...]) -> list[dict[str, Any]]:
    h200 = json.loads(CURVES.read_text())
    rows = []
    for tp in (1, 4):
        for factor in factors:
            data = h200 if factor == 1.0 else slow_drafter(h200, factor, execution="drafting priced")
            costs = StepCosts.from_curves(parse_curves(data, f"x{factor:g}"), "qwen3-32b", "qwen3-1.7b",
                                          Hardware(tensor_parallel_size=tp,
                                                   step_overhead_ms=DEFAULT_GPU_HOST_MS_PER_STEP))
            loads = sweep(costs, AcceptanceModel.constant(ACCEPTANCE),
                          SweepSettings(concurrencies=concurrencies, ks=(3,), families=FAMILIES, with_auto=False),
                          progress=None)
            for load in loads:
                tokens = {label: r.tokens_per_s for label, r in load.runs.items()}
                best = load.best(("ar", "sd", "psd"))
                rows.append({"tp": tp, "factor": factor, "concurrency": load.concurrency,
                             "best_engine_mode": best.mode if best.mode == "ar" else f"{best.mode}",
                             "psd_over_sd": round(tokens["psd-k3"] / tokens["sd-k3"], 3),
                             "psd_async_over_plain_vllm": round(tokens["psd-async-k3"] / tokens["vllm-ar"], 3),
                             "best_engine_over_plain_vllm": round(best.tokens_per_s / tokens["vllm-ar"], 3)})
            print(f"tp={tp} x{factor:g} done", file=sys.stderr, flush=True)
    return rows


def bands(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (tp, concurrency): the factors at which psd beats sd, and at which the engine beats plain vLLM."""
    out = []
    for tp in sorted({r["tp"] for r in rows}):
        for concurrency in sorted({r["concurrency"] for r in rows}):
            mine = [r for r in rows if r["tp"] == tp and r["concurrency"] == concurrency]
            out.append({"tp": tp, "concurrency": concurrency,
                        "psd_beats_sd_at": [r["factor"] for r in mine if r["psd_over_sd"] > 1.0],
                        "engine_beats_plain_vllm_at": [r["factor"] for r in mine
                                                       if r["best_engine_over_plain_vllm"] > 1.0],
                        "best_mode_by_factor": {str(r["factor"]): r["best_engine_mode"] for r in mine}})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter-job", type=Path, help="a GPU session's drafter-job.json: also its factor")
    parser.add_argument("--factors", default=",".join(f"{f:g}" for f in FACTORS))
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCIES)))
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    factors = tuple(float(f) for f in args.factors.split(","))
    measured = None
    if args.drafter_job:
        measured = session_factor(args.drafter_job, json.loads(CURVES.read_text()))
        factors = tuple(sorted({*factors, measured}))
    rows = run(factors, tuple(int(c) for c in args.concurrency.split(",")))
    command = "python benchmarks/twin_drafting_band.py" + (" " + " ".join(argv) if argv else "")
    report = {"command": command, "curves": "benchmarks/curves/h200-qwen3-32b.json (measured on an H200, 2026-12-04)",
              "acceptance_per_position": ACCEPTANCE, "host_ms_per_step": DEFAULT_GPU_HOST_MS_PER_STEP, "k": 3,
              "measured_factor": measured, "rows": rows, "bands": bands(rows)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "drafting-band.json").write_text(json.dumps(report, indent=1) + "\n")
    md = ["# The twin's conclusions against the price of drafting", "",
          f"Command: `{command}`. The H200 curves with every drafter time multiplied by a factor (1: the bare "
          "CUDA-graph loop as measured), k = 3, acceptance 0.8 per position, "
          f"{DEFAULT_GPU_HOST_MS_PER_STEP} ms of host work per step, drafter on its own GPU; TP = 4 by the twin's "
          "stated model (forward / 4 + all-reduces).",
          "", "Measured factor (a GPU session's drafter job over the bare loop): "
          + (f"{measured}" if measured is not None else "none yet (no GPU session has run)"), "",
          "| TP | concurrency | factor | best engine mode | psd/sd | psd-async / plain vLLM | "
          "best engine / plain vLLM |",
          "|---|---|---|---|---|---|---|"]
    md += [f"| {r['tp']} | {r['concurrency']} | {r['factor']:g} | {r['best_engine_mode']} | {r['psd_over_sd']} | "
           f"{r['psd_async_over_plain_vllm']} | {r['best_engine_over_plain_vllm']} |" for r in rows]
    md += ["", "## Bands", "",
           "| TP | concurrency | psd beats sd at factors | the engine beats plain vLLM at factors |",
           "|---|---|---|---|"]
    md += [f"| {b['tp']} | {b['concurrency']} | {', '.join(f'{f:g}' for f in b['psd_beats_sd_at']) or 'none'} | "
           f"{', '.join(f'{f:g}' for f in b['engine_beats_plain_vllm_at']) or 'none'} |" for b in report["bands"]]
    (args.out / "drafting-band.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
