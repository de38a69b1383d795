"""Auto over load-varying traces in the twin, against the best single fixed mode and against the per-phase oracle.

    python benchmarks/twin_traces.py          # a few minutes per curve file on a contended 2-core machine

For each curve file (the H200 file; the same with drafts 6x slower, as eager drafting is; an A100-like roofline):

1. The steady regime map: every fixed setting (ar, sd and psd at k 1-5) at 1-256 requests.
2. The bound: a trace of steady phases delivers sum(time share x tokens/s) over its phases, so its per-phase oracle
   (each phase run in its own best setting) over the best single fixed setting is at most the value of a linear
   program over time shares w_c >= 0: maximise sum_c w_c best_c subject to sum_c w_c rate_c(m) <= 1 for every fixed
   setting m. Its optimum is the largest gain choosing per load can give over ANY mix of these loads; below 1.1 no
   controller reaches 1.1x the best fixed mode on that file, whatever the trace.
3. Traces: the diurnal and bursts traces of benchmarks/twin_gpu.py, and one designed from the regime map by a
   stated rule (not from auto's results): "quiet-burst", two loads alternating in cycles, a quiet load Q for
   (1 - f) of each cycle and a burst load B for f, where (Q, B, f) maximise the steady oracle over the best fixed
   setting among two-load mixes (f in steps of 1%): the mix on which a single fixed mode does worst. Each trace is
   run closed-loop in every fixed setting, in two oracles (each phase's steady best switched at the phase's start;
   and the steady best at the number of requests in the system, switched whenever that changes, so ramps and
   drains run in their own best setting too: the better of the two is "the oracle"), switched through the planner
   as the engine switches, and in auto (the engine's own controller and cost model).

Writes benchmarks/results/gpu-twin/traces.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minedraft.engine.control.auto import AutoSettings  # noqa: E402
from minedraft.twin.costs import AcceptanceModel, Hardware, StepCosts  # noqa: E402
from minedraft.twin.curves import parse_curves  # noqa: E402
from minedraft.twin.run import Phase, Workload, parse_mode_label, run_phases  # noqa: E402
from minedraft.twin.sweep import SweepSettings, sweep  # noqa: E402
from minedraft.twin.synthetic import A100_LIKE, roofline_curves, slow_drafter  # noqa: E402

CURVES = ROOT / "benchmarks" / "curves" / "h200-qwen3-32b.json"
OUT = ROOT / "benchmarks" / "results" / "gpu-twin"
COMMAND = "python benchmarks/twin_traces.py"
CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256)
KS = (1, 2, 3, 4, 5)
ACCEPTANCE = 0.8
PHASE_SECONDS = 10.0
TRACES = {
    "diurnal": (2, 4, 8, 16, 64, 128, 256, 128, 64, 16, 8, 4),
    "bursts": (4, 192, 4, 192, 8, 256, 8),
}
# quiet-burst: cycles of this many seconds, this many cycles.
CYCLE_SECONDS = 600.0
CYCLES = 2
TARGET = 1.1


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def steady_rates(costs: StepCosts, acceptance: AcceptanceModel) -> dict[int, dict[str, float]]:
    loads = sweep(costs, acceptance, SweepSettings(concurrencies=CONCURRENCIES, ks=KS, families=("ar", "sd", "psd"),
                                                   with_auto=False, measure_steps=150), progress=None)
    return {load.concurrency: {label: r.tokens_per_s for label, r in load.runs.items()} for load in loads}


def oracle_bound(rates: dict[int, dict[str, float]]) -> tuple[float, dict[int, float]]:
    """The linear program of the module's docstring: (bound, time share per load)."""
    from scipy.optimize import linprog

    loads = sorted(rates)
    settings = list(rates[loads[0]])
    best = [max(rates[c].values()) for c in loads]
    result = linprog([-b for b in best], A_ub=[[rates[c][m] for c in loads] for m in settings],
                     b_ub=[1.0] * len(settings), bounds=[(0, None)] * len(loads))
    total = float(sum(result.x))
    return -float(result.fun), {c: round(float(w) / total, 3) for c, w in zip(loads, result.x, strict=True)
                                if w > 1e-9}


def steady_gain(rates: dict[int, dict[str, float]], shares: dict[int, float]) -> tuple[float, str]:
    """Steady oracle over the best fixed setting for time shares of loads, and that setting."""
    settings = list(next(iter(rates.values())))
    fixed = {m: sum(w * rates[c][m] for c, w in shares.items()) for m in settings}
    best = max(fixed, key=lambda m: fixed[m])
    return sum(w * max(rates[c].values()) for c, w in shares.items()) / fixed[best], best


def quiet_burst(rates: dict[int, dict[str, float]]) -> tuple[int, int, float, float]:
    """(Q, B, f, steady gain) of the two-load mix that maximises the steady oracle over the best fixed setting."""
    best = (0, 0, 0.0, 0.0)
    loads = sorted(rates)
    for quiet in loads:
        for burst in loads:
            if burst <= quiet:
                continue
            for percent in range(1, 100):
                f = percent / 100
                gain, _ = steady_gain(rates, {quiet: 1 - f, burst: f})
                if gain > best[3]:
                    best = (quiet, burst, f, gain)
    return best


def run_trace(costs: StepCosts, acceptance: AcceptanceModel, phases: Sequence[Phase],
              rates: dict[int, dict[str, float]]) -> dict[str, Any]:
    fixed: dict[str, float] = {}
    for label in rates[CONCURRENCIES[0]]:
        mode, k = parse_mode_label(label)
        fixed[label] = run_phases(costs, acceptance, mode, k, phases).tokens_per_s
    best = max(fixed, key=lambda label: fixed[label])
    schedule = [parse_mode_label(max(rates[p.concurrency].items(), key=lambda item: item[1])[0]) for p in phases]
    oracle = run_phases(costs, acceptance, "ar", 0, phases, schedule=schedule).tokens_per_s

    def steady_best(running: int) -> tuple[str, int]:
        nearest = min(rates, key=lambda c: abs(math.log(max(running, 1) / c)))
        return parse_mode_label(max(rates[nearest], key=lambda m: rates[nearest][m]))

    following = run_phases(costs, acceptance, "ar", 0, phases, follow=steady_best).tokens_per_s
    oracle = max(oracle, following)
    auto = run_phases(costs, acceptance, "auto", 0, phases, auto=AutoSettings(k_candidates=KS))
    # The controller as it was before it reacted to load shifts, for comparison.
    before = run_phases(costs, acceptance, "auto", 0, phases, auto=AutoSettings(k_candidates=KS,
                                                                                load_shift_factor=None))
    shares: dict[int, float] = {}
    total = sum(p.duration_s for p in phases)
    for p in phases:
        shares[p.concurrency] = shares.get(p.concurrency, 0.0) + p.duration_s / total
    steady, _ = steady_gain(rates, shares)
    return {"phases": [[p.concurrency, p.duration_s] for p in phases], "best_fixed": best,
            "best_fixed_tokens_per_s": round(fixed[best], 1), "oracle_tokens_per_s": round(oracle, 1),
            "auto_tokens_per_s": round(auto.tokens_per_s, 1),
            "steady_oracle_over_best_fixed": round(steady, 3),
            "oracle_over_best_fixed": round(oracle / fixed[best], 3),
            "auto_over_best_fixed": round(auto.tokens_per_s / fixed[best], 3),
            "auto_over_oracle": round(auto.tokens_per_s / oracle, 3),
            "auto_without_load_shift_over_best_fixed": round(before.tokens_per_s / fixed[best], 3),
            "auto_steps_by_setting": auto.steps_by_setting, "auto_decisions": auto.num_decisions,
            "fixed_tokens_per_s": {label: round(v, 1) for label, v in fixed.items()}}


# The first word of each curve file's name in curve_files(): how the command line names it.
FILE_KEYS = ("h200", "eager-drafter", "a100-like")


def curve_files() -> dict[str, StepCosts]:
    h200 = json.loads(CURVES.read_text())
    files = {"h200": h200, "eager-drafter (H200, drafts x6)": slow_drafter(h200, 6.0),
             "a100-like roofline": roofline_curves(A100_LIKE)}
    return {name: StepCosts.from_curves(parse_curves(data, name), "qwen3-32b", "qwen3-1.7b", Hardware())
            for name, data in files.items()}


def main(argv: list[str] | None = None) -> int:
    # A parser, so that --help (or a misspelt file name) explains instead of writing an empty report over the results.
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", metavar="FILE", help=f"curve files to run, of {', '.join(FILE_KEYS)} "
                        "(default: all)")
    names = parser.parse_args(argv).files or None
    if unknown := sorted(set(names or ()) - set(FILE_KEYS)):
        parser.error(f"files: unknown {', '.join(unknown)}; choose from {', '.join(FILE_KEYS)}")
    acceptance = AcceptanceModel.constant(ACCEPTANCE)
    report: dict[str, Any] = {"command": COMMAND, "acceptance_per_position": ACCEPTANCE,
                              "workload": {"prompt_tokens": Workload().prompt_tokens,
                                           "output_tokens_mean": Workload().output_tokens},
                              "files": {}}
    for name, costs in curve_files().items():
        if names and name.split(" ")[0] not in names:
            continue
        log(f"{name}: steady regime map")
        rates = steady_rates(costs, acceptance)
        bound, shares = oracle_bound(rates)
        quiet, burst, share, gain = quiet_burst(rates)
        log(f"{name}: oracle bound over any load mix {bound:.3f} (time shares {shares}); quiet-burst Q={quiet} "
            f"B={burst} f={share:.2f}: steady gain {gain:.3f}")
        traces = {label: [Phase(c, PHASE_SECONDS) for c in loads] for label, loads in TRACES.items()}
        traces["quiet-burst"] = [Phase(c, d) for _ in range(CYCLES) for c, d in
                                 ((quiet, CYCLE_SECONDS * (1 - share)), (burst, CYCLE_SECONDS * share))]
        results = {}
        for label, phases in traces.items():
            results[label] = run_trace(costs, acceptance, phases, rates)
            r = results[label]
            log(f"{name} {label}: oracle/best fixed {r['oracle_over_best_fixed']}, auto/best fixed "
                f"{r['auto_over_best_fixed']}, auto/oracle {r['auto_over_oracle']}")
        report["files"][name] = {
            "steady_tokens_per_s": {str(c): {m: round(v, 1) for m, v in r.items()} for c, r in rates.items()},
            "oracle_bound_any_mix": round(bound, 3), "bound_time_shares": {str(c): w for c, w in shares.items()},
            "quiet_burst": {"quiet": quiet, "burst": burst, "burst_share": share, "steady_gain": round(gain, 3)},
            "traces": results}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "traces.json").write_text(json.dumps(report, indent=1) + "\n")
    md = ["# Auto over load-varying traces: against the best fixed mode and the per-phase oracle (twin)", "",
          f"Command: `{COMMAND}`. Acceptance {ACCEPTANCE} per position, prompts {Workload().prompt_tokens} tokens, "
          f"outputs {Workload().output_tokens} on average; TP = 1, drafter on its own GPU. Fixed settings: ar, sd and "
          "psd at k 1-5. The oracle runs each load's steady best setting: switched at each phase's start, or whenever "
          "the number of requests in the system changes (ramps and drains too), the better of the two. The bound is "
          "the largest steady oracle / best fixed over any mix of the loads 1-256 (a linear program over time "
          "shares). 'Steady oracle' prices the trace's time shares at steady tokens/s (no transitions). The last "
          "column is auto with its load-shift reaction turned off (load_shift_factor=None: the controller as it was "
          "before), in the same run.", ""]
    for name, data in report["files"].items():
        md += [f"## {name}", "",
               f"Oracle bound over any mix of loads: **{data['oracle_bound_any_mix']}** (at time shares "
               f"{data['bound_time_shares']}).", "",
               "| trace | phases (requests x s) | best fixed | its tok/s | steady oracle / best fixed | oracle / best "
               "fixed | auto / best fixed | auto / oracle | auto without load-shift reaction / best fixed |",
               "|---|---|---|---|---|---|---|---|---|"]
        for label, r in data["traces"].items():
            phase_list = ", ".join(f"{c}x{d:g}" for c, d in r["phases"])
            md.append(f"| {label} | {phase_list} | {r['best_fixed']} | {r['best_fixed_tokens_per_s']} | "
                      f"{r['steady_oracle_over_best_fixed']} | {r['oracle_over_best_fixed']} | "
                      f"{r['auto_over_best_fixed']} | {r['auto_over_oracle']} | "
                      f"{r['auto_without_load_shift_over_best_fixed']} |")
        md.append("")
    (OUT / "traces.md").write_text("\n".join(md) + "\n")
    plot(report, OUT / "traces.png")
    log(f"wrote {OUT}/traces.{{json,md,png}}")
    return 0


def plot(report: dict[str, Any], path: Path) -> None:
    """Per curve file and trace: the oracle, auto and auto without its load-shift reaction over the best fixed mode,
    against the 1.1x goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = report["files"]
    fig, axes = plt.subplots(1, len(files), figsize=(5.2 * len(files), 4.2), sharey=True, squeeze=False)
    series = (("oracle_over_best_fixed", "per-load oracle", "#bbbbbb"),
              ("auto_over_best_fixed", "auto", "#1f77b4"),
              ("auto_without_load_shift_over_best_fixed", "auto, no load-shift reaction", "#9ecae1"))
    for ax, (name, data) in zip(axes[0], files.items(), strict=True):
        labels = list(data["traces"])
        width = 0.8 / len(series)
        for n, (key, label, colour) in enumerate(series):
            ax.bar([i + (n - 1) * width for i in range(len(labels))], [data["traces"][t][key] for t in labels],
                   width, label=label, color=colour)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(1.1, color="tab:red", linestyle="--", linewidth=0.8, label="goal 1.1x")
        ax.set_xticks(range(len(labels)), labels)
        ax.set_title(f"{name}\n(bound over any load mix {data['oracle_bound_any_mix']})", fontsize=9)
        ax.set_ylim(0.85, max(1.25, *(data["traces"][t]["oracle_over_best_fixed"] + 0.05 for t in labels)))
    axes[0][0].set_ylabel("tokens/s over the best single fixed mode")
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.suptitle("Auto over load-varying traces (twin; best fixed = ar, sd or psd at one k for the whole trace)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
