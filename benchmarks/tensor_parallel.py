"""The local pair at TP = 1 and TP = 2 (vLLM's CPU multiprocess executor) for ar / sd / psd at concurrency 4 and 16.

Runs `minedraft bench` once per tensor-parallel size and writes one result set: benchmarks/results/tensor-parallel.
{json,md}. Usage (from the repository root): python benchmarks/tensor_parallel.py [extra bench flags]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).parent / "results" / "tensor-parallel"
BENCH = ["--modes", "ar,sd,psd", "--concurrency", "4,16", "--rounds", "1", "--max-tokens", "32",
         "--requests-per-concurrency", "2", "--min-requests", "8", "--max-model-len", "512", "--kv-cache-gib", "1"]


def main(extra: list[str]) -> int:
    reports: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tp in (1, 2):
            path = Path(tmp) / f"tp{tp}.json"
            command = [sys.executable, "-m", "minedraft.cli", "--log-level", "WARNING", "bench", *BENCH,
                       "--tensor-parallel-size", str(tp), "--regime", f"local trained pair, TP = {tp}",
                       "--json", str(path), *extra]
            print("running:", " ".join(command[1:]), file=sys.stderr, flush=True)
            subprocess.run(command, check=False)
            reports[f"tp{tp}"] = json.loads(path.read_text())
    OUT.with_suffix(".json").write_text(json.dumps(reports, indent=2) + "\n")
    lines = ["# Local pair at TP = 1 and TP = 2 (CPU, 2 cores, shared machine)", "",
             "Command: `python benchmarks/tensor_parallel.py` (one `minedraft bench` per TP size: "
             f"`{' '.join(BENCH)}`).", "",
             "| TP | concurrency | mode | output tokens/s | x ar | acceptance | overlap | greedy identical |",
             "|---|---|---|---|---|---|---|---|"]
    for name, report in reports.items():
        for run in report["runs"]:
            ar = run["modes"]["ar"]["output_tokens_per_s"]
            for mode, m in run["modes"].items():
                lines.append(f"| {name[2:]} | {run['concurrency']} | {mode} | {m['output_tokens_per_s']:.1f} | "
                             f"{m['output_tokens_per_s'] / ar:.2f} | {m['acceptance_rate']:.2f} | "
                             f"{m['overlap_fraction']:.2f} | {run['greedy_outputs_identical']} |")
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["greedy_outputs_identical"] for r in reports.values()) else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
