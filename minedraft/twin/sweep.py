"""Every mode at every load, on one replica: what `minedraft plan` prints and the benchmarks record."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from minedraft.engine.control.auto import AUTO_CHOICES, AutoSettings
from minedraft.twin.costs import DEFAULT_FAMILIES, FIXED_FAMILIES, PLAIN_FAMILIES, AcceptanceModel, StepCosts
from minedraft.twin.run import LookaheadOptions, RunResult, Workload, mode_label, parse_mode_label, run_concurrency

LATENCY_KEYS = ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99")
# What auto chooses among (the engine's synchronous steps), and the baseline it is also judged against: the best of
# every fixed way to run the target on its GPU with the drafter on its own, psd with async steps and plain
# decoding in vLLM itself (the faster plain decoding on a GPU) included.
SYNC_FAMILIES = ("ar", "sd", "psd", "lookahead")
BASELINE_FAMILIES = (*SYNC_FAMILIES, "psd-async", "vllm-ar")


@dataclass(frozen=True)
class SweepSettings:
    concurrencies: tuple[int, ...]
    ks: tuple[int, ...] = (1, 2, 3, 4, 5)
    families: tuple[str, ...] = DEFAULT_FAMILIES
    with_auto: bool = True
    workload: Workload = field(default_factory=Workload)
    warmup_steps: int = 40
    measure_steps: int = 200
    # Auto is measured in its steady state: after its first exploration, over a window long enough to include
    # the periodic probes of modes it is not running (AutoSettings.stale_after_steps).
    auto_warmup_steps: int = 300
    auto_measure_steps: int = 1200
    auto: AutoSettings | None = None
    # The fixed settings within `confirm_within` of their family's best are measured again over auto's window
    # (auto_warmup_steps + auto_measure_steps) when `confirm` is set. The best of some twenty short windows is biased
    # upward (each window's acceptance draws differ; the largest is picked), which auto's one long window is not;
    # confirming the contenders over the same window as auto makes "auto / best fixed" compare like with like.
    confirm: bool = False
    confirm_within: float = 0.03
    # Auto also with the engine's async PSD steps on (`auto-async`: psd's steps scheduled ahead once auto runs psd).
    with_auto_async: bool = False
    seed: int = 0
    # Lookahead's fan-out and the drafter's ranks (the twin's token model) where lookahead runs.
    lookahead: LookaheadOptions = field(default_factory=LookaheadOptions)
    # The requests a replica running (family, k) holds at once, its KV cache's limit (minedraft.twin.capacity);
    # a load beyond it waits in the queue, as it would at a real server. None: no limit.
    kv_limit: Callable[[str, int], int] | None = None

    def __post_init__(self) -> None:
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError(f"concurrency: expected positive numbers of requests, got {self.concurrencies}")
        if not self.ks or min(self.ks) < 1:
            raise ValueError(f"k: expected positive draft lengths, got {self.ks}")
        unknown = set(self.families) - set(FIXED_FAMILIES)
        if unknown:
            raise ValueError(f"modes: unknown {sorted(unknown)}; expected some of {', '.join(FIXED_FAMILIES)}")

    def auto_settings(self) -> AutoSettings:
        return self.auto or AutoSettings(k_candidates=self.ks, allowed_modes=AUTO_CHOICES)

    def settings(self) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        for family in self.families:
            out += [(family, 0)] if family in PLAIN_FAMILIES else [(family, k) for k in self.ks]
        return out


@dataclass
class LoadResult:
    concurrency: int
    runs: dict[str, RunResult] = field(default_factory=dict)
    auto: RunResult | None = None
    auto_async: RunResult | None = None

    def best(self, families: Sequence[str] = SYNC_FAMILIES, per_gpu: bool = False) -> RunResult:
        candidates = [r for label, r in self.runs.items() if _family(label) in families]
        return max(candidates, key=lambda r: r.tokens_per_s_per_gpu if per_gpu else r.tokens_per_s)

    def to_json(self) -> dict[str, Any]:
        modes: dict[str, Any] = {
            label: {"tokens_per_s": round(r.tokens_per_s, 1),
                    "tokens_per_s_per_gpu": round(r.tokens_per_s_per_gpu, 1),
                    "gpus": r.gpus, **{key: r.summary()[key] for key in LATENCY_KEYS}, **_lookahead_json(r)}
            for label, r in self.runs.items()
        }
        for name, auto in (("auto", self.auto), ("auto-async", self.auto_async)):
            if auto is None:
                continue
            mode, k = auto.main_setting
            summary = auto.summary()
            modes[name] = {"tokens_per_s": round(auto.tokens_per_s, 1), "mode": mode, "k": k,
                           "tokens_per_s_per_gpu": round(auto.tokens_per_s_per_gpu, 1), "gpus": auto.gpus,
                           "tpot_ms_p50": summary["tpot_ms_p50"], "tpot_ms_p99": summary["tpot_ms_p99"],
                           "steps_by_setting": auto.steps_by_setting, **_lookahead_json(auto)}
        return {"concurrency": self.concurrency, "modes": modes}


def _lookahead_json(run: RunResult) -> dict[str, float]:
    """Lookahead's fan-out (branches per request its jobs used, averaged) and hit rate, where it ran."""
    if not run.mean_fanout:
        return {}
    return {"fanout": round(run.mean_fanout, 2), "branch_hit_rate": round(run.branch_hit_rate, 3)}


def contenders(runs: dict[str, RunResult], within: float) -> list[str]:
    """The labels of runs within `within` (a share) of the best run of their family."""
    best: dict[str, float] = {}
    for label, run in runs.items():
        best[_family(label)] = max(best.get(_family(label), 0.0), run.tokens_per_s)
    return [label for label, run in runs.items() if run.tokens_per_s >= (1.0 - within) * best[_family(label)]]


def _family(label: str) -> str:
    if label.startswith("vllm-sd"):
        return "vllm-sd"
    return label.split("-k")[0]


Progress = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def sweep(costs: StepCosts, acceptance: AcceptanceModel, settings: SweepSettings,
          progress: Progress | None = _stderr) -> list[LoadResult]:
    results: list[LoadResult] = []
    for concurrency in settings.concurrencies:
        load = LoadResult(concurrency)
        def limit(family: str, k: int) -> int | None:
            return None if settings.kv_limit is None else settings.kv_limit(family, k)

        for mode, k in settings.settings():
            load.runs[mode_label(mode, k)] = run_concurrency(
                costs, acceptance, mode, k, concurrency, settings.workload, settings.warmup_steps,
                settings.measure_steps, settings.seed, max_num_seqs=limit(mode, k), lookahead=settings.lookahead)
        if settings.confirm:
            for label in contenders(load.runs, settings.confirm_within):
                family, k = parse_mode_label(label)
                load.runs[label] = run_concurrency(
                    costs, acceptance, family, k, concurrency, settings.workload, settings.auto_warmup_steps,
                    settings.auto_measure_steps, settings.seed, max_num_seqs=limit(family, k),
                    lookahead=settings.lookahead)
        if settings.with_auto:
            load.auto = run_concurrency(costs, acceptance, "auto", 0, concurrency, settings.workload,
                                        settings.auto_warmup_steps, settings.auto_measure_steps, settings.seed,
                                        auto=settings.auto_settings(), max_num_seqs=limit("auto", max(settings.ks)),
                                        lookahead=settings.lookahead)
        if settings.with_auto_async:
            load.auto_async = run_concurrency(costs, acceptance, "auto-async", 0, concurrency, settings.workload,
                                              settings.auto_warmup_steps, settings.auto_measure_steps, settings.seed,
                                              auto=settings.auto_settings(),
                                              max_num_seqs=limit("auto-async", max(settings.ks)),
                                              lookahead=settings.lookahead)
        if progress is not None:
            best = load.best(BASELINE_FAMILIES)
            auto = "".join(f", {name} {run.tokens_per_s:.0f} ({run.tokens_per_s / best.tokens_per_s:.2f}x)"
                           for name, run in (("auto", load.auto), ("auto-async", load.auto_async)) if run)
            progress(f"twin: concurrency {concurrency}: best fixed (plain vLLM included) {best.mode} "
                     f"{best.tokens_per_s:.0f} tok/s{auto}")
        results.append(load)
    return results
