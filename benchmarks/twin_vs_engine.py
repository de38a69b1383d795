"""Cross-check the twin against the real engine: a `minedraft bench` result (ar, sd, psd at several concurrencies,
measured on this machine) beside the twin run on a cost-curve file measured on the same machine (`minedraft
profile`), at the bench's concurrencies with the acceptance the bench measured.

    python benchmarks/twin_vs_engine.py --curves CURVES.json --target NAME --drafter NAME --bench BENCH.json

Prints, per concurrency and mode, the engine's measured verify and draft milliseconds per step beside the curve
file's forward and draft-loop times at the same shape (the inputs), and both throughputs with their ratio (the
output). Run the bench and the profiler back to back on an idle machine: both are timings.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minedraft.twin.cli import acceptance_from_bench  # noqa: E402
from minedraft.twin.costs import Hardware, StepCosts  # noqa: E402
from minedraft.twin.curves import load_curves  # noqa: E402
from minedraft.twin.run import Workload, run_concurrency  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--curves", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--bench", required=True, help="a `minedraft bench` JSON with ar, sd and psd")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--step-overhead-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    bench = json.loads(Path(args.bench).read_text())
    k = int(bench["config"]["num_speculative_tokens"])
    max_tokens = int(bench["config"]["max_tokens"])
    costs = StepCosts.from_curves(load_curves(args.curves), args.target, args.drafter,
                                  Hardware(step_overhead_ms=args.step_overhead_ms))
    acceptance = acceptance_from_bench(Path(args.bench))
    context = args.prompt_tokens + max_tokens / 2
    workload = Workload(prompt_tokens=args.prompt_tokens, output_tokens=max_tokens, output_spread=0.0)
    print("| requests | mode | engine verify ms/step | curves verify ms | engine draft ms/step | curves draft ms | "
          "engine tok/s | twin tok/s | twin / engine |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in bench["runs"]:
        concurrency = run["concurrency"]
        if not isinstance(concurrency, int):
            continue
        for mode in ("ar", "sd", "psd"):
            measured = run["modes"].get(mode)
            if not measured or "verify_seconds_per_step" not in measured:
                continue
            batch = concurrency if mode != "psd" else max(1, concurrency // 2)
            verify = costs.verify_ms(batch, context, 1 if mode == "ar" else k + 1)
            draft = costs.draft_ms(batch, context, k) if mode != "ar" else 0.0
            twin = run_concurrency(costs, acceptance, mode, k, concurrency, workload).tokens_per_s
            engine = measured["output_tokens_per_s"]
            print(f"| {concurrency} | {mode} | {measured['verify_seconds_per_step'] * 1000:.1f} | {verify:.1f} | "
                  f"{measured['draft_seconds_per_step'] * 1000:.1f} | {draft:.1f} | {engine:.0f} | {twin:.0f} | "
                  f"{twin / engine:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
