"""Loads for the twin's replica and what they measure: fixed concurrency (closed loop), concurrency phases over time
(a diurnal curve, bursts), or arrivals at given times (open loop). Output tokens per second, per GPU, and each
request's TTFT and time per output token (p50/p99)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from minedraft.engine.control.auto import AutoSettings
from minedraft.engine.control.cost_model import LOCAL_PAIR_RANK_GIVEN_REJECTION
from minedraft.engine.settings import DEFAULT_LOOKAHEAD_FANOUT
from minedraft.twin.costs import PLAIN_FAMILIES, AcceptanceModel, StepCosts
from minedraft.twin.replica import ReplicaSettings, SimRequest, TwinReplica

# Stop a run that makes no progress (a bug, not a load): steps without a single output token.
MAX_IDLE_STEPS = 10_000
# Auto, and auto with the engine's --async-psd-steps (psd's steps scheduled ahead once auto runs psd).
AUTO_MODES = ("auto", "auto-async")


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int = 1024
    output_tokens: int = 256
    # Output lengths are drawn uniformly within +-spread of the mean, so requests finish at different steps.
    output_spread: float = 0.5

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 2:
            raise ValueError("workload: prompt_tokens >= 1 and output_tokens >= 2")
        if not 0.0 <= self.output_spread < 1.0:
            raise ValueError(f"output_spread: must be within [0, 1), got {self.output_spread}")

    def draw_output(self, rng: random.Random) -> int:
        low = max(2, round(self.output_tokens * (1 - self.output_spread)))
        high = max(low, round(self.output_tokens * (1 + self.output_spread)))
        return rng.randint(low, high)


@dataclass(frozen=True)
class LookaheadOptions:
    """Lookahead in the twin: the engine's --lookahead-fanout (the most branches per request; its core drafts fewer
    where measured drafter time would not hide behind a verification), and the drafter's rank of the target's token
    after a miss of its top choice (twin/tokens.py), which with the acceptance model sets how often branches hit."""

    fanout: int = DEFAULT_LOOKAHEAD_FANOUT
    rank_given_rejection: tuple[float, ...] = LOCAL_PAIR_RANK_GIVEN_REJECTION
    # A miss verified with a backup branch (the engine's default) or without drafts (--no-lookahead-backups).
    backups: bool = True


@dataclass(frozen=True)
class Phase:
    concurrency: int
    duration_s: float


@dataclass
class RunResult:
    mode: str
    k: int
    gpus: int
    tokens: int
    seconds: float
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    steps_by_mode: dict[str, int] = field(default_factory=dict)
    steps_by_setting: dict[str, int] = field(default_factory=dict)
    num_decisions: int = 0
    deadline_misses: int = 0
    # Lookahead: decoding requests verified with a matching branch, of all its steps verified (0: none ran), and the
    # fan-out its branch jobs used, averaged over the steps that sent one.
    branch_hit_rate: float = 0.0
    mean_fanout: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def main_setting(self) -> tuple[str, int]:
        """The setting that ran the most steps (what auto settled on): (mode, k), k 0 for ar."""
        if not self.steps_by_setting:
            return self.mode, self.k
        label = max(self.steps_by_setting, key=lambda s: self.steps_by_setting[s])
        return parse_mode_label(label)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.gpus

    def summary(self) -> dict[str, float | int | str | dict[str, int] | None]:
        return {
            "mode": self.mode, "k": self.k, "gpus": self.gpus,
            "tokens_per_s": round(self.tokens_per_s, 1),
            "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 1),
            "ttft_ms_p50": _ms(percentile(self.ttft_s, 50)), "ttft_ms_p99": _ms(percentile(self.ttft_s, 99)),
            "tpot_ms_p50": _ms(percentile(self.tpot_s, 50)), "tpot_ms_p99": _ms(percentile(self.tpot_s, 99)),
            "steps_by_mode": dict(self.steps_by_mode), "decisions": self.num_decisions,
            "deadline_misses": self.deadline_misses,
            **({"branch_hit_rate": round(self.branch_hit_rate, 3), "fanout": round(self.mean_fanout, 2)}
               if self.mean_fanout else {}),
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 2)


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q / 100.0 * len(ordered)) - 1))
    return ordered[index]


def mode_label(mode: str, k: int) -> str:
    """The engine's mode names with the draft length: ar, sd-k3, psd-k5, vllm-sd-k3, auto; vllm-ar (plain vLLM) and
    psd-async-k3 (psd with --async-psd-steps) besides."""
    return mode if mode in (*PLAIN_FAMILIES, *AUTO_MODES) else f"{mode}-k{k}"


def parse_mode_label(label: str) -> tuple[str, int]:
    for prefix in ("vllm-sd", "psd-async", "psd", "sd", "lookahead"):
        if label.startswith(prefix + "-k") and label[len(prefix) + 2:].isdigit():
            return prefix, int(label[len(prefix) + 2:])
    if label in (*PLAIN_FAMILIES, *AUTO_MODES):
        return label, 0
    raise ValueError(f"mode: {label!r} is not ar, vllm-ar, auto, auto-async, sd-kK, psd-kK, psd-async-kK, "
                     "lookahead-kK or vllm-sd-kK")


class _Run:
    def __init__(self, costs: StepCosts, acceptance: AcceptanceModel, mode: str, k: int, workload: Workload,
                 seed: int, auto: AutoSettings | None, max_num_seqs: int,
                 hold_jobs_behind_abandoned: bool = False, lookahead: LookaheadOptions | None = None,
                 draft_length: str = "fixed", acceptance_spread: tuple[float, ...] = ()) -> None:
        auto_settings = auto or AutoSettings()
        if mode in AUTO_MODES:
            # Auto starts where an engine built for auto starts: psd, at k=3 when that is a candidate.
            k = 3 if 3 in auto_settings.k_candidates else max(auto_settings.k_candidates)
        # psd-async, auto-async: the engine's psd or auto with --async-psd-steps (psd's steps scheduled ahead).
        async_steps = mode in ("psd-async", "auto-async")
        replica_mode = {"psd-async": "psd", "auto-async": "auto"}.get(mode, mode)
        lookahead = lookahead or LookaheadOptions()
        settings = ReplicaSettings(mode=replica_mode, k=max(1, k), auto=auto_settings,
                                   seed=seed, max_num_seqs=max_num_seqs, async_psd_steps=async_steps,
                                   hold_jobs_behind_abandoned=hold_jobs_behind_abandoned,
                                   lookahead_fanout=lookahead.fanout,
                                   rank_given_rejection=lookahead.rank_given_rejection,
                                   lookahead_backups=lookahead.backups, draft_length=draft_length,
                                   acceptance_spread=acceptance_spread)
        self.replica = TwinReplica(costs, acceptance, settings)
        self.workload = workload
        self.rng = random.Random(seed + 1)
        self.count = 0
        # Auto holds what psd holds: the drafter's device stays with the replica whichever mode runs.
        self.result = RunResult(mode_label(mode, k), 0 if mode in (*PLAIN_FAMILIES, *AUTO_MODES) else k,
                                costs.gpus("psd" if mode in AUTO_MODES else mode), 0, 0.0)

    def new_request(self, at_s: float, prompt: int | None = None, output: int | None = None) -> SimRequest:
        self.count += 1
        return SimRequest(f"r{self.count}", prompt or self.workload.prompt_tokens,
                          output or self.workload.draw_output(self.rng), at_s)

    def record(self, finished: list[SimRequest], measuring: bool) -> None:
        if not measuring:
            return
        for request in finished:
            if request.first_token_s is None or request.finished_s is None:
                continue
            self.result.ttft_s.append(request.first_token_s - request.arrival_s)
            if request.output_tokens > 1:
                self.result.tpot_s.append((request.finished_s - request.first_token_s) / (request.output_tokens - 1))

    def finish(self) -> RunResult:
        replica = self.replica
        self.result.steps_by_mode = dict(replica.steps_by_mode)
        self.result.steps_by_setting = dict(replica.steps_by_setting)
        self.result.num_decisions = replica.num_decisions
        self.result.deadline_misses = replica.deadline_misses
        totals = replica.core.stats.totals()
        self.result.branch_hit_rate = totals.branch_hit_rate
        fanouts = replica.lookahead_fanouts
        steps = sum(fanouts.values())
        self.result.mean_fanout = sum(f * n for f, n in fanouts.items()) / steps if steps else 0.0
        return self.result


def run_concurrency(costs: StepCosts, acceptance: AcceptanceModel, mode: str, k: int, concurrency: int,
                    workload: Workload = Workload(), warmup_steps: int = 40, measure_steps: int = 200,
                    seed: int = 0, auto: AutoSettings | None = None, min_measure_tokens: int = 8000,
                    max_num_seqs: int | None = None, lookahead: LookaheadOptions | None = None,
                    draft_length: str = "fixed", acceptance_spread: tuple[float, ...] = ()) -> RunResult:
    """Steady state at a fixed number of requests in the system (a finished request is replaced at once), measured
    over at least `measure_steps` steps and `min_measure_tokens` output tokens after `warmup_steps`.
    `max_num_seqs`: the most the replica runs at once (its KV cache's limit); the rest wait, as at a real server,
    their wait counted in their time to first token. `draft_length`: the engine's --draft-length;
    `acceptance_spread`: each request's own acceptance rate (ReplicaSettings.acceptance_spread)."""
    limit = max(1, concurrency if max_num_seqs is None else min(concurrency, max_num_seqs))
    run = _Run(costs, acceptance, mode, k, workload, seed, auto, max_num_seqs=limit, lookahead=lookahead,
               draft_length=draft_length, acceptance_spread=acceptance_spread)
    replica = run.replica
    for index in range(concurrency):
        if index >= limit:  # beyond the KV cache's limit: queued from the start
            replica.add(run.new_request(0.0))
            continue
        # Already under way, each at a random point of its output (as in a steady state), so requests finish and
        # are replaced from the first steps on instead of all together; their latencies are not recorded.
        request = run.new_request(0.0)
        request.prefilled = True
        request.output_tokens = run.rng.randint(1, request.max_output_tokens - 1)
        replica.add(request)
    measure_from = 0.0
    step = 0
    while step < warmup_steps + measure_steps or run.result.tokens < min_measure_tokens:
        if step == warmup_steps:
            measure_from = replica.clock.now
        outcome = replica.step()
        measuring = step >= warmup_steps
        step += 1
        if measuring:
            run.result.tokens += outcome.output_tokens
        run.record(outcome.finished, measuring)
        for _ in outcome.finished:
            replica.add(run.new_request(replica.clock.now))
    run.result.seconds = replica.clock.now - measure_from
    return run.finish()


def run_phases(costs: StepCosts, acceptance: AcceptanceModel, mode: str, k: int, phases: Sequence[Phase],
               workload: Workload = Workload(), seed: int = 0, auto: AutoSettings | None = None,
               schedule: Sequence[tuple[str, int]] | None = None,
               follow: Callable[[int], tuple[str, int]] | None = None) -> RunResult:
    """Closed loop whose concurrency follows `phases` (each held for its duration of simulated time). Measures the
    whole trace: tokens over time, every request that finished.

    `schedule`: a (mode, k) per phase, switched to at the phase's start (an oracle that knows each phase's best
    setting in advance; `mode` and `k` are then the first phase's and the run is labelled "oracle"). `follow`: the
    (mode, k) to run at each number of running requests, applied before every step (an oracle that follows the load
    as it moves, ramps and drains included, by a steady regime map)."""
    if not phases:
        raise ValueError("phases: at least one")
    if schedule is not None and len(schedule) != len(phases):
        raise ValueError(f"schedule: one (mode, k) per phase, got {len(schedule)} for {len(phases)} phases")
    if schedule is not None:
        mode, k = schedule[0]
    run = _Run(costs, acceptance, mode, k, workload, seed, auto, max_num_seqs=max(p.concurrency for p in phases))
    if schedule is not None or follow is not None:
        run.result.mode, run.result.k, run.result.gpus = "oracle", 0, costs.gpus("psd")
    replica = run.replica
    end = 0.0
    for index, phase in enumerate(phases):
        if schedule is not None and schedule[index] != (replica.mode.value, replica.k):
            replica.switch(*schedule[index])
        end += phase.duration_s
        idle = 0
        while replica.clock.now < end:
            while replica.num_in_system < phase.concurrency:
                replica.add(run.new_request(replica.clock.now))
            if follow is not None:
                wanted = follow(replica.num_in_system)
                if wanted != (replica.mode.value, 0 if replica.mode.value == "ar" else replica.k):
                    replica.switch(*wanted)
            outcome = replica.step()
            run.result.tokens += outcome.output_tokens
            run.record(outcome.finished, True)
            idle = 0 if outcome.output_tokens else idle + 1
            if idle > MAX_IDLE_STEPS:
                raise RuntimeError(f"twin: no progress in {MAX_IDLE_STEPS} steps ({run.result.mode})")
    run.result.seconds = replica.clock.now
    return run.finish()


def run_arrivals(costs: StepCosts, acceptance: AcceptanceModel, mode: str, k: int,
                 arrivals: Sequence[tuple[float, int, int]], seed: int = 0, auto: AutoSettings | None = None,
                 max_num_seqs: int = 256) -> RunResult:
    """Open loop: (arrival_s, prompt_tokens, output_tokens) per request. Runs until every request has finished."""
    run = _Run(costs, acceptance, mode, k, Workload(), seed, auto, max_num_seqs)
    replica = run.replica
    pending = sorted(arrivals)
    for at_s, prompt, output in pending:
        replica.add(run.new_request(at_s, prompt, output))
    remaining = len(pending)
    first = pending[0][0] if pending else 0.0
    replica.idle_until(first)
    while remaining:
        if not replica.requests:
            replica.idle_until(min(r.arrival_s for r in replica.waiting))
        outcome = replica.step()
        run.result.tokens += outcome.output_tokens
        run.record(outcome.finished, True)
        remaining -= len(outcome.finished)
    run.result.seconds = replica.clock.now - first
    return run.finish()


def run_closed_loop(costs: StepCosts, acceptance: AcceptanceModel, mode: str, k: int, concurrency: int,
                    num_requests: int, workload: Workload = Workload(), seed: int = 0,
                    auto: AutoSettings | None = None, hold_jobs_behind_abandoned: bool = False) -> RunResult:
    """What `minedraft bench` measures: `num_requests` requests, at most `concurrency` in flight (a finished one
    replaced at once, the first `concurrency` all arriving at 0), until all are done; output tokens over the
    makespan, ramp-up and drain included. (`hold_jobs_behind_abandoned`: see ReplicaSettings.)"""
    if concurrency < 1 or num_requests < 1:
        raise ValueError(f"closed loop: concurrency and num_requests must be >= 1, got {concurrency}, {num_requests}")
    run = _Run(costs, acceptance, mode, k, workload, seed, auto, max_num_seqs=concurrency,
               hold_jobs_behind_abandoned=hold_jobs_behind_abandoned)
    replica = run.replica
    sent = done = idle = 0
    while done < num_requests:
        while sent < num_requests and replica.num_in_system < concurrency:
            replica.add(run.new_request(replica.clock.now))
            sent += 1
        outcome = replica.step()
        run.result.tokens += outcome.output_tokens
        run.record(outcome.finished, True)
        done += len(outcome.finished)
        idle = 0 if outcome.output_tokens else idle + 1
        if idle > MAX_IDLE_STEPS:
            raise RuntimeError(f"twin: no progress in {MAX_IDLE_STEPS} steps ({run.result.mode})")
    run.result.seconds = replica.clock.now
    return run.finish()
