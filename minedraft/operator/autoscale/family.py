"""A seeded family of traffic traces the policies were not tuned on, the oracle over them, and the properties a
policy must keep on every one of them.

Family: trace i of seed s is drawn from its own generator (`random.Random(f"{s}:{i}")`), so a subsample is the same
traces as the full family. Shapes cycle through steady, step, ramp, burst, diurnal (one compressed day), quiet
periods (no arrivals for minutes) and a mix of them; the peak rate is log-uniform over 0.05..100 requests/s, prompt
and output lengths log-uniform over 32..8192 tokens (an output is shortened where the peak would need more than
`MAX_PEAK_REPLICAS` replicas: a family member that no policy can serve compares nothing), acceptance uniform over
0.2..0.9 with collapses (to as low as 0.2, for 2-10 minutes) and recoveries; every rate carries +-10% noise per
row. The replica model prices decoding only: prompt lengths are carried in the traces but cost nothing in the
simulator (the engine benchmarks it is calibrated from measure decode steps).

Oracle: per second, the fewest replicas whose full-batch throughput (the replica model's best mode and k at the
second's acceptance) covers the expected output token rate (the trace's arrival rate times its output length), then
the cheapest schedule covering that requirement with perfect foresight when a replica costs from its decision and
serves `startup_seconds` later: per replica level independently (cost = seconds covered + a startup per start), a
gap shorter than the startup is kept rather than restarted. That schedule is exact (optimal) for the fluid
requirement; the requirement itself is the steady-state one: a lower bound on what any schedule needs to keep queues
from growing in steady state, not a bound for transients shorter than a request's decoding time (a burst that short
could be partly absorbed) and not allowing for Poisson noise (which real headroom is for). The oracle's schedule is
also replayed in the simulator, so its own SLO violations are reported beside its replica-seconds.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from minedraft.operator.autoscale.replica_model import AnyReplicaModel
from minedraft.operator.autoscale.simulate import DEFAULT_SLO_TTFT_SECONDS, SimResult, Trace, TraceRow

SHAPES = ("steady", "step", "ramp", "burst", "diurnal", "quiet", "mixed")
FAMILY_SIZE = 210  # 30 of each shape
MIN_RPS, MAX_RPS = 0.05, 100.0
MIN_TOKENS, MAX_TOKENS = 32, 8192
MIN_ACCEPTANCE, MAX_ACCEPTANCE = 0.2, 0.9
ROW_SECONDS = 10
MAX_PEAK_REPLICAS = 40  # the peak a member asks of the replica model (full-batch capacity), at most
FAMILY_MAX_REPLICAS = 64
NOISE = 0.1
# Capacity a member's peak is sized against: the replica model's full batch at the middle acceptance.
SIZING_ACCEPTANCE = 0.55


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _rate_shape(shape: str, rng: random.Random, duration: float, peak: float) -> list[tuple[float, float]]:
    """(start s, arrivals/s before noise) per ROW_SECONDS row."""
    low = peak * rng.uniform(0.05, 0.5)
    times = [float(t) for t in range(0, int(duration), ROW_SECONDS)]
    if shape == "steady":
        return [(t, peak) for t in times]
    if shape == "step":
        up, down = rng.uniform(0.15, 0.45) * duration, rng.uniform(0.55, 0.9) * duration
        return [(t, peak if up <= t < down else low) for t in times]
    if shape == "ramp":
        top, end = rng.uniform(0.4, 0.7) * duration, duration
        return [(t, low + (peak - low) * (t / top if t <= top else max(0.0, (end - t) / (end - top))))
                for t in times]
    if shape == "burst":
        bursts = [(rng.uniform(0.05, 0.9) * duration, rng.uniform(20, 120)) for _ in range(rng.randint(1, 4))]
        return [(t, peak if any(s <= t < s + d for s, d in bursts) else low) for t in times]
    if shape == "diurnal":
        phase = rng.uniform(0, 2 * math.pi)
        return [(t, low + (peak - low) * 0.5 * (1 + math.cos(2 * math.pi * t / duration + phase))) for t in times]
    if shape == "quiet":
        quiet = [(rng.uniform(0.1, 0.8) * duration, rng.uniform(180, 600)) for _ in range(rng.randint(1, 2))]
        return [(t, 0.0 if any(s <= t < s + d for s, d in quiet) else peak) for t in times]
    if shape == "mixed":
        phase = rng.uniform(0, 2 * math.pi)
        bursts = [(rng.uniform(0.05, 0.9) * duration, rng.uniform(20, 90)) for _ in range(rng.randint(1, 3))]
        quiet_start, quiet_len = rng.uniform(0.2, 0.7) * duration, rng.uniform(120, 400)
        rows = []
        for t in times:
            base = low + (0.6 * peak - low) * 0.5 * (1 + math.cos(2 * math.pi * t / duration + phase))
            if any(s <= t < s + d for s, d in bursts):
                base = peak
            if quiet_start <= t < quiet_start + quiet_len:
                base = 0.0
            rows.append((t, max(base, 0.0)))
        return rows
    raise ValueError(f"shape: expected one of {', '.join(SHAPES)}, got {shape!r}")


def _acceptance(rng: random.Random, duration: float) -> list[tuple[float, float]]:
    """(from s, acceptance): a base level, and with probability 0.6 one or two collapses that recover."""
    base = rng.uniform(MIN_ACCEPTANCE, MAX_ACCEPTANCE)
    points = [(0.0, base)]
    if rng.random() < 0.6:
        for _ in range(rng.randint(1, 2)):
            start, length = rng.uniform(0.1, 0.8) * duration, rng.uniform(120, 600)
            low = rng.uniform(MIN_ACCEPTANCE, max(MIN_ACCEPTANCE, base - 0.2))
            points += [(start, low), (start + length, base)]
    points.sort()
    return points


def make_member(index: int, seed: int, model: AnyReplicaModel) -> Trace:
    rng = random.Random(f"{seed}:{index}")
    shape = SHAPES[index % len(SHAPES)]
    duration = float(rng.choice((900, 1200, 1800, 2400)))
    peak = _log_uniform(rng, MIN_RPS, MAX_RPS)
    prompt = round(_log_uniform(rng, MIN_TOKENS, MAX_TOKENS))
    output = round(_log_uniform(rng, MIN_TOKENS, MAX_TOKENS))
    capacity = model.best(model.max_batch, SIZING_ACCEPTANCE)[0]
    if peak * output > MAX_PEAK_REPLICAS * capacity:
        output = max(MIN_TOKENS, math.floor(MAX_PEAK_REPLICAS * capacity / peak))
    rates = _rate_shape(shape, rng, duration, peak)
    acceptance = _acceptance(rng, duration)
    rows = []
    j = 0
    for t, rps in rates:
        while j + 1 < len(acceptance) and acceptance[j + 1][0] <= t:
            j += 1
        noisy = rps * (1 + rng.uniform(-NOISE, NOISE))
        rows.append(TraceRow(t, round(min(max(noisy, 0.0), MAX_RPS), 4), prompt, output,
                             round(acceptance[j][1], 3)))
    return Trace(name=f"family-{seed}-{index:03d}-{shape}", rows=tuple(rows),
                 slo_ttft_seconds=DEFAULT_SLO_TTFT_SECONDS, min_replicas=1, max_replicas=FAMILY_MAX_REPLICAS,
                 duration_seconds=duration,
                 description=f"{shape}: peak {peak:.3g} req/s, prompt {prompt}, output {output} tokens, "
                             f"acceptance from {acceptance[0][1]:.2f}" + (" with collapses" if len(acceptance) > 1
                                                                         else ""))


def make_family(model: AnyReplicaModel, size: int = FAMILY_SIZE, seed: int = 0,
                indices: Sequence[int] | None = None) -> list[Trace]:
    return [make_member(i, seed, model) for i in (indices if indices is not None else range(size))]


def subsample(size: int, per_shape: int, seed: int = 0) -> list[int]:
    """`per_shape` members of every shape, drawn by a seeded generator (not by looking at any result): member i has
    shape i mod len(SHAPES), so each shape's members are drawn from its own indices. Sorted."""
    rng = random.Random(f"subsample:{seed}")
    chosen: list[int] = []
    for k in range(len(SHAPES)):
        members = list(range(k, size, len(SHAPES)))
        chosen += rng.sample(members, min(per_shape, len(members)))
    return sorted(chosen)


# -- the oracle ------------------------------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def full_capacity(model: AnyReplicaModel, acceptance: float, prompt_tokens: float = 0.0,
                  output_tokens: float = 0.0) -> float:
    """The most output tokens/s one replica gives at this acceptance (best batch, mode and k), at batches its KV
    cache holds at these lengths."""
    slots = int(model.slots(prompt_tokens, output_tokens))
    return max(model.best(c, acceptance)[0] for c in range(1, slots + 1))


def replicas_busy(model: AnyReplicaModel, arrival_rps: float, prompt_tokens: float, output_tokens: float,
                  acceptance: float) -> float:
    """Replicas' worth of time the load takes: decoding its output at full capacity, plus prefilling its prompts."""
    tokens = arrival_rps * output_tokens
    decode = tokens / full_capacity(model, acceptance, prompt_tokens, output_tokens) if tokens > 0 else 0.0
    return decode + arrival_rps * prompt_tokens * model.prefill_seconds_per_token


def requirement(trace: Trace, model: AnyReplicaModel) -> list[int]:
    """Per second: the fewest replicas whose full-batch throughput (at the batch their KV cache holds) covers the
    expected output token rate with the time prefill takes."""
    need: list[int] = []
    index = 0
    for tick in range(int(trace.duration_seconds)):
        row, index = trace.row_at(float(tick), index)
        busy = replicas_busy(model, row.arrival_rps, row.prompt_tokens, row.output_tokens, row.acceptance_rate)
        n = math.ceil(busy - 1e-9) if busy > 0 else 0
        need.append(max(trace.min_replicas, min(trace.max_replicas, n)))
    return need


@dataclass(frozen=True)
class OracleSchedule:
    ready: tuple[int, ...]  # replicas serving, per second
    existing: tuple[int, ...]  # replicas serving or starting (what costs), per second
    replica_seconds: float


def oracle(need: Sequence[int], startup_seconds: float) -> OracleSchedule:
    """The cheapest replica schedule covering `need` when a replica costs from its decision and serves
    `startup_seconds` later; the replicas needed at second 0 are there already (as in the simulator).

    Exact: a schedule's cost splits over levels k (seconds with at least k replicas, plus a startup per start of
    level k), and "covers need" splits the same way, so each level is optimised alone: cover the seconds that need
    it, and bridge a gap between two such runs when the gap is shorter than a startup (cheaper than restarting).
    """
    n = len(need)
    startup = math.ceil(startup_seconds)
    ready = [0] * n
    existing = [0] * n
    cost = 0.0
    for level in range(1, max(need, default=0) + 1):
        runs: list[list[int]] = []  # [start, end) of seconds needing this level
        t = 0
        while t < n:
            if need[t] >= level:
                start = t
                while t < n and need[t] >= level:
                    t += 1
                if runs and start - runs[-1][1] < startup_seconds:
                    runs[-1][1] = t  # bridge the gap
                else:
                    runs.append([start, t])
            else:
                t += 1
        for start, end in runs:
            cost += end - start + (0.0 if start == 0 else startup_seconds)
            for s in range(start, end):
                ready[s] += 1
            for s in range(max(0, start - (0 if start == 0 else startup)), end):
                existing[s] += 1
    return OracleSchedule(tuple(ready), tuple(existing), cost)


# -- properties a policy keeps on every trace --------------------------------------------------------------------


@dataclass(frozen=True)
class PropertyReport:
    """Where a run broke a property (empty lists: none)."""

    out_of_bounds: list[float]  # seconds with replicas outside min..max
    over_oracle: list[tuple[float, float]]  # (start, seconds) of runs above the oracle bound longer than the window
    up_with_spare: list[float]  # scale-up decisions with clearly spare capacity and no queue
    down_while_queue_grows: list[float]  # scale-down decisions while the queue grew over the last interval

    @property
    def ok(self) -> bool:
        return not (self.out_of_bounds or self.over_oracle or self.up_with_spare or self.down_while_queue_grows)

    def to_json(self) -> dict[str, Any]:
        return {"out_of_bounds": len(self.out_of_bounds), "over_oracle": self.over_oracle[:5],
                "up_with_spare": self.up_with_spare[:5], "down_while_queue_grows": self.down_while_queue_grows[:5]}


def check_properties(result: SimResult, trace: Trace, model: AnyReplicaModel, need: Sequence[int], *,
                     target_utilization: float, step: int, interval_seconds: float,
                     stabilization_seconds: float, step_percent: float = 0.0) -> PropertyReport:
    """The policy's run against the properties of issue 19, with these definitions:

    - within bounds: min_replicas <= replicas (starting included) <= max_replicas every second;
    - near the oracle: replicas above B(t) + one step for no run longer than the stabilisation window, where one
      step is the larger of `step` replicas and `step_percent` of B(t) (the policy's scale-up limit at that count:
      one decision's worth), and B(t) is
      the oracle requirement at the policy's target utilisation (ceil(need / u)) at its highest over the seconds a
      decision at t may be answering: from a window plus an interval before t (what a stabilised scale-down still
      remembers) to a startup after t (what a replica asked for now serves);
    - no scale-up with spare capacity and no queue: "spare" is clearly spare, by the truth of the simulator: no
      request waiting, fewer requests in the system than half the replicas' slots (the batch their KV cache holds at
      the trace's lengths), and the expected load over the last interval and the next startup (its output at full
      batch, plus its prompts' prefill) at most half the replicas' time;
    - no scale-down while a queue grows: no scale-down decision when requests wait and more wait than an interval
      before.
    """
    tl = result.timeline
    replicas = tl["replicas"]
    startup = math.ceil(model.startup_seconds)
    window = int(stabilization_seconds + interval_seconds)
    n = len(replicas)
    out_of_bounds = [tl["t"][i] for i in range(n)
                     if not trace.min_replicas <= replicas[i] <= trace.max_replicas]
    bound = [math.ceil(x / target_utilization - 1e-9) for x in need]
    over: list[tuple[float, float]] = []
    run_start: int | None = None
    for i in range(n + 1):
        if i < n:
            b = max(bound[max(0, i - window): min(n, i + startup + 1)])
            above = replicas[i] > b + max(step, math.floor(b * step_percent / 100))
        else:
            above = False
        if above and run_start is None:
            run_start = i
        elif not above and run_start is not None:
            if i - run_start > stabilization_seconds:
                over.append((float(run_start), float(i - run_start)))
            run_start = None
    index = 0
    busy: list[float] = []  # replicas' worth of time the expected load takes (decoding and prefill)
    slots: list[float] = []
    for tick in range(n):
        row, index = trace.row_at(float(tick), index)
        busy.append(replicas_busy(model, row.arrival_rps, row.prompt_tokens, row.output_tokens, row.acceptance_rate))
        slots.append(model.slots(row.prompt_tokens, row.output_tokens))
    up_with_spare: list[float] = []
    down_while_queue_grows: list[float] = []
    lag = int(interval_seconds)
    for d in result.decisions:
        i = int(d["t"])
        queue, before = tl["queue"][i], tl["queue"][max(0, i - lag)]
        if d["to"] > d["from"]:
            lo, hi = max(0, i - lag), min(n, i + startup + 1)
            spare = (queue <= 0 and tl["in_system"][i] < 0.5 * d["from"] * min(slots[lo:hi])
                     and max(busy[lo:hi]) <= 0.5 * d["from"])
            if spare:
                up_with_spare.append(d["t"])
        elif d["to"] < d["from"] and queue > 0 and queue > before:
            down_while_queue_grows.append(d["t"])
    return PropertyReport(out_of_bounds, over, up_with_spare, down_while_queue_grows)
