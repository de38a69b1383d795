"""A policy tried in the twin, not built in the engine: send no draft job while the drafter is still finishing an
abandoned one (ReplicaSettings.hold_jobs_behind_abandoned), against the engine's policy (send it; it queues behind
and its step waits the whole budget for it). On the committed cross-check's curves (benchmarks/results/gpu-twin/
cpu-vs-engine*.json, the catch-up priced at 0.031 ms/token), sd and psd at 4 and 16 requests, with no time spread,
with the drafter's spread measured in the engine at sd/16 (draftless-steps.json), and with a spread where one job in
ten stalls 30x (the engine's drafter on a loaded CPU had single jobs 10-1000x their median).

    python benchmarks/twin_hold_off.py        # seconds, deterministic
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from twin_vs_engine import DRAFTER, OUT, TARGET, _with_catch_up_price, drafter_spreads, hardware_of  # noqa: E402

from minedraft.twin.costs import AcceptanceModel, StepCosts  # noqa: E402
from minedraft.twin.curves import parse_curves  # noqa: E402
from minedraft.twin.run import Workload, run_closed_loop  # noqa: E402

STALLS = (0.5, 0.8, 0.9, 1.0, 1.0, 1.0, 1.1, 1.3, 2.0, 30.0)


def main() -> int:
    report = json.loads((OUT / "cpu-vs-engine.json").read_text())
    doc = json.loads((OUT / report["curves_file"]).read_text())
    workload = Workload(prompt_tokens=report["prompt_tokens_mean"], output_tokens=report["max_tokens"],
                        output_spread=0.0)
    spreads = {"none": (), "measured (sd at 16)": drafter_spreads(OUT / "draftless-steps.json")[("sd", 16)],
               "one job in ten 30x": STALLS}
    print("| spread | mode | requests | engine's policy tok/s (late jobs) | holding jobs tok/s (late jobs) | ratio |")
    print("|---|---|---|---|---|---|")
    for name, spread in spreads.items():
        for mode, concurrency in (("sd", 16), ("sd", 4), ("psd", 16), ("psd", 4)):
            acceptance = AcceptanceModel(tuple(report["acceptance_per_position"][str(concurrency)]))
            priced = _with_catch_up_price(doc, 0.031, acceptance.expected_accepted_length(report["k"]) - 1.0)
            costs = StepCosts.from_curves(parse_curves(priced), TARGET, DRAFTER,
                                          replace(hardware_of(priced), drafter_time_spread=spread))
            runs = [run_closed_loop(costs, acceptance, mode, report["k"], concurrency, 8 * concurrency, workload,
                                    hold_jobs_behind_abandoned=hold) for hold in (False, True)]
            print(f"| {name} | {mode} | {concurrency} | {runs[0].tokens_per_s:.0f} ({runs[0].deadline_misses}) | "
                  f"{runs[1].tokens_per_s:.0f} ({runs[1].deadline_misses}) | "
                  f"{runs[1].tokens_per_s / runs[0].tokens_per_s:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
