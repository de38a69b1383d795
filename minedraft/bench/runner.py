"""Side-by-side benchmark: the same prompts through each mode, interleaved, in one process tree.

Each engine runs in a worker process of its own: `psd` and `sd` share one (the same drafter process, switched
between overlapped and sequential), `ar` and `vllm-sd` each have theirs. Only one workload runs at a time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from minedraft.bench.workload import Trace, Workload
from minedraft.engine.control.stats import EngineTotals
from minedraft.engine.placement import detect_device, resolved_settings
from minedraft.engine.settings import EngineSettings, Mode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchConfig:
    base: EngineSettings
    modes: list[Mode]
    concurrencies: list[int]
    prompts: list[str]
    max_tokens: int
    rounds: int = 2
    # Cores for the engines without a drafter process of their own (ar, vllm-sd).
    baseline_cpu_cores: tuple[int, ...] = ()
    warmup_requests: int = 4
    # Requests per run = max(len(prompts) if 0 else this * concurrency, min_requests): fewer at low load so
    # every concurrency takes comparable time.
    requests_per_concurrency: int = 0
    min_requests: int = 4
    trace: str | None = None
    labels: dict[str, Any] = field(default_factory=dict)

    def prompts_for(self, concurrency: int) -> list[str]:
        if not self.requests_per_concurrency:
            return self.prompts
        count = max(self.min_requests, self.requests_per_concurrency * concurrency)
        return [self.prompts[i % len(self.prompts)] for i in range(count)]


def _engine_kind(mode: Mode) -> str:
    # psd, sd, lookahead and auto share one engine (one process, one drafter): runs in separate processes with
    # identical settings differed by up to 7% per level. Auto keeps a cost model of its own, fed only by its own steps.
    return "minedraft" if mode in (Mode.PSD, Mode.SD, Mode.AUTO, Mode.LOOKAHEAD) else mode.value


def _kind_settings(config: BenchConfig, kind: str) -> EngineSettings:
    if kind == "minedraft":
        # With auto among the modes, the engine is built for the draft lengths auto may switch to.
        max_k = (replace(config.base, mode=Mode.AUTO).max_draft_tokens_per_request if Mode.AUTO in config.modes
                 else config.base.max_num_speculative_tokens)
        return replace(config.base, mode=Mode.PSD, max_num_speculative_tokens=max_k,
                       auto={**config.base.auto, "learn_from_fixed_modes": False})
    cores = config.baseline_cpu_cores or config.base.target_cpu_cores
    return replace(config.base, mode=Mode(kind), target_cpu_cores=cores)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


class Run(NamedTuple):
    results: list[dict[str, Any]]
    makespan_seconds: float
    totals: dict[str, Any]
    tokens_by_mode: dict[str, int]
    # auto's decisions during the run (empty for the other modes)
    decisions: list[dict[str, Any]]


def aggregate(mode: Mode, runs: list[Run], config_k: int) -> dict[str, Any]:
    """Headline figures of one mode over its rounds."""
    requests = [r for run in runs for r in run.results]
    tokens = sum(len(r["token_ids"]) for r in requests)
    makespan = sum(run.makespan_seconds for run in runs)
    ttft = [r["ttft_seconds"] for r in requests]
    tpot = [r["tpot_seconds"] for r in requests]
    e2e = [r["e2e_seconds"] for r in requests]
    if mode in (Mode.PSD, Mode.SD, Mode.AUTO, Mode.LOOKAHEAD):
        pooled = sum((EngineTotals(**run.totals) for run in runs), EngineTotals())
        summary = pooled.summary()
        acceptance = summary["acceptance_rate"]
        accepted_length = summary["mean_accepted_length"]
        overlap = summary["overlap_fraction"]
        extra = {key: summary[key] for key in ("verify_seconds_per_step", "draft_seconds_per_step",
                                               "wait_seconds_per_step", "steps", "acceptance_per_position")}
        if mode is Mode.LOOKAHEAD:
            extra["branch_hit_rate"] = summary["branch_hit_rate"]
            extra["branches_per_step"] = pooled.branches_drafted / pooled.steps if pooled.steps else 0.0
            extra["bonus_top_f_after_full"] = (pooled.bonus_covered_after_full / pooled.bonus_after_full
                                               if pooled.bonus_after_full else 0.0)
            extra["bonus_top_f_after_reject"] = (pooled.bonus_covered_after_reject / pooled.bonus_after_reject
                                                 if pooled.bonus_after_reject else 0.0)
        if mode is Mode.AUTO:
            shares: dict[str, int] = {}
            for run in runs:
                for name, count in run.tokens_by_mode.items():
                    shares[name] = shares.get(name, 0) + count
            total = sum(shares.values()) or 1
            extra["output_token_share_by_mode"] = {name: round(c / total, 3) for name, c in sorted(shares.items())}
            extra["mode_switches"] = pooled.mode_switches
            extra["decisions_by_round"] = [run.decisions for run in runs]
    else:
        drafted = sum(r["num_draft_tokens"] for r in requests)
        accepted = sum(r["num_accepted_tokens"] for r in requests)
        acceptance = accepted / drafted if drafted else 0.0
        # vLLM reports per-request totals only: verifications that carried drafts = drafted / k.
        k = config_k
        accepted_length = 1.0 + accepted / (drafted / k) if drafted else 1.0
        overlap = 0.0
        extra = {}
    by_round = [sum(len(r["token_ids"]) for r in run.results) / run.makespan_seconds if run.makespan_seconds else 0.0
                for run in runs]
    return {
        "output_tokens_per_s": tokens / makespan if makespan else 0.0,
        "output_tokens_per_s_by_round": by_round,
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p99_s": _percentile(ttft, 99),
        "tpot_p50_s": _percentile(tpot, 50),
        "tpot_p99_s": _percentile(tpot, 99),
        "e2e_p50_s": _percentile(e2e, 50),
        "e2e_p99_s": _percentile(e2e, 99),
        "acceptance_rate": acceptance,
        "mean_accepted_length": accepted_length,
        "overlap_fraction": overlap,
        "num_requests": len(requests),
        "output_tokens": tokens,
        "makespan_s": makespan,
        **extra,
    }


def run_bench(config: BenchConfig) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    from minedraft.bench.worker import worker_main

    kinds = sorted({_engine_kind(m) for m in config.modes})
    workers: dict[str, tuple[Any, Any]] = {}
    started = time.perf_counter()
    try:
        for kind in kinds:
            parent, child = context.Pipe()
            process = context.Process(target=worker_main, args=(_kind_settings(config, kind), child),
                                      name=f"bench-{kind}")
            process.start()
            workers[kind] = (process, parent)
        for kind, (_, conn) in workers.items():
            message = conn.recv()
            log.info("engine %s ready (%.1fs)", kind, message[1])
        print(f"engines ready after {time.perf_counter() - started:.0f}s", file=sys.stderr)

        def run(mode: Mode, workload: Workload | Trace) -> Run:
            _, conn = workers[_engine_kind(mode)]
            conn.send(("run", mode.value, workload))
            message = conn.recv()
            _, results, makespan, totals, by_mode, decisions = message
            return Run(results, makespan, totals, by_mode, decisions)

        for mode in config.modes:
            run(mode, Workload(config.prompts[: config.warmup_requests], config.warmup_requests, 8))

        k = config.base.num_speculative_tokens
        loads: list[tuple[int | str, Workload | Trace]] = [
            (c, Workload(config.prompts_for(c), c, config.max_tokens)) for c in config.concurrencies
        ]
        if config.trace:
            trace = Trace.parse(config.trace, config.prompts, config.max_tokens)
            loads.append((f"trace {trace.label}", trace))
        per_concurrency = []
        for label, workload in loads:
            collected: dict[Mode, list[Run]] = {m: [] for m in config.modes}
            for round_index in range(config.rounds):
                order = config.modes if round_index % 2 == 0 else list(reversed(config.modes))
                for mode in order:
                    t0 = time.perf_counter()
                    collected[mode].append(run(mode, workload))
                    print(f"concurrency {label} round {round_index + 1}/{config.rounds} {mode.value}: "
                          f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
            modes = {m.value: aggregate(m, runs, k) for m, runs in collected.items()}
            identical = _greedy_identical(collected)
            per_concurrency.append({"concurrency": label, "modes": modes, "greedy_outputs_identical": identical})
        if "minedraft" in workers:
            # The cost model of the psd/sd engine, fed by every step it ran: its predictions beside the measurements.
            _, conn = workers["minedraft"]
            predict_at = sorted({*range(1, max(config.concurrencies) + 1), *config.concurrencies})
            conn.send(("predict", predict_at, k))
            _, predictions = conn.recv()
            predicted = {str(c): {p["mode"]: p["output_tokens_per_second"] for p in ps}
                         for c, ps in predictions.items()}
        else:
            predicted = {}
    finally:
        for _, conn in workers.values():
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(("stop",))
        for process, _ in workers.values():
            process.join(timeout=60)
            if process.is_alive():
                process.kill()

    base = config.base
    config_out = {
        "target_model": base.model,
        "draft_model": base.drafter.model,
        "modes": [m.value for m in config.modes],
        "concurrency": config.concurrencies if len(config.concurrencies) > 1 else config.concurrencies[0],
        "num_prompts": len(config.prompts) if not config.requests_per_concurrency else
        f"max({config.min_requests}, {config.requests_per_concurrency} x concurrency)",
        "max_tokens": config.max_tokens,
        "num_speculative_tokens": base.num_speculative_tokens,
        "num_extra_draft_tokens": base.num_extra_draft_tokens,
        "rounds": config.rounds,
        "target_cpu_cores": list(base.target_cpu_cores),
        "drafter_cpu_cores": list(base.drafter.cpu_cores),
        "baseline_cpu_cores": list(config.baseline_cpu_cores or base.target_cpu_cores),
        "tensor_parallel_size": base.tensor_parallel_size,
        # What the engines computed in ("auto" resolved the way each engine resolves it on this machine).
        "dtype": resolved_settings(base, detect_device()).dtype,
        "greedy": True,
        "ignore_eos": True,
        **config.labels,
    }
    if len(per_concurrency) == 1:
        return {"config": config_out, "modes": per_concurrency[0]["modes"],
                "greedy_outputs_identical": per_concurrency[0]["greedy_outputs_identical"],
                "predicted_tokens_per_s": predicted}
    return {"config": config_out, "runs": per_concurrency,
            "greedy_outputs_identical": all(r["greedy_outputs_identical"] for r in per_concurrency),
            "predicted_tokens_per_s": predicted}


def _greedy_identical(collected: dict[Mode, list[Run]]) -> bool:
    reference_mode = Mode.AR if Mode.AR in collected else next(iter(collected))
    reference = [r["token_ids"] for r in collected[reference_mode][0].results]
    for runs in collected.values():
        for run in runs:
            if [r["token_ids"] for r in run.results] != reference:
                return False
    return True


def write_outputs(report: dict[str, Any], json_path: Path) -> None:
    from minedraft.bench.report import markdown_table, plot

    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    json_path.with_suffix(".md").write_text(markdown_table(report))
    plot(report, json_path.with_suffix(".png"))

