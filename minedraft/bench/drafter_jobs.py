"""What one draft job costs the vLLM drafter backend, by context length: block-hash reuse against re-hashing.

    python -m minedraft.bench.drafter_jobs --json benchmarks/results/drafter/jobs.json [--contexts 512,2048,4096]

The vLLM drafter re-admits every request of a job (vLLM cannot append tokens to a live request). Admission used to
hash every full KV block of each request's whole context for the prefix cache; the drafter now keeps each request's
block hashes between jobs and hashes only new blocks (vllm_adapter.block_hashes.BlockHashReuse). This runs the real
drafter (vLLM backend, the draft model of the local pair, this process pinned to the drafter's cores) through the real
job loop (DrafterServer: deltas in, drafts out) on 32 requests per context length, both ways side by side in one run:
  rehash  vLLM's block hasher alone (the behaviour before)
  reuse   hashes kept between jobs
Each (context, variant) starts from an empty prefix cache; the first job of a run (every prompt's prefill) is not
counted; each later job carries 2 new tokens per request, as a verified step does. Drafts must be identical both ways
(checked). The local pair's positions stop at 2048, so longer contexts use a copy of it with a longer position table
(minedraft.bench.steps): that changes what the draft says, not what a job costs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS = ("rehash", "reuse")


def _settings(pair: Path, args: argparse.Namespace, contexts: list[int]) -> dict[str, Any]:
    from minedraft.engine.settings import default_core_split

    return {
        "model": str(pair / "draft"),
        "backend": "vllm",
        "cpu_cores": list(default_core_split()[1]),
        "dtype": "float32",
        "max_model_len": max(contexts) + 2 * args.jobs + args.k + 64,
        "max_num_seqs": args.requests,
        "kv_cache_gib": args.kv_cache_gib,
        "seed": 0,
    }


class _Timed:
    """Seconds spent in a callable, summed until taken."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.seconds = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class JobTimers:
    """Where a job's time goes (this benchmark only): the draft model's forward passes, admitting the job's requests
    (vLLM's input processing and Request creation), and within admission the KV block hashing."""

    def __init__(self, drafter: Any) -> None:
        from minedraft.bench.steps import RunnerTimers
        from minedraft.engine.vllm_adapter.engine_core import in_process_core, in_process_model_runner

        core = in_process_core(drafter.engine)
        self.runner = RunnerTimers(in_process_model_runner(drafter.engine), {"forward": "_model_forward"})
        self.admit = _Timed(drafter.engine.add_request)
        drafter.engine.add_request = self.admit
        self.hash = _Timed(core.request_block_hasher)
        core.request_block_hasher = self.hash

    def take(self) -> dict[str, float]:
        return {"forward": self.runner.take()["forward"], "admit": self.admit.take(), "hash": self.hash.take()}


def run_variant(drafter: Any, contexts: list[list[int]], variant: str, tag: str, jobs: int, k: int,
                timers: Any) -> dict[str, Any]:
    """One run: a prefill job, then `jobs` measured jobs of 2 new tokens per request."""
    from minedraft.engine.drafter import protocol
    from minedraft.engine.drafter.process import DrafterServer

    assert drafter.block_hashes is not None, "the drafter's vLLM has no prefix caching"
    drafter.block_hashes.enabled = variant == "reuse"
    drafter.engine.reset_prefix_cache()
    server = DrafterServer(drafter, drafter.vocab_size)
    ids = [f"{tag}-{i}" for i in range(len(contexts))]
    held = [list(c) for c in contexts]
    reused_before = drafter.block_hashes.num_reused_blocks
    job_seconds: list[float] = []
    parts: list[dict[str, float]] = []
    draft_seconds: list[float] = []
    drafts: list[list[list[int]]] = []
    items = [protocol.DraftItem(rid, list(c), k) for rid, c in zip(ids, held, strict=True)]
    for job_id in range(jobs + 1):
        timers.take()
        started = time.perf_counter()
        server.handle(protocol.DraftJob(job_id + 1, items))
        reply = server.run_job(server.queued.pop(0), 0.0, lambda: None)
        took = time.perf_counter() - started
        part = timers.take()
        if not isinstance(reply, protocol.DraftReply):
            raise RuntimeError(f"draft job failed: {reply}")
        by_id = {r.request_id: r.token_ids for r in reply.results}
        if job_id:  # the first job prefilled every prompt
            job_seconds.append(took)
            parts.append(part)
            draft_seconds.append(reply.draft_seconds)
            drafts.append([by_id[rid] for rid in ids])
        # The next step's committed tokens: the first two drafted (a verified step's accepted token and bonus).
        items = []
        for rid, context in zip(ids, held, strict=True):
            new = (by_id[rid] + [0, 0])[:2]
            items.append(protocol.DraftItem(rid, new, k, len(context)))
            context.extend(new)
    server.handle(protocol.CancelRequests(ids))
    return {
        "job_seconds": job_seconds,
        "forward_seconds": [p["forward"] for p in parts],
        "admit_seconds": [p["admit"] for p in parts],
        "hash_seconds": [p["hash"] for p in parts],
        "draft_seconds": draft_seconds,
        "reused_blocks_per_job": (drafter.block_hashes.num_reused_blocks - reused_before) / (jobs + 1),
        "drafts": drafts,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="result file (a Markdown table is written beside it)")
    parser.add_argument("--contexts", default="512,2048,4096")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--jobs", type=int, default=8, help="measured jobs per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs per (context, variant), interleaved")
    parser.add_argument("-k", "--k", type=int, default=3)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--pair-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    command = "python -m minedraft.bench.drafter_jobs " + " ".join(shlex.quote(a) for a in
                                                                  (argv if argv is not None else sys.argv[1:]))

    from minedraft.bench.steps import _pair_for_context
    from minedraft.bench.workload import bench_prompts
    from minedraft.engine.drafter.process import _configure_device
    from minedraft.engine.drafter.vllm_backend import VllmDrafter
    from minedraft.models.spec import default_pair_dir

    contexts = [int(c) for c in args.contexts.split(",")]
    source = args.pair_dir or default_pair_dir()
    pair = _pair_for_context(source, max(contexts) + 2 * args.jobs + args.k + 64)
    settings = _settings(pair, args, contexts)
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    _configure_device(settings)  # this process is the drafter: its cores, in-process vLLM

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source / "draft"))
    base_ids = list(tokenizer.encode(" ".join(bench_prompts(source, 64, chars=400))))
    drafter = VllmDrafter(settings)
    timers = JobTimers(drafter)
    results: dict[str, Any] = {
        "config": {"command": command, "contexts": contexts, "requests": args.requests, "jobs": args.jobs,
                   "rounds": args.rounds, "k": args.k, "pair_dir": str(pair), "cores": settings["cpu_cores"],
                   "machine": "shared 2-core CPU, contended by other jobs"},
        "runs": [],
    }
    for context in contexts:
        # Distinct contexts per request (no prefix shared across requests), `context` tokens each.
        prompts = []
        for i in range(args.requests):
            start = (i * 997) % len(base_ids)
            rotated = base_ids[start:] + base_ids[:start]
            prompts.append((rotated * (context // len(rotated) + 1))[:context])
        per_variant: dict[str, dict[str, Any]] = {v: {"job_seconds": [], "forward_seconds": [], "other_seconds": [],
                                                      "admit_seconds": [], "hash_seconds": [], "draft_seconds": [],
                                                      "drafts": [], "reused": []}
                                                  for v in VARIANTS}
        for round_index in range(args.rounds):
            order = VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                out = run_variant(drafter, prompts, variant, f"{variant}-{round_index}-{context}", args.jobs, args.k,
                                  timers)
                acc = per_variant[variant]
                acc["job_seconds"] += out["job_seconds"]
                acc["forward_seconds"] += out["forward_seconds"]
                acc["admit_seconds"] += out["admit_seconds"]
                acc["hash_seconds"] += out["hash_seconds"]
                acc["other_seconds"] += [j - f for j, f in zip(out["job_seconds"], out["forward_seconds"], strict=True)]
                acc["draft_seconds"] += out["draft_seconds"]
                acc["drafts"].append(out["drafts"])
                acc["reused"].append(out["reused_blocks_per_job"])
                print(f"context {context} {variant} round {round_index}: median job "
                      f"{statistics.median(out['job_seconds']) * 1000:.1f} ms", file=sys.stderr, flush=True)
        identical = per_variant["rehash"]["drafts"] == per_variant["reuse"]["drafts"]
        for variant in VARIANTS:
            acc = per_variant[variant]
            results["runs"].append({
                "context": context,
                "variant": variant,
                "jobs": len(acc["job_seconds"]),
                "job_seconds_median": statistics.median(acc["job_seconds"]),
                "job_seconds_p90": sorted(acc["job_seconds"])[int(0.9 * (len(acc["job_seconds"]) - 1))],
                "forward_seconds_median": statistics.median(acc["forward_seconds"]),
                "other_seconds_median": statistics.median(acc["other_seconds"]),
                "admit_seconds_median": statistics.median(acc["admit_seconds"]),
                "hash_seconds_median": statistics.median(acc["hash_seconds"]),
                "draft_seconds_median": statistics.median(acc["draft_seconds"]),
                "reused_blocks_per_job": statistics.mean(acc["reused"]),
                "drafts_identical_to_rehash": identical,
            })
        if not identical:
            print(f"context {context}: drafts differ between the variants", file=sys.stderr)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    args.json.with_suffix(".md").write_text(table)
    print(table, file=sys.stderr)
    return 0 if all(r["drafts_identical_to_rehash"] for r in results["runs"]) else 1


def markdown(results: dict[str, Any]) -> str:
    ms = 1000.0
    config = results["config"]
    lines = [
        f"# vLLM drafter: one draft job of {config['requests']} requests (k={config['k']}), by context length",
        "",
        f"`{config['command']}` on a {config['machine']}; medians of {config['jobs']} jobs x {config['rounds']} "
        "rounds per cell, variants interleaved. rehash: vLLM's block hasher over each re-admitted request's whole "
        "context (before); reuse: block hashes kept between jobs (after). job: wall time through the drafter's job "
        "loop; forward: the draft model's forward passes in it (attention reads the whole context's KV: drafting "
        "cost proper); other: the rest (the per-job overhead); admit: of other, admitting the job's requests to "
        "vLLM (input processing, Request creation); hash: of admit, KV block hashing. Whole-job times move with the "
        "machine's load; admit and hash are the parts this change is about.",
        "",
        "| context | variant | job ms | forward ms | other ms | admit ms | hash ms | reused blocks per job "
        "| drafts identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        lines.append(
            f"| {r['context']} | {r['variant']} | {r['job_seconds_median'] * ms:.1f} | "
            f"{r['forward_seconds_median'] * ms:.1f} | {r['other_seconds_median'] * ms:.1f} | "
            f"{r['admit_seconds_median'] * ms:.2f} | {r['hash_seconds_median'] * ms:.2f} | "
            f"{r['reused_blocks_per_job']:.0f} | {'yes' if r['drafts_identical_to_rehash'] else 'NO'} |"
        )
    lines += ["", "| context | job reuse/rehash | admit reuse/rehash | hash reuse/rehash |", "|---|---|---|---|"]
    by_key = {(r["context"], r["variant"]): r for r in results["runs"]}
    for context in config["contexts"]:
        before, after = by_key[(context, "rehash")], by_key[(context, "reuse")]
        lines.append(" | ".join([
            f"| {context}",
            *(f"{after[f'{part}_seconds_median'] / before[f'{part}_seconds_median']:.2f}"
              for part in ("job", "admit", "hash")),
        ]) + " |")
    first, last = config["contexts"][0], config["contexts"][-1]
    lines.append("")
    for variant in VARIANTS:
        low, high = by_key[(first, variant)], by_key[(last, variant)]
        growth = {part: high[f"{part}_seconds_median"] / low[f"{part}_seconds_median"]
                  for part in ("job", "forward", "admit", "hash")}
        lines.append(f"- {variant}: from {first} to {last} tokens, job x{growth['job']:.2f}, forward "
                     f"x{growth['forward']:.2f}, admit x{growth['admit']:.2f}, hash x{growth['hash']:.2f}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
