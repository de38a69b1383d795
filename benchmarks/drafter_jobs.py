"""The torch drafter's own job times on the local pair's draft model: a lookahead branch job (one tree row per
request, its branches' tails and drafts past the committed context) and an sd job, optionally paired with another
version of the drafter (a baseline file), the two alternating job by job (ABBA), so both see the same machine: in
blocks of 20 jobs each, the ratio of medians swung 0.98-1.9x between runs on a shared 2-core VM, job by job 0.96-1.05.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/drafter_jobs.py [--requests 1,4] [--branches 4] [--k 3]
    git show REV:minedraft/engine/drafter/torch_backend.py > /tmp/baseline.py
    PYTHONPATH=$PWD .venv/bin/python benchmarks/drafter_jobs.py --baseline /tmp/baseline.py [--json]

Each job extends every request's context by two committed tokens (a verification's accepted tokens), as the engine's
jobs do; contexts start at 200 tokens and are cut back past 1,200. One thread, as the drafter process runs on one
core. Printed: the median milliseconds per job, and the ratio to the baseline's where one is given.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from minedraft.engine.drafter.torch_backend import TorchLlamaDrafter  # noqa: E402
from minedraft.models.spec import default_pair_dir  # noqa: E402


def load_baseline(path: Path) -> type:
    """TorchLlamaDrafter from another version of torch_backend.py (registered under a module name of its own)."""
    spec = importlib.util.spec_from_file_location("drafter_baseline", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.TorchLlamaDrafter  # type: ignore[no-any-return]


def jobs(cls: type, model_dir: Path, requests: int, branches: int, k: int, seed: int
         ) -> dict[str, Callable[[], Any]]:
    drafter = cls(str(model_dir), max_slots=2 * requests + branches + 8, max_model_len=2048)
    rng = random.Random(seed)
    vocab = int(drafter.vocab_size)
    contexts = {f"r{i}": [rng.randrange(1, vocab) for _ in range(200)] for i in range(requests)}
    drafter.draft_with_candidates([(rid, ctx, k) for rid, ctx in contexts.items()], False)

    def advance() -> None:
        for ctx in contexts.values():
            if len(ctx) > 1200:
                del ctx[300:]
            ctx.extend(rng.randrange(1, vocab) for _ in range(2))

    def tree() -> Any:
        advance()
        items = [(rid, list(ctx), tuple(rng.randrange(1, vocab) for _ in range(1 + b % k)), k)
                 for rid, ctx in contexts.items() for b in range(branches)]
        return drafter.draft_tree(items, False, None, branches)

    def sd() -> Any:
        advance()
        return drafter.draft_with_candidates([(rid, list(ctx), k) for rid, ctx in contexts.items()], False)

    return {"tree": tree, "sd": sd}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", default="1,4", help="comma-separated requests per job")
    parser.add_argument("--branches", type=int, default=4, help="branches per request in a tree job")
    parser.add_argument("--k", type=int, default=3, help="tokens drafted per branch / request")
    parser.add_argument("--jobs", type=int, default=200, help="jobs of each kind per version (after 5 warm-up ones)")
    parser.add_argument("--baseline", type=Path, help="another torch_backend.py to time beside this one")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = default_pair_dir() / "draft"
    versions: dict[str, type] = {"current": TorchLlamaDrafter}
    if args.baseline:
        versions["baseline"] = load_baseline(args.baseline)
    rows = []
    for requests in (int(r) for r in args.requests.split(",")):
        made = {name: jobs(cls, model_dir, requests, args.branches, args.k, seed=0) for name, cls in versions.items()}
        times: dict[tuple[str, str], list[float]] = {(v, j): [] for v in made for j in ("tree", "sd")}
        names = list(made)
        for kind in ("tree", "sd"):
            for name in names:
                for _ in range(5):  # warm-up
                    made[name][kind]()
            for i in range(args.jobs):
                for name in names if i % 2 == 0 else names[::-1]:
                    started = time.perf_counter()
                    made[name][kind]()
                    times[(name, kind)].append((time.perf_counter() - started) * 1e3)
            print(f"requests {requests}: {kind} jobs timed", file=sys.stderr, flush=True)
        for kind in ("tree", "sd"):
            row: dict[str, Any] = {"requests": requests, "job": kind,
                                   "branches": args.branches if kind == "tree" else 1, "k": args.k,
                                   "ms": round(statistics.median(times[("current", kind)]), 3)}
            if "baseline" in made:
                row["baseline_ms"] = round(statistics.median(times[("baseline", kind)]), 3)
                row["ratio"] = round(row["ms"] / row["baseline_ms"], 3)
            rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for row in rows:
        against = f" vs {row['baseline_ms']:.2f} ms baseline: {row['ratio']:.3f}x" if "ratio" in row else ""
        print(f"{row['job']:>4} job, {row['requests']} request(s) x {row['branches']} branch(es), k={row['k']}: "
              f"{row['ms']:.2f} ms{against}")


if __name__ == "__main__":
    main()
