"""Replay a traffic trace against a model of replicas under a scaling policy (minedraft or hpa-queue).

Deterministic: arrivals are Poisson draws from a seeded generator, everything else follows from the trace and the
replica model. Time advances in 1 s ticks (arrivals, decisions), and within a tick continuously: requests arrive
into a FIFO queue, are admitted while the replica has a free slot (the model's max batch) — also when a slot frees
mid-tick — and decode at the per-request speed the replica model gives for the batch and the trace's acceptance.
A request's time to first token is its wait plus one step; it violates the SLO when that exceeds the trace's
`slo_ttft_seconds`.

Both policies see what they would see in a cluster: every interval (15 s), running and waiting requests now (the
minedraft policy also early, at an operator tick (5 s) where the waiting requests grew since its last evaluation); the
minedraft policy also the output token rate and finished requests per second over the last minute (rate1m) and the
engines' predicted goodput (their cost model's best over modes and k at the current batch, with the acceptance it
has seen: an estimate that forgets 0.5% per decoding step, as the engine's, at the replicas' step rate). New
replicas serve `startup_seconds` after the decision and cost replica-seconds from the decision on. Scale-down
removes starting replicas first, then ready ones, which finish their requests (drain).

Trace format (JSON lines): an optional first line {"config": {...}} (slo_ttft_seconds, min_replicas, max_replicas,
event_seconds, description), then {"t": s, "arrival_rps": x, "prompt_tokens": n, "output_tokens": n,
"acceptance_rate": a} rows; each row holds until the next one; the last holds for `duration_seconds` (config) or
60 s. `acceptance_rate` is the per-position acceptance (see replica_model.py), not the engines' accepted / drafted.
"""

from __future__ import annotations

import json
import math
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minedraft.operator.autoscale.hpa import SYNC_PERIOD_SECONDS, HpaConfig, HpaState, hpa_decide
from minedraft.operator.autoscale.policy import (
    Observations,
    PolicyConfig,
    PolicyState,
    SpeculationFigures,
    decide,
    evaluate_early,
    wake_from_zero,
)
from minedraft.operator.autoscale.replica_model import AnyReplicaModel, acceptance_rate_metric, accepted_length
from minedraft.operator.settings import OperatorSettings

POLICIES = ("minedraft", "hpa-queue", "oracle")
DEFAULT_SLO_TTFT_SECONDS = 2.5
RATE_WINDOW_SECONDS = 60  # the recording rules' rate1m
# The engine's acceptance profile forgets with this factor per decoding step (cost_model.AcceptanceProfile).
ENGINE_ACCEPTANCE_DECAY = 0.995
DEFAULT_SEED = 0
# Cohorts finishing within one tick, at most (each frees slots that queued requests take at once).
MAX_EVENTS_PER_TICK = 1000
# The policy's prior capacity (before any speed is measured): the replica model's full batch at this acceptance, a
# middle value, not the trace's (the operator would not know it in advance).
PRIOR_ACCEPTANCE = 0.55


@dataclass(frozen=True)
class TraceRow:
    t: float
    arrival_rps: float
    prompt_tokens: int
    output_tokens: int
    acceptance_rate: float


@dataclass(frozen=True)
class Trace:
    name: str
    rows: tuple[TraceRow, ...]
    slo_ttft_seconds: float = DEFAULT_SLO_TTFT_SECONDS
    min_replicas: int = 1
    max_replicas: int = 20
    duration_seconds: float = 0.0
    event_seconds: float | None = None  # when the trace's event (step, collapse) happens: reaction is timed from it
    description: str = ""

    def row_at(self, t: float, start_index: int) -> tuple[TraceRow, int]:
        i = start_index
        while i + 1 < len(self.rows) and self.rows[i + 1].t <= t:
            i += 1
        return self.rows[i], i


def parse_trace(text: str, name: str) -> Trace:
    config: dict[str, Any] = {}
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        data = json.loads(line)
        if "config" in data:
            config = dict(data["config"])
            continue
        try:
            rows.append(TraceRow(float(data["t"]), float(data["arrival_rps"]), int(data["prompt_tokens"]),
                                 int(data["output_tokens"]), float(data["acceptance_rate"])))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{name}:{number}: a trace row needs t, arrival_rps, prompt_tokens, output_tokens, "
                             f"acceptance_rate ({exc})") from exc
    if not rows:
        raise ValueError(f"{name}: no trace rows")
    rows.sort(key=lambda r: r.t)
    duration = float(config.get("duration_seconds", rows[-1].t + 60.0))
    return Trace(name=name, rows=tuple(rows), slo_ttft_seconds=float(config.get("slo_ttft_seconds",
                                                                                 DEFAULT_SLO_TTFT_SECONDS)),
                 min_replicas=int(config.get("min_replicas", 1)), max_replicas=int(config.get("max_replicas", 20)),
                 duration_seconds=duration, event_seconds=config.get("event_seconds"),
                 description=str(config.get("description", "")))


def load_trace(path: Path) -> Trace:
    return parse_trace(path.read_text(), path.stem)


@dataclass
class _Cohort:
    """Requests that arrived in the same tick (and were admitted together): count may be fractional after splits."""

    count: float
    arrived: float
    remaining_tokens: float
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0

    @property
    def kv_tokens(self) -> float:
        """KV cache a request holds at most (prompt + output): what admission reserves for it."""
        return self.prompt_tokens + self.output_tokens

    @property
    def kv_used_tokens(self) -> float:
        """KV cache a request holds now (prompt + what it generated so far): what the engines' gauge reports."""
        return self.prompt_tokens + self.output_tokens - self.remaining_tokens


@dataclass
class SimResult:
    policy: str
    trace: str
    replica_seconds: float
    slo_violation_fraction: float
    requests: float
    max_queue: float
    direction_changes: int
    first_reaction_seconds: float | None  # seconds from the trace's event to the first scale-up beyond its count
    decisions: list[dict[str, Any]] = field(default_factory=list)
    timeline: dict[str, list[float]] = field(default_factory=dict)
    # Churn: replicas removed while still starting (asked for, then removed before they served), and scale-downs
    # within CHURN_SECONDS of a scale-up.
    removed_before_ready: int = 0
    scale_downs_soon_after_scale_up: int = 0
    # Seconds in which a replica's KV cache was full (a request waited for KV, not for a slot of the batch).
    kv_full_seconds: float = 0.0
    startup_seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {"policy": self.policy, "trace": self.trace, "replica_seconds": round(self.replica_seconds, 1),
                "slo_violation_fraction": round(self.slo_violation_fraction, 6),
                "requests": round(self.requests, 1), "max_queue": round(self.max_queue, 1),
                "direction_changes": self.direction_changes, "first_reaction_seconds": self.first_reaction_seconds,
                "removed_before_ready": self.removed_before_ready,
                "scale_downs_soon_after_scale_up": self.scale_downs_soon_after_scale_up,
                "kv_full_seconds": self.kv_full_seconds, "startup_seconds": self.startup_seconds}

    def to_json(self) -> dict[str, Any]:
        return {**self.summary(), "decisions": self.decisions, "timeline": self.timeline}


def _poisson(rng: random.Random, mean: float) -> int:
    if mean <= 0:
        return 0
    if mean > 30:
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


_BEST_CACHE: dict[tuple[int, float, float], tuple[float, str, int]] = {}
MAX_BEST_CACHE = 500_000


# The operator's default tick (its autoscaler's timer).
OPERATOR_TICK_SECONDS = OperatorSettings.autoscale_tick_seconds
# A scale-down this soon after a scale-up is churn (the simulator counts it): the replicas just asked for have barely
# served, if at all.
CHURN_SECONDS = 120.0


@dataclass(frozen=True)
class SimConfig:
    policy: str = "minedraft"
    interval_seconds: float = SYNC_PERIOD_SECONDS
    hpa_target_per_pod: float = 16.0
    target_utilization: float = 0.8
    scale_down_stabilization_seconds: float = 300.0
    max_scale_up_step: int = 4
    seed: int = DEFAULT_SEED
    initial_replicas: int | None = None  # default: what the trace's first row needs at the target utilisation
    # policy "oracle": replicas existing (serving or starting) per second, decided with perfect foresight.
    schedule: tuple[int, ...] | None = None
    # Policy minedraft: the operator's tick, at which it reads the engines' waiting requests and evaluates early
    # when they grew since the last evaluation (policy.evaluate_early); None: evaluations on the interval only.
    operator_tick_seconds: float | None = OPERATOR_TICK_SECONDS
    # From a scale-up to its replicas serving; None: the replica model's startup_seconds.
    startup_seconds: float | None = None
    # Policy minedraft: how long a scale-up's replicas are kept once they serve (PolicyConfig.scale_up_hold_seconds;
    # None: scale-ups are not remembered, the policy before issue 45).
    scale_up_hold_seconds: float | None = PolicyConfig.scale_up_hold_seconds
    # Policy minedraft: KV cache and prefill as load (PolicyConfig.prompt_signals); False: output tokens/s alone.
    prompt_signals: bool = True


def initial_replicas(trace: Trace, model: AnyReplicaModel, target_utilization: float) -> int:
    row = trace.rows[0]
    capacity = model.best(model.slots(row.prompt_tokens, row.output_tokens), row.acceptance_rate)[0]
    prefill = row.arrival_rps * row.prompt_tokens * model.prefill_seconds_per_token
    need = math.ceil((row.arrival_rps * row.output_tokens / capacity + prefill) / target_utilization)
    return max(trace.min_replicas, min(trace.max_replicas, need))


def simulate(trace: Trace, model: AnyReplicaModel, config: SimConfig) -> SimResult:
    if config.policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)} (got {config.policy!r})")
    if config.policy == "oracle" and not config.schedule:
        raise ValueError("policy oracle needs a schedule")
    rng = random.Random(config.seed)
    # The replica model's best mode at a (batch, acceptance): pure and asked about the same few batches over and
    # over (requests per replica change by whole cohorts), so remembered across runs of the same model.
    model_key = hash(model)
    if len(_BEST_CACHE) > MAX_BEST_CACHE:
        _BEST_CACHE.clear()

    def best(batch: float, acceptance: float) -> tuple[float, str, int]:
        key = (model_key, batch, acceptance)
        found = _BEST_CACHE.get(key)
        if found is None:
            found = _BEST_CACHE[key] = model.best(batch, acceptance)
        return found

    start = config.initial_replicas or initial_replicas(trace, model, config.target_utilization)
    startup_seconds = config.startup_seconds if config.startup_seconds is not None else model.startup_seconds
    ready_at: list[float] = [0.0] * start  # per replica: when it serves (0: from the start)
    kv_capacity = model.kv_capacity_tokens if model.kv_capacity_tokens is not None else math.inf
    prefill_per_token = model.prefill_seconds_per_token
    # Prefill not yet done, in replica-seconds (the fleet's: the gateway spreads requests over the replicas).
    prefill_backlog = 0.0
    prefill_window: deque[float] = deque(maxlen=RATE_WINDOW_SECONDS)
    ttft_window: deque[tuple[float, float]] = deque(maxlen=RATE_WINDOW_SECONDS)  # (sum of TTFT, requests) per tick
    kv_full_seconds = 0.0
    kv_window: deque[float] = deque(maxlen=RATE_WINDOW_SECONDS)  # the engines' KV usage gauge, per second
    removed_before_ready = soon_after_up = 0
    queue: deque[_Cohort] = deque()
    running: list[_Cohort] = []
    policy_config = PolicyConfig(min_replicas=trace.min_replicas, max_replicas=trace.max_replicas,
                                 target_utilization=config.target_utilization,
                                 interval_seconds=config.interval_seconds,
                                 scale_down_stabilization_seconds=config.scale_down_stabilization_seconds,
                                 max_scale_up_step=config.max_scale_up_step, requests_per_replica=model.max_batch,
                                 max_metrics_age_seconds=3 * config.interval_seconds,
                                 scale_up_hold_seconds=config.scale_up_hold_seconds,
                                 prompt_signals=config.prompt_signals,
                                 prior_capacity_tokens_per_second_per_replica=model.best(model.max_batch,
                                                                                         PRIOR_ACCEPTANCE)[0])
    hpa_config = HpaConfig(target_per_pod=config.hpa_target_per_pod, min_replicas=trace.min_replicas,
                           max_replicas=trace.max_replicas)
    policy_state, hpa_state = PolicyState(), HpaState()
    tokens_window: deque[float] = deque(maxlen=RATE_WINDOW_SECONDS)
    # What the engines' cost model believes the acceptance is: it follows the trace's at the replicas' step rate.
    acceptance_estimate = trace.rows[0].acceptance_rate
    finished_window: deque[float] = deque(maxlen=RATE_WINDOW_SECONDS)
    replica_seconds = violations = total = max_queue = 0.0
    decisions: list[dict[str, Any]] = []
    timeline: dict[str, list[float]] = {k: [] for k in ("t", "arrival_rps", "acceptance", "replicas", "ready",
                                                        "queue", "in_system", "ttft_p_max", "prompt_tokens",
                                                        "kv_usage", "prefill_share", "kv_full")}
    last_direction = 0
    direction_changes = 0
    # Reaction to the trace's event: the first decision after it that asks for more replicas than ran at it.
    first_reaction: float | None = None
    replicas_at_event = trace.max_replicas
    row_index = 0
    # The operator's memory between evaluations: when the last one ran and the queue it saw.
    last_evaluation_seconds, last_waiting = 0.0, 0.0
    last_scale_up_seconds: float | None = None
    last_up_decision: float | None = None  # the last scale-up of any policy (churn is counted from it)
    fast_tick = int(config.operator_tick_seconds) if config.operator_tick_seconds else 0
    duration = int(trace.duration_seconds)
    for tick in range(duration):
        t = float(tick)
        row, row_index = trace.row_at(t, row_index)
        arrivals = _poisson(rng, row.arrival_rps)
        if arrivals:
            queue.append(_Cohort(float(arrivals), t, float(row.output_tokens), float(row.prompt_tokens),
                                 float(row.output_tokens)))
        ready = sum(1 for r in ready_at if r <= t)
        worst_ttft = produced = busy = finished = elapsed = prefilled = ttft_sum = ttft_count = kv_busy = 0.0
        kv_full = False
        # Within the tick, in continuous time: admit FIFO into free slots (a slot of the batch and KV cache for the
        # request's prompt + output), prefill what was admitted (the fleet's replicas do nothing else meanwhile),
        # then decode at the speed of the resulting batch until the first cohort finishes (its slots are refilled at
        # once) or the tick ends. Time to first token = wait + the prefill queued before it and its own + one step
        # at the batch it joins.
        for _ in range(MAX_EVENTS_PER_TICK):
            in_flight = sum(c.count for c in running)
            slots = ready * model.max_batch - in_flight
            kv_free = ready * kv_capacity - sum(c.count * min(c.kv_tokens, kv_capacity) for c in running)
            admitted: list[_Cohort] = []
            while queue and slots > 1e-9:
                head = queue[0]
                # A request longer than a whole KV cache is held to one (else it would wait forever).
                need = min(head.kv_tokens, kv_capacity)
                take = min(head.count, slots, kv_free / need if need > 0 else head.count)
                if take < min(head.count, slots) - 1e-9:
                    kv_full = True  # the KV cache, not the batch, keeps this cohort (or part of it) waiting
                if take <= 1e-9:
                    break
                if take >= head.count - 1e-9:
                    queue.popleft()
                    admitted.append(head)
                else:
                    head.count -= take
                    admitted.append(_Cohort(take, head.arrived, head.remaining_tokens, head.prompt_tokens,
                                            head.output_tokens))
                slots -= take
                kv_free -= take * need
            running.extend(admitted)
            in_flight = sum(c.count for c in running)
            batch = in_flight / ready if ready else 0.0
            tps, mode, k = best(batch, row.acceptance_rate) if batch > 0 else (0.0, "ar", 0)
            speed = tps / batch if batch > 0 else 0.0
            step_seconds = (1.0 / speed) if speed > 0 else 0.0
            for cohort in admitted:
                prefill_backlog += cohort.count * cohort.prompt_tokens * prefill_per_token
                # Its first token: once the prefill queued before it and its own are done (the fleet's replicas share
                # the queue, but one prompt is prefilled on one replica).
                own = cohort.prompt_tokens * prefill_per_token
                ttft = t + elapsed - cohort.arrived + max(prefill_backlog / ready, own) + step_seconds
                worst_ttft = max(worst_ttft, ttft)
                total += cohort.count
                ttft_sum += ttft * cohort.count
                ttft_count += cohort.count
                if ttft > trace.slo_ttft_seconds:
                    violations += cohort.count
            if prefill_backlog > 1e-12 and ready:
                # Prefill first (vLLM schedules the waiting prompts' chunks into every step): decoding pauses.
                dt = min(prefill_backlog / ready, 1.0 - elapsed)
                prefill_backlog = max(0.0, prefill_backlog - dt * ready)
                prefilled += dt * ready
                busy += in_flight * dt
                kv_busy += sum(c.count * c.kv_used_tokens for c in running) * dt
                elapsed += dt
                if elapsed >= 1.0 - 1e-9:
                    break
            if speed <= 0 or not running:
                break
            dt = min(1.0 - elapsed, min(c.remaining_tokens for c in running) / speed)
            for cohort in running:
                done = min(cohort.remaining_tokens, speed * dt)
                cohort.remaining_tokens -= done
                produced += done * cohort.count
            # Requests decoding, integrated over the tick: what a gauge scraped at a random instant sees on average.
            busy += in_flight * dt
            kv_busy += sum(c.count * c.kv_used_tokens for c in running) * dt
            elapsed += dt
            # Steps decoded in dt (each yields L tokens per request): the engine's estimate moves toward the
            # acceptance those steps saw. (In ar nothing is drafted; the engine's probes refresh the estimate.)
            steps = speed * dt / (accepted_length(row.acceptance_rate, k) if mode != "ar" else 1.0)
            weight = ENGINE_ACCEPTANCE_DECAY ** steps
            acceptance_estimate = weight * acceptance_estimate + (1 - weight) * row.acceptance_rate
            finished += sum(c.count for c in running if c.remaining_tokens <= 1e-9)
            running = [c for c in running if c.remaining_tokens > 1e-9]
            if elapsed >= 1.0 - 1e-9:
                break
        batch = busy / ready if ready else 0.0  # requests per ready replica, averaged over the tick
        finished_window.append(finished)
        tokens_window.append(produced)
        prefill_window.append(prefilled)
        ttft_window.append((ttft_sum, ttft_count))
        kv_full_seconds += 1.0 if kv_full else 0.0
        # KV in use, integrated over the tick as the running requests are (busy): the two gauges at the same instants.
        kv_usage = kv_busy / (ready * kv_capacity) if ready and math.isfinite(kv_capacity) else None
        if kv_usage is not None:
            kv_window.append(kv_usage)
        waiting = sum(c.count for c in queue)
        # Requests still queued at the end, and their age, count too.
        max_queue = max(max_queue, waiting)
        replica_seconds += len(ready_at)
        current = len(ready_at)
        if trace.event_seconds is not None and t == float(int(trace.event_seconds)):
            replicas_at_event = current
        desired, reason = current, ""
        if config.policy == "oracle":
            assert config.schedule is not None
            desired, reason = config.schedule[min(tick, len(config.schedule) - 1)], "oracle schedule"
        elif config.policy == "minedraft" and current == 0 and waiting > 0:
            # At zero replicas the gateway's waiting-streams gauge is polled every second, not every interval.
            wake = wake_from_zero(policy_config, current, waiting)
            if wake is not None:
                desired, reason = wake.desired, wake.reason
                last_evaluation_seconds = t
        elif (tick > 0 and tick % int(config.interval_seconds) == 0) if config.policy != "minedraft" else (
                # As the operator: the interval counts from the last evaluation, and at each of its ticks a queue
                # grown since that evaluation triggers one early.
                t - last_evaluation_seconds >= config.interval_seconds
                or (fast_tick > 0 and tick % fast_tick == 0
                    and evaluate_early(policy_config, current, last_waiting, last_evaluation_seconds, waiting, t,
                                       float(fast_tick), last_scale_up_seconds))):
            in_flight = busy
            if config.policy == "minedraft":
                # The engines' gauge: their cost model's tokens/s at the batch they run now, with the acceptance of
                # the last seconds; per running request (as the running gauge counts them) that is their speed.
                recent_acceptance = acceptance_estimate
                best_tps, best_mode, best_k = best(batch, recent_acceptance)
                predicted = best_tps / batch * in_flight if batch > 0 else None
                length = accepted_length(recent_acceptance, best_k) if best_mode != "ar" else 1.0
                ttft_requests = sum(n for _, n in ttft_window)
                obs = Observations(age_seconds=0.0, reporting_replicas=ready, running_requests=in_flight,
                                   waiting_requests=waiting,
                                   output_tokens_per_second=sum(tokens_window) / len(tokens_window),
                                   predicted_tokens_per_second=predicted,
                                   finished_requests_per_second=sum(finished_window) / len(finished_window),
                                   speculation=SpeculationFigures(acceptance_rate=acceptance_rate_metric(
                                       recent_acceptance, best_k) if best_mode != "ar" else None,
                                                                  mean_accepted_length=length,
                                                                  modes=(best_mode,)),
                                   # avg_over_time(...[1m]) of the engines' gauge, as the operator queries it
                                   kv_cache_usage=kv_usage,
                                   kv_cache_usage_1m=sum(kv_window) / len(kv_window) if kv_window else None,
                                   prefill_seconds_per_second=(sum(prefill_window) / len(prefill_window)
                                                               if prefill_per_token > 0 else None),
                                   mean_ttft_seconds=(sum(s for s, _ in ttft_window) / ttft_requests
                                                      if ttft_requests else None))
                decision, policy_state = decide(policy_config, policy_state, current, obs, t)
                last_evaluation_seconds, last_waiting = t, waiting
                if decision.desired > current:
                    last_scale_up_seconds = t
                desired, reason = decision.desired, decision.reason
            else:
                desired, reason, hpa_state = hpa_decide(hpa_config, hpa_state, current, ready,
                                                        in_flight + waiting, t)
        if desired != current:
            direction = 1 if desired > current else -1
            if last_direction and direction != last_direction:
                direction_changes += 1
            last_direction = direction
            decisions.append({"t": t, "from": current, "to": desired, "reason": reason})
            if (first_reaction is None and trace.event_seconds is not None and t >= trace.event_seconds
                    and desired > replicas_at_event):
                first_reaction = t - trace.event_seconds
            if desired > current:
                ready_at += [t + startup_seconds] * (desired - current)
                last_up_decision = t
            else:
                # Starting replicas go first (latest ready time first), then ready ones.
                kept = sorted(ready_at)[: desired]
                removed_before_ready += sum(1 for r in sorted(ready_at)[desired:] if r > t)
                if last_up_decision is not None and t - last_up_decision < CHURN_SECONDS:
                    soon_after_up += 1
                ready_at = kept
        timeline["t"].append(t)
        timeline["arrival_rps"].append(row.arrival_rps)
        timeline["acceptance"].append(row.acceptance_rate)
        timeline["replicas"].append(float(len(ready_at)))
        timeline["ready"].append(float(ready))
        timeline["queue"].append(waiting)
        timeline["in_system"].append(waiting + sum(c.count for c in running))
        timeline["ttft_p_max"].append(worst_ttft)
        timeline["prompt_tokens"].append(float(row.prompt_tokens))
        timeline["kv_usage"].append(kv_usage if kv_usage is not None else 0.0)
        timeline["prefill_share"].append(prefilled / ready if ready else 0.0)
        timeline["kv_full"].append(1.0 if kv_full else 0.0)
    # Requests never admitted by the end of the trace: counted as violations if they already waited too long.
    end = float(duration)
    for cohort in queue:
        total += cohort.count
        if end - cohort.arrived > trace.slo_ttft_seconds:
            violations += cohort.count
    return SimResult(policy=config.policy, trace=trace.name, replica_seconds=replica_seconds,
                     slo_violation_fraction=violations / total if total else 0.0, requests=total,
                     max_queue=max_queue, direction_changes=direction_changes,
                     first_reaction_seconds=first_reaction, decisions=decisions, timeline=timeline,
                     removed_before_ready=removed_before_ready, scale_downs_soon_after_scale_up=soon_after_up,
                     kv_full_seconds=kv_full_seconds, startup_seconds=startup_seconds)


def plot(result: SimResult, path: Path, slo_ttft_seconds: float) -> None:
    """Load, replicas and worst time to first token over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = result.timeline
    minutes = [t / 60 for t in tl["t"]]
    fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    axes[0].plot(minutes, tl["arrival_rps"], label="arrivals (req/s)")
    twin = axes[0].twinx()
    twin.plot(minutes, tl["acceptance"], color="tab:green", alpha=0.6, label="acceptance")
    twin.set_ylim(0, 1)
    twin.set_ylabel("acceptance")
    axes[0].set_ylabel("req/s")
    axes[0].legend(loc="upper left")
    axes[1].step(minutes, tl["replicas"], where="post", label="replicas (incl. starting)")
    axes[1].step(minutes, tl["ready"], where="post", label="ready", alpha=0.7)
    axes[1].set_ylabel("replicas")
    axes[1].legend(loc="upper left")
    axes[2].plot(minutes, tl["ttft_p_max"], label="worst TTFT admitted (s)")
    axes[2].axhline(slo_ttft_seconds, color="red", linestyle="--", label="SLO")
    axes[2].set_ylabel("seconds")
    axes[2].set_xlabel("minutes")
    axes[2].legend(loc="upper left")
    fig.suptitle(f"{result.trace}: {result.policy} — {result.replica_seconds:.0f} replica-s, "
                 f"{100 * result.slo_violation_fraction:.2f}% SLO violations")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _rolling(values: list[float], width: int, how: Any = None) -> list[float]:
    """Trailing mean (or `how`, e.g. max) over `width` seconds: per-second series are too noisy to read."""
    out = []
    for i in range(len(values)):
        window = values[max(0, i - width + 1): i + 1]
        out.append(how(window) if how is not None else sum(window) / len(window))
    return out


def plot_policies(results: list[SimResult], path: Path, slo_ttft_seconds: float) -> None:
    """Several policies on one trace, one figure: the load (arrivals, prompt length), each policy's replicas, KV
    cache in use and prefill share, and worst time to first token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = results[0].timeline
    minutes = [t / 60 for t in first["t"]]
    fig, axes = plt.subplots(4, 1, figsize=(10, 9), sharex=True)
    axes[0].plot(minutes, first["arrival_rps"], label="arrivals (req/s)")
    axes[0].set_ylabel("req/s")
    axes[0].legend(loc="upper left")
    prompts = axes[0].twinx()
    prompts.plot(minutes, first["prompt_tokens"], color="tab:purple", alpha=0.6, label="prompt tokens")
    prompts.set_ylabel("prompt tokens")
    prompts.legend(loc="upper right")
    colors = ("tab:blue", "tab:orange", "tab:green")
    for result, color in zip(results, colors, strict=False):
        tl = [t / 60 for t in result.timeline["t"]]
        label = (f"{result.policy}: {result.replica_seconds:.0f} replica-s, "
                 f"{100 * result.slo_violation_fraction:.2f}% over SLO")
        axes[1].step(tl, result.timeline["replicas"], where="post", color=color, label=label)
        axes[1].step(tl, result.timeline["ready"], where="post", color=color, alpha=0.35, linestyle="--")
        axes[2].plot(tl, _rolling(result.timeline["kv_usage"], 60), color=color,
                     label=f"{result.policy} KV cache in use")
        axes[2].plot(tl, _rolling(result.timeline["prefill_share"], 60), color=color, alpha=0.6, linestyle=":",
                     label=f"{result.policy} prefill share")
        axes[3].plot(tl, _rolling(result.timeline["ttft_p_max"], 30, max), color=color, alpha=0.8,
                     label=result.policy)
    axes[1].set_ylabel("replicas (dashed: ready)")
    axes[1].legend(loc="upper left", fontsize=8)
    axes[2].set_ylabel("share (1-min mean)")
    axes[2].set_ylim(0, 1.05)
    axes[2].legend(loc="upper left", fontsize=7, ncol=2)
    axes[3].axhline(slo_ttft_seconds, color="red", linestyle="--", label="SLO")
    axes[3].set_yscale("symlog", linthresh=1.0)
    axes[3].set_ylim(bottom=0)
    axes[3].set_ylabel("worst TTFT, 30 s (s)")
    axes[3].set_xlabel("minutes")
    axes[3].legend(loc="upper left", fontsize=8)
    fig.suptitle(f"{results[0].trace}, start-up {results[0].startup_seconds:.0f} s")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
