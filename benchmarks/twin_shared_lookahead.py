"""Lookahead replicas sharing one drafter GPU, against sd replicas, in the twin on the H200 curves (Qwen3-32B target
at TP = 1, Qwen3-1.7B drafter, k = 3, acceptance 0.8 per position, 2.5 ms host work per step).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/twin_shared_lookahead.py [--loads 8,32] [--replicas 1,2,4] [--json]

Per load (requests per replica) and replicas on the one drafter: tokens/s of all replicas, the drafter's busy share,
the part of it on lookahead's extra branches (drafted only in rounds no other job joined: the service's policy,
twin/shared_drafter.py), which the pool's autoscaler leaves out, and the mean round (rows per batched draft loop).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minedraft.twin.costs import DEFAULT_GPU_HOST_MS_PER_STEP, AcceptanceModel, Hardware, StepCosts  # noqa: E402
from minedraft.twin.curves import load_curves  # noqa: E402
from minedraft.twin.shared_drafter import run_shared  # noqa: E402

CURVES = ROOT / "benchmarks" / "curves" / "h200-qwen3-32b.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loads", default="8,32", help="requests per replica, comma-separated")
    parser.add_argument("--replicas", default="1,2,4", help="replicas on the one drafter, comma-separated")
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    args = parser.parse_args()
    costs = StepCosts.from_curves(load_curves(CURVES), "qwen3-32b", "qwen3-1.7b",
                                  Hardware(step_overhead_ms=DEFAULT_GPU_HOST_MS_PER_STEP))
    acceptance = AcceptanceModel.constant(0.8)
    rows = []
    for load in (int(x) for x in args.loads.split(",")):
        for replicas in (int(x) for x in args.replicas.split(",")):
            row: dict[str, object] = {"requests_per_replica": load, "replicas": replicas}
            for mode in ("sd", "lookahead"):
                run = run_shared(costs, acceptance, args.k, replicas, load, mode=mode, measure_steps=150)
                row[mode] = {"tokens_per_s": round(run.result.tokens_per_s, 1),
                             "drafter_busy": round(run.drafter_utilisation, 3),
                             "optional_busy": round(run.optional_utilisation, 3),
                             "mean_round_rows": round(run.mean_round_batch, 1)}
            sd, la = row["sd"], row["lookahead"]
            assert isinstance(sd, dict) and isinstance(la, dict)
            row["lookahead_over_sd"] = round(la["tokens_per_s"] / sd["tokens_per_s"], 3)
            rows.append(row)
            print(f"{load} requests x {replicas} replicas: sd {sd['tokens_per_s']:.0f} tok/s (drafter busy "
                  f"{sd['drafter_busy']:.2f}), lookahead {la['tokens_per_s']:.0f} tok/s "
                  f"({row['lookahead_over_sd']:.2f}x; drafter busy {la['drafter_busy']:.2f}, of it on extra branches "
                  f"{la['optional_busy']:.2f}; rounds of {la['mean_round_rows']:.0f} rows)",
                  file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
