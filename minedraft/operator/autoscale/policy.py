"""The speculation-aware scaling policy: pure, over plain dataclasses (no clocks, no I/O).

Capacity of one replica is measured, not configured: the tokens/s one request gets on it now (per-request speed,
from the engine's own predicted goodput, or from acceptance, accepted length and draft/verify/overlap seconds when
that gauge is absent) times the requests a replica can hold. Speculation enters through that speed: when
acceptance falls, each verification yields fewer tokens, the speed and so the capacity fall on the next
observation, and the policy adds replicas before the queue has had time to grow (a queue-length policy has to
wait for requests to pile up).

Demand is the output token rate the arrivals need (finished requests/s plus the growth of running + waiting, times
tokens per request) plus draining within `backlog_drain_seconds` the queue as it will be when new capacity serves
(`projected_backlog`); while arrivals have been rising, the rate they will have reached when a replica asked for now
serves (`forecast_arrivals`). Without a finished-request rate, the rate every request in the system (running +
waiting) would take at the running ones' speed.

    desired = ceil(demand / (target utilisation x capacity per replica))

where a replica's capacity is the most tokens/s it can give: its slots full, at the speed a request has in a full
batch (`full_batch_capacity`). Requests slow down as batches grow, with a shape learned from (batch, speed)
observations (`batch_slowdown`), so capacity is not judged at the speed of today's lighter batches, and the target
utilisation is a share of what a replica can actually produce: the rest is headroom for arrival noise and for
growth while new replicas start. (A share of the *slots* instead is not: where a replica's throughput saturates
before its slots are full, as when decoding is compute-bound, 80% of the slots can be 95% of its throughput.)

A sudden rise shows in the requests in the system before it shows in the rates (averaged over the interval and a
minute): when that count exceeds the target utilisation of the replicas' slots, is rising and no replica is
starting, the replicas are sized for those requests at the batch each is planned to run (`surge_replicas`).

A replica's capacity is a property of the replica: when nothing decodes at an evaluation (idle between requests,
normal at a light load) it is the last speed measured, or before any, the configured prior from the replica model;
never 0 because the replicas happen to be idle. Unknown (no measurement, no prior): no scale-up on it.

Demand has a sustained part (the arrivals' token rate: what the load needs while it lasts) and a transient one
(draining a queue, a surge's backlog). Scale-up: at once, to what the sustained part needs, and beyond it by at most
the larger of ``max_scale_up_step`` replicas and ``max_scale_up_percent`` of the current count per decision (the
Kubernetes HPA's default: 4 pods or 100%). Scale-down: to the highest sustained need of the stabilisation window
(the window remembers the load, not a queue already drained) or what the figures need now if more, in one step, at
most once per window (so a dip does not remove replicas a rebound needs), never while requests wait, and not while
the requests in the system visibly rise (the rates lag a rise). Replicas still
starting count as capacity (current = spec.replicas, not ready replicas), so a slow model load does not trigger a
cascade of scale-ups. Missing or stale metrics: no decision, ``metrics_available``
False with why.

No churn: every scale-up (a surge's included) is remembered with its count, and the scale-down does not go below it
until all its replicas report, no request waits, and ``scale_up_hold_seconds`` has passed since (`settle_scale_ups`):
a replica asked for is not removed before it has served.

Prompts are load too. The KV cache: the share of one replica's cache a running request holds (the engines' KV usage
x replicas / running, a minute's mean) gives the requests a replica holds (`kv_slots`), fewer than --max-num-seqs
where prompts are long; capacity, the planned batch and the surge rule are judged at that batch, and the caches in
use are sized for the target utilisation (grown along a rising share per request, as prompts grow, to when new
replicas serve). Prefill: the replicas' seconds per second spent prefilling are time they do not decode, added to
decoding's replicas. Which signal set the recommendation (SIGNALS) is recorded with the decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

# Within this relative band around the current count, no change (as the Kubernetes HPA's tolerance): keeps small
# fluctuations of measured capacity (the engines' own mode/k switching, acceptance noise) from moving replicas.
DEFAULT_TOLERANCE = 0.1
PRIOR_BATCH_SLOWDOWN = 1 / 16
# Distinct batch sizes remembered for the slowdown fit (the newest sample of each).
MAX_SPEED_SAMPLES = 64
# Arrival rates over this long give the trend (20 evaluations at 15 s: enough to average Poisson noise, short enough
# to follow a daily curve; the HPA's scale-down window).
TREND_WINDOW_SECONDS = 300.0
# A rising arrival trend is extrapolated only when its slope is this many standard errors above 0.
TREND_T = 3.0
# No scale-up while no request waits and the requests in the system fill less than this share of the replicas'
# slots: the replicas have clearly spare capacity, and a demand estimate above it is noise (a few long requests
# arriving together at a light load) rather than load.
SPARE_OCCUPANCY = 0.5
# How long a new replica takes to serve (pod start + model load) until the policy has measured it.
PRIOR_STARTUP_SECONDS = 60.0
# The signals a recommendation can come from (the `signal` of Inputs; the operator's signal gauge has one series each).
SIGNALS = ("tokens", "prefill", "kv", "surge", "queue")
# A surge is a rise of the requests in the system by more than this many standard deviations of a Poisson count.
SURGE_NOISE = 2.0
# The scale-down window is at least this many measured start-ups (stabilization_seconds).
STARTUP_WINDOWS = 3.0
# The KV share per request is the mean of this long's samples.
KV_SHARE_SECONDS = 60.0
# Below this KV usage the per-request share is too noisy to size from (a few short requests on an idle replica).
MIN_KV_USAGE = 0.02
# Tokens per request are also averaged over about this long (output tokens and finished requests, both decayed with
# this time constant), and the lower of that and the last minute's ratio is used: while load rises, a minute's
# output tokens include requests still decoding whose completions it has not seen yet, which reads as several times
# the real tokens per request where requests are long and few (after a quiet period, at a low rate of long
# requests); the longer average has the completions of before the rise.
TOKENS_PER_REQUEST_SECONDS = 600.0
MIN_FINISHED_FOR_MEAN = 20.0


@dataclass(frozen=True)
class PolicyConfig:
    min_replicas: int = 1
    max_replicas: int = 4
    target_utilization: float = 0.8
    interval_seconds: float = 15.0
    scale_down_stabilization_seconds: float = 300.0
    max_scale_up_step: int = 2
    # A decision may also add this share of the current replicas, if that is more (the HPA's default: 100%), so a
    # doubling of load on many replicas is not met a few pods at a time.
    max_scale_up_percent: float = 100.0
    # Requests one replica can hold decoding at once (the engine's --max-num-seqs).
    requests_per_replica: int = 256
    # Observations older than this are stale (three missed intervals by default, set by from_spec).
    max_metrics_age_seconds: float = 45.0
    tolerance: float = DEFAULT_TOLERANCE
    # A queue is planned to drain within about this long, on top of serving the arrivals: much shorter asks for
    # replicas that arrive (a model load later) after the queue is gone, and a backlog built while replicas were
    # starting would cascade into more; much longer leaves requests waiting well past a TTFT SLO.
    backlog_drain_seconds: float = 30.0
    # How a request's seconds per token grow with the batch (see batch_slowdown); None: learned from observations.
    batch_slowdown: float | None = None
    # Output tokens/s one replica gives at its full batch, before any speed was measured (after an operator restart
    # while idle, or at zero replicas): the replica model's figure for the deployment. None: unknown until the
    # engines have decoded something.
    prior_capacity_tokens_per_second_per_replica: float | None = None
    # A scale-up's replicas stay at least this long after they all serve with no request waiting (and at least this
    # long after the scale-up): removing them sooner is churn (a GPU pod started, loaded 65 GB, and went unused).
    # None: scale-ups are not remembered (only the window's sustained recommendations are: the policy before).
    scale_up_hold_seconds: float | None = 120.0
    # Whether prompts count as load (KV cache usage and prefill time); False: output tokens/s alone, as before
    # issue 45 (the simulator's comparison of what the prompt signals add).
    prompt_signals: bool = True


@dataclass(frozen=True)
class SpeculationFigures:
    """Deployment-wide means of what the engines measure (None when not exported)."""

    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None  # tokens per request per verification (1 + accepted drafts)
    draft_seconds_per_step: float | None = None
    verify_seconds_per_step: float | None = None
    overlap_fraction: float | None = None  # share of drafting hidden behind verification (1 = all hidden)
    modes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Observations:
    """One look at the engines; totals are over the replicas that reported."""

    age_seconds: float  # age of the newest sample behind these figures
    reporting_replicas: int
    running_requests: float
    waiting_requests: float
    output_tokens_per_second: float
    # The engines' cost-model prediction at their current load, summed over replicas (None: gauge not exported).
    predicted_tokens_per_second: float | None = None
    # Requests finished per second over the last minute (None: not known; demand then counts the whole queue).
    finished_requests_per_second: float | None = None
    speculation: SpeculationFigures = field(default_factory=SpeculationFigures)
    # Mean share of the reporting replicas' KV cache in use now, 0-1 (None: not exported); over the running requests
    # it gives the share one request holds.
    kv_cache_usage: float | None = None
    # The same over the last minute (avg_over_time): the KV load, without the noise of one instant.
    kv_cache_usage_1m: float | None = None
    # Seconds per second the replicas spent prefilling prompts, summed over them (None: not exported).
    prefill_seconds_per_second: float | None = None
    # Mean time to first token over the last minute (None: no first token in it, or not exported).
    mean_ttft_seconds: float | None = None


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between decisions: recent recommendations and the last scale-down."""

    recommendations: tuple[tuple[float, int], ...] = ()  # (time s, replicas) within the stabilisation window
    last_scale_down_seconds: float | None = None
    # When the policy first saw metrics: no scale-down until a whole window has been observed (also after a restart).
    first_observed_seconds: float | None = None
    # (requests per replica, seconds per token of one request), the newest per batch size: how decoding slows as
    # batches grow.
    speed_samples: tuple[tuple[float, float], ...] = ()
    # (time s, running + waiting) at the last evaluation with metrics: how fast requests pile up.
    last_in_system: tuple[float, float] | None = None
    # (time s, arrivals per second) over the last TREND_WINDOW_SECONDS: whether arrivals are rising, and how fast.
    arrival_samples: tuple[tuple[float, float], ...] = ()
    # (time s, replicas asked for) of a scale-up whose replicas do not all report yet.
    pending_scale_up: tuple[float, int] | None = None
    # Seconds from a scale-up to its replicas reporting, as last measured (None: not yet; PRIOR_STARTUP_SECONDS).
    startup_seconds: float | None = None
    # (output tokens, finished requests, time s): both decayed over TOKENS_PER_REQUEST_SECONDS, as of that time.
    token_sums: tuple[float, float, float] | None = None
    # (time s, share of one replica's KV cache a running request holds) over TREND_WINDOW_SECONDS: how KV per request
    # moves (prompts growing), and the last measured when nothing runs.
    kv_samples: tuple[tuple[float, float], ...] = ()
    # Scale-ups the scale-down keeps: (time s, replicas asked for, time s from which they all served with no request
    # waiting, None until then). Each holds its count for scale_up_hold_seconds after that.
    scale_ups: tuple[tuple[float, int, float | None], ...] = ()


@dataclass(frozen=True)
class Inputs:
    """The figures a decision used, recorded with it (status.scaling, the simulator's JSON)."""

    demand_tokens_per_second: float
    capacity_tokens_per_second_per_replica: float
    per_request_tokens_per_second: float
    capacity_source: str  # "predicted" (engine's cost model) or "speculation" (acceptance and step seconds)
    running_requests: float
    waiting_requests: float
    recommended: int
    # Which signal set the recommendation (SIGNALS): output tokens/s, prefill time, KV cache, a surge of requests,
    # or a queue's drain.
    signal: str = "tokens"
    # Requests one replica can hold: --max-num-seqs, or fewer where the KV cache holds fewer at today's lengths.
    slots_per_replica: float = 0.0
    kv_cache_usage: float | None = None
    prefill_share: float | None = None  # of a replica's time, per replica
    kv_replicas: float = 0.0  # replicas the KV cache needs (0: not known)
    prefill_replicas: float = 0.0  # replicas' time prefill needs at the target utilisation


@dataclass(frozen=True)
class Decision:
    current: int
    desired: int  # equal to current when nothing changes
    reason: str
    metrics_available: bool
    inputs: Inputs | None = None

    @property
    def changed(self) -> bool:
        return self.desired != self.current


def per_request_speed(obs: Observations) -> tuple[float, str] | None:
    """Output tokens/s one running request gets now, and where the figure came from; None if unknown.

    The engines' predicted goodput already reflects their mode and k choice and current acceptance; without it,
    the speed follows from speculation figures: tokens per verification over seconds per step, where drafting
    costs only its part not hidden behind verification.
    """
    running = obs.running_requests
    if obs.predicted_tokens_per_second is not None and obs.predicted_tokens_per_second > 0 and running > 0:
        return obs.predicted_tokens_per_second / running, "predicted"
    sp = obs.speculation
    if sp.verify_seconds_per_step is None or sp.verify_seconds_per_step <= 0:
        return None
    length = sp.mean_accepted_length if sp.mean_accepted_length is not None else 1.0
    hidden = sp.overlap_fraction if sp.overlap_fraction is not None else 0.0
    step = sp.verify_seconds_per_step + (1.0 - hidden) * (sp.draft_seconds_per_step or 0.0)
    return length / step, "speculation"


def batch_slowdown(samples: tuple[tuple[float, float], ...]) -> float:
    """Relative growth of a request's seconds per token per extra request in the batch: s(c) ∝ 1 + g c.

    Fitted by least squares to recent samples when they span a wide enough range of batch sizes; before that, the
    prior g = 1 / 16 (half the cost fixed at a batch of 16): decoding neither free in the batch (memory-bound GPUs
    are nearly so) nor linear in it (a small model on CPUs nearly is). The curve is rescaled to pass through the
    current speed, so acceptance and mode changes move it at once; only its shape comes from history.
    """
    if len(samples) >= 3:
        lo = min(c for c, _ in samples)
        hi = max(c for c, _ in samples)
        if hi >= 1.5 * lo:
            n = len(samples)
            mx = sum(c for c, _ in samples) / n
            my = sum(y for _, y in samples) / n
            sxx = sum((c - mx) ** 2 for c, _ in samples)
            slope = sum((c - mx) * (y - my) for c, y in samples) / sxx
            intercept = my - slope * mx
            if intercept > 0 and slope >= 0:
                return min(slope / intercept, 1.0)
            if intercept <= 0 < slope:
                return 1.0  # fully batch-bound (cost proportional to the batch): the steepest we assume
            return 0.0
    return PRIOR_BATCH_SLOWDOWN


def full_batch_capacity(per_request: float, batch: float, shape: float, slots: int) -> float:
    """Tokens/s one replica gives with all `slots` decoding: the speed now rescaled along s(c) ∝ 1 + g c.

    s(slots) = s_now (1 + g slots) / (1 + g c_now), so capacity = slots / s(slots). With g = 0 (decoding free in the
    batch) that is slots x today's speed; the steeper the slowdown, the less a full batch adds.
    """
    return slots * per_request * (1 + shape * batch) / (1 + shape * slots)


def forecast_arrivals(samples: tuple[tuple[float, float], ...], now_seconds: float, lead_seconds: float
                      ) -> float | None:
    """Arrivals per second `lead_seconds` from now on the least-squares line through `samples`; None unless rising.

    A replica asked for now serves a startup (and up to an interval) later: on a ramp, sized for today's arrivals,
    it arrives already short. Only a rising trend is extrapolated: a falling one is left to the stabilised
    scale-down (too few replicas violates the SLO, too many costs a little while).
    """
    if len(samples) < 4:
        return None
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_a = sum(a for _, a in samples) / n
    sxx = sum((t - mean_t) ** 2 for t, _ in samples)
    if sxx <= 0:
        return None
    slope = sum((t - mean_t) * (a - mean_a) for t, a in samples) / sxx
    if slope <= 0:
        return None
    # Only a trend the samples show beyond their noise (slope over its standard error above TREND_T): arrival
    # estimates over one interval are Poisson-noisy, and extrapolating noise a startup ahead asks for replicas no
    # load needs.
    intercept = mean_a - slope * mean_t
    residual = sum((a - intercept - slope * t) ** 2 for t, a in samples) / (n - 2)
    if residual > 0 and slope <= TREND_T * math.sqrt(residual / sxx):
        return None
    return mean_a + slope * (now_seconds + lead_seconds - mean_t)


def arrival_rate(state: PolicyState, obs: Observations, now_seconds: float) -> float | None:
    """Requests arriving per second: finished + growth of the requests in the system since the last evaluation."""
    finished = obs.finished_requests_per_second
    last = state.last_in_system
    if finished is None or last is None or now_seconds <= last[0]:
        return None
    in_system = obs.running_requests + obs.waiting_requests
    # A fall is not counted: while a queue drains, the interval's fall of the requests in the system is set against
    # a minute's average of finished requests (the windows differ), which reads as arrivals near 0 in the middle of
    # a load; the finished rate alone then stands for the arrivals (it lags a real fall by a minute, on the safe side).
    growth = max((in_system - last[1]) / (now_seconds - last[0]), 0.0)
    return finished + growth


def remembered_speed(config: PolicyConfig, state: PolicyState) -> tuple[float, str] | None:
    """A request's tokens/s when nothing decodes now: the newest measured (speed_samples), else the prior."""
    if state.speed_samples:
        seconds_per_token = state.speed_samples[-1][1]
        if seconds_per_token > 0:
            return 1.0 / seconds_per_token, "last measured"
    prior = config.prior_capacity_tokens_per_second_per_replica
    if prior is not None and prior > 0:
        return prior / config.requests_per_replica, "prior"
    return None


def updated_token_sums(state: PolicyState, obs: Observations, now_seconds: float) -> tuple[float, float, float] | None:
    """`state.token_sums` decayed to now, plus this observation's rates over the time since the last (None while no
    finished-request rate is known)."""
    finished = obs.finished_requests_per_second
    if finished is None:
        return state.token_sums
    if state.token_sums is None:
        return (0.0, 0.0, now_seconds)
    tokens, count, last = state.token_sums
    elapsed = max(now_seconds - last, 0.0)
    keep = math.exp(-elapsed / TOKENS_PER_REQUEST_SECONDS)
    return (tokens * keep + obs.output_tokens_per_second * elapsed, count * keep + finished * elapsed, now_seconds)


def mean_tokens_per_request(state: PolicyState) -> float | None:
    """Output tokens per finished request over about TOKENS_PER_REQUEST_SECONDS (`state.token_sums`); None before
    a few requests have finished in it (then it would be as noisy as a minute's ratio)."""
    if state.token_sums is None or state.token_sums[1] < MIN_FINISHED_FOR_MEAN or state.token_sums[0] <= 0:
        return None
    return state.token_sums[0] / state.token_sums[1]


def lead_seconds(config: PolicyConfig, state: PolicyState) -> float:
    """From a decision to its replicas serving: the measured startup (or the prior) plus up to an interval."""
    startup = state.startup_seconds if state.startup_seconds is not None else PRIOR_STARTUP_SECONDS
    return startup + config.interval_seconds


def queue_growth_seconds(state: PolicyState, now_seconds: float) -> float:
    """How much longer a growing queue keeps growing: until the replicas already asked for serve, or, with none
    starting, a startup from now (until replicas asked for now serve)."""
    startup = state.startup_seconds if state.startup_seconds is not None else PRIOR_STARTUP_SECONDS
    if state.pending_scale_up is not None:
        return max(0.0, state.pending_scale_up[0] + startup - now_seconds)
    return startup


def projected_backlog(state: PolicyState, obs: Observations, now_seconds: float) -> float:
    """Requests waiting when new capacity serves: the queue now plus its growth (requests in the system per second
    since the last evaluation) over `queue_growth_seconds`.

    Sizing for today's queue alone leaves the replicas that arrive a startup later short by everything that piled
    up meanwhile, and requests keep waiting past the SLO until a second round of replicas has loaded. Counted only
    while requests wait (growth into free slots is no backlog) and grow.
    """
    last = state.last_in_system
    if obs.waiting_requests <= 0 or last is None or now_seconds <= last[0]:
        return max(obs.waiting_requests, 0.0)
    growth = (obs.running_requests + obs.waiting_requests - last[1]) / (now_seconds - last[0])
    return obs.waiting_requests + max(growth, 0.0) * queue_growth_seconds(state, now_seconds)


def estimate_demand(config: PolicyConfig, state: PolicyState, obs: Observations, per_request: float,
                    now_seconds: float) -> tuple[float, str]:
    """Output tokens/s needed (the arrivals' rate and draining the queue, see `demand_parts`), and its basis."""
    sustained, backlog, basis = demand_parts(config, state, obs, per_request, now_seconds)
    return sustained + backlog, basis


def demand_parts(config: PolicyConfig, state: PolicyState, obs: Observations, per_request: float,
                 now_seconds: float) -> tuple[float, float, str]:
    """Output tokens/s needed, in two parts: the arrivals' token rate (sustained: what the load needs for as long as
    it lasts) and draining the queue (transient: gone once the queue is); and which estimate was used.

    With the finished-request rate known, arrivals = finished + growth of the requests in the system since the last
    evaluation (or, while they have been rising over TREND_WINDOW_SECONDS, the rate forecast for when a replica
    asked for now would serve, if higher), tokens per request = output tokens/s / finished per second, and the
    queue adds waiting x tokens per request / backlog_drain_seconds. Without it: every request in the system at
    today's speed, or the measured rate scaled by the queue, the larger (this counts a whole backlog as demand, so
    it overreacts to one).
    """
    in_system = obs.running_requests + obs.waiting_requests
    finished = obs.finished_requests_per_second
    arrivals = arrival_rate(state, obs, now_seconds)
    if arrivals is not None and finished is not None and finished > 0 and obs.output_tokens_per_second > 0:
        tokens_per_request = obs.output_tokens_per_second / finished
        longer = mean_tokens_per_request(state)
        if longer is not None:
            tokens_per_request = min(tokens_per_request, longer)
        basis = "arrivals"
        recent = (*((t, a) for t, a in state.arrival_samples if t > now_seconds - TREND_WINDOW_SECONDS),
                  (now_seconds, arrivals))
        forecast = forecast_arrivals(recent, now_seconds, lead_seconds(config, state))
        if forecast is not None and forecast > arrivals:
            arrivals, basis = forecast, "arrivals rising"
        backlog = projected_backlog(state, obs, now_seconds) * tokens_per_request / config.backlog_drain_seconds
        return arrivals * tokens_per_request, backlog, basis
    demand = per_request * in_system
    if obs.running_requests >= 1:
        demand = max(demand, obs.output_tokens_per_second * in_system / obs.running_requests)
    return demand, 0.0, "in system"


def planned_batch(config: PolicyConfig, shape: float) -> float:
    """Requests per replica at which it gives the target utilisation of its full-batch throughput.

    Throughput at batch c is c / s(c) with s(c) ∝ 1 + g c; solving c / (1 + g c) = u C / (1 + g C) for c gives
    u C / (1 + g C (1 - u)): u C (the target share of the slots) where decoding is free in the batch, fewer where
    a full batch adds little throughput.
    """
    u, slots = config.target_utilization, config.requests_per_replica
    return u * slots / (1 + shape * slots * (1 - u))


def surge_replicas(config: PolicyConfig, state: PolicyState, obs: Observations, current: int,
                   shape: float = 0.0) -> float:
    """Replicas the requests in the system need now, if they are surging; else 0.

    Rates are averages (the arrivals over the interval, finished requests over a minute): in the first interval of
    a step or burst they have barely moved, while the requests in the system have. A surge: more requests in the
    system than the target utilisation of every replica's slots (above what steady load at the planned batch puts
    there, which is at most that share), rising since the last evaluation, with no replica starting — while
    replicas start, the queue they will take is expected to grow (counting it again would cascade), and a count
    falling as a queue drains into new replicas is no surge. Its replicas: each of those requests at the planned
    batch (`planned_batch`), as the HPA sizes on requests per pod, but with a target derived from capacity.
    """
    last = state.last_in_system
    in_system = obs.running_requests + obs.waiting_requests
    if last is None or in_system <= last[1] or obs.reporting_replicas < current:
        return 0.0
    if in_system <= config.target_utilization * config.requests_per_replica * current:
        return 0.0
    # A rise within the Poisson noise of the count is no surge, nor one the replicas take without a queue: where the
    # KV cache holds a few long requests per replica, the count crosses the target share of slots by chance at every
    # other evaluation, and a prefill stall bunches them up for a moment.
    if in_system <= last[1] + SURGE_NOISE * math.sqrt(max(last[1], 1.0)) or obs.waiting_requests < 1:
        return 0.0
    return in_system / planned_batch(config, shape)


def _clamp(value: int, config: PolicyConfig) -> int:
    return max(config.min_replicas, min(config.max_replicas, value))


def _no_decision(current: int, reason: str) -> Decision:
    return Decision(current=current, desired=current, reason=reason, metrics_available=False)


def wake_from_zero(config: PolicyConfig, current: int, streams_waiting: float | None) -> Decision | None:
    """At zero replicas: one replica (or the minimum, if higher) at once when a stream waits at the gateway; else
    None (nothing to do). Meant to be polled more often than the interval: the waiting stream's time to first token
    is this poll's delay plus a replica's startup, so the interval is not added to it. Sizing beyond one replica
    is left to the regular evaluations once that replica reports.
    """
    if current != 0 or streams_waiting is None or streams_waiting <= 0 or config.max_replicas < 1:
        return None
    desired = max(1, config.min_replicas)
    return Decision(current, desired, f"scale up from zero: {streams_waiting:.0f} streams waiting at the gateway "
                                      "for an engine", True)


def evaluate_early(config: PolicyConfig, current: int, last_waiting: float | None,
                   last_evaluation_seconds: float | None, waiting_now: float | None, now_seconds: float,
                   min_gap_seconds: float, last_scale_up_seconds: float | None = None) -> bool:
    """Whether to evaluate now, before the interval: the engines' waiting requests grew since the last evaluation.

    A queue that grows between evaluations is a load the last evaluation did not see; waiting out the interval adds
    up to an interval to every queued request's wait (and a replica's startup comes after it). Only the trigger
    lives here: `decide` still sizes any change, with all its rules (step limits, spare capacity, tolerance), so an
    early evaluation can ask for no more than a regular one would on the same figures. Rate-limited to one per
    `min_gap_seconds` (the operator's tick); no trigger before a first evaluation, on an empty or shrinking queue,
    or at the maximum (nothing to add); and none within an interval of the last scale-up: the scale-up step is a
    limit per interval, which evaluations every tick would multiply (the queue keeps growing while the replicas
    just asked for start, and each tick would add another step).
    """
    if waiting_now is None or waiting_now <= 0 or last_waiting is None or last_evaluation_seconds is None:
        return False
    if current <= 0 or current >= config.max_replicas:
        return False  # at zero the gateway's gauge wakes the replicas (wake_from_zero); at the maximum nothing to add
    # The same slack as the interval's: a tick landing just short of the gap should not wait a whole extra tick.
    if now_seconds - last_evaluation_seconds < min_gap_seconds - 0.25:
        return False
    if last_scale_up_seconds is not None and now_seconds - last_scale_up_seconds < config.interval_seconds - 0.25:
        return False
    return waiting_now > last_waiting


def kv_share_per_request(obs: Observations) -> float | None:
    """Share of one replica's KV cache a running request holds now (usage x replicas / running); None if unknown."""
    usage = obs.kv_cache_usage
    if usage is None or usage < MIN_KV_USAGE or obs.running_requests < 1 or obs.reporting_replicas < 1:
        return None
    return usage * obs.reporting_replicas / obs.running_requests


def kv_share_ahead(config: PolicyConfig, state: PolicyState, now_seconds: float) -> float | None:
    """KV share per request when replicas asked for now serve: the last measured, or along its trend if it rises
    beyond its noise (prompts growing: the batch the KV cache holds shrinks while the arrivals stay)."""
    samples = tuple((t, v) for t, v in state.kv_samples if t > now_seconds - TREND_WINDOW_SECONDS)
    if not state.kv_samples:
        return None
    recent = [v for t, v in samples if t > now_seconds - KV_SHARE_SECONDS] or [state.kv_samples[-1][1]]
    last = sum(recent) / len(recent)
    forecast = forecast_arrivals(samples, now_seconds, lead_seconds(config, state))
    return max(last, forecast) if forecast is not None else last


def kv_slots(config: PolicyConfig, share: float | None) -> float:
    """Requests one replica holds: --max-num-seqs, or as many as its KV cache holds at `share` each if fewer."""
    if share is None or share <= 0:
        return float(config.requests_per_replica)
    return max(1.0, min(float(config.requests_per_replica), math.floor(1.0 / share)))


def stabilization_seconds(config: PolicyConfig, state: PolicyState) -> float:
    """The scale-down window: the configured one, or STARTUP_WINDOWS measured start-ups if longer.

    A replica removed and needed again costs a start-up during which the load waits for it: where start-ups are long
    (a GPU pod loading tens of GB), a dip must last longer before a scale-down pays. The HPA's 300 s is five start-ups
    of a minute; at 180 s it is fewer than two."""
    window = config.scale_down_stabilization_seconds
    if state.startup_seconds is not None:
        window = max(window, STARTUP_WINDOWS * state.startup_seconds)
    return window


def settle_scale_ups(config: PolicyConfig, scale_ups: tuple[tuple[float, int, float | None], ...], current: int,
                     obs: Observations, now_seconds: float) -> tuple[tuple[float, int, float | None], ...]:
    """Mark the scale-ups whose replicas all serve with no request waiting, and forget those held long enough."""
    kept = []
    for at, replicas, settled in scale_ups:
        if settled is None and obs.reporting_replicas >= min(replicas, current) and obs.waiting_requests < 1:
            settled = now_seconds
        hold = config.scale_up_hold_seconds or 0.0
        if settled is not None and now_seconds >= max(settled, at) + hold:
            continue
        kept.append((at, replicas, settled))
    return tuple(kept)


def decide(config: PolicyConfig, state: PolicyState, current: int, obs: Observations | None,
           now_seconds: float) -> tuple[Decision, PolicyState]:
    """The replica count to run next, why, and the state to pass to the next call.

    `current` is spec.replicas: replicas still starting are included, so they count as capacity.
    """
    if current < config.min_replicas or current > config.max_replicas:
        # Out of bounds (bounds edited, or someone scaled by hand): back within them regardless of metrics.
        target = _clamp(current, config)
        return (Decision(current, target, f"outside bounds {config.min_replicas}..{config.max_replicas}",
                         obs is not None), state)
    if obs is None:
        return _no_decision(current, "no engine metrics found"), state
    if obs.age_seconds > config.max_metrics_age_seconds:
        return _no_decision(current, f"engine metrics are {obs.age_seconds:.0f}s old "
                                     f"(more than {config.max_metrics_age_seconds:.0f}s)"), state
    if obs.reporting_replicas == 0:
        return _no_decision(current, "no engine replica reports metrics yet"), state
    speed = per_request_speed(obs)
    measured = speed is not None and speed[0] > 0 and obs.running_requests > 0
    if not measured:
        # Nothing decoding now (idle between requests, normal at light load) or no figure: a replica's capacity is
        # a property of the replica, not of this instant's load, so it comes from the last speed measured (or the
        # configured prior), never 0 because the replicas happen to be idle.
        remembered = remembered_speed(config, state)
        if remembered is not None:
            speed = remembered
        elif speed is None and obs.running_requests + obs.waiting_requests > 0:
            return _no_decision(current, "no capacity figure: neither predicted goodput nor step seconds"), state
    if speed is None or speed[0] <= 0:
        # Never measured and no prior: the count stays (no scale-up on a capacity that is not known; the demand
        # of an idle system is 0 so the stabilised scale-down may still act).
        speed = (0.0, "unknown")
    per_request, source = speed
    in_system = obs.running_requests + obs.waiting_requests
    # A startup measured: the replicas of the last scale-up all report (the trend's lead time follows it).
    startup, pending = state.startup_seconds, state.pending_scale_up
    if pending is not None and obs.reporting_replicas >= pending[1]:
        startup, pending = now_seconds - pending[0], None
    if not config.prompt_signals:
        obs = replace(obs, kv_cache_usage=None, kv_cache_usage_1m=None, prefill_seconds_per_second=None)
    share_now = kv_share_per_request(obs)
    kv_samples = tuple((t, v) for t, v in state.kv_samples if t > now_seconds - TREND_WINDOW_SECONDS)
    if share_now is not None:
        kv_samples = (*kv_samples, (now_seconds, share_now))
    elif state.kv_samples:
        kv_samples = kv_samples or state.kv_samples[-1:]  # idle: the last measured share stays (as the speed does)
    state = replace(state, startup_seconds=startup, pending_scale_up=pending,
                    token_sums=updated_token_sums(state, obs, now_seconds), kv_samples=kv_samples,
                    scale_ups=settle_scale_ups(config, state.scale_ups, current, obs, now_seconds))
    # What a replica holds: --max-num-seqs, or fewer where its KV cache holds fewer at today's lengths; capacity,
    # the planned batch and a surge are all judged at that batch.
    # A minute's samples averaged: one instant's ratio of KV in use to requests running is noisy where few run.
    recent = [v for t, v in kv_samples if t > now_seconds - KV_SHARE_SECONDS] or [v for _, v in kv_samples[-1:]]
    share = sum(recent) / len(recent) if recent else None
    share_ahead = kv_share_ahead(config, state, now_seconds)
    slots = kv_slots(config, share)
    sized = replace(config, requests_per_replica=max(1, math.floor(slots)))
    sustained, backlog, demand_basis = demand_parts(config, state, obs, per_request, now_seconds)
    demand = sustained + backlog
    batch = obs.running_requests / obs.reporting_replicas
    samples = state.speed_samples
    if measured:
        # The newest sample of each batch size: the fit spans every batch seen (also hours ago), not only the
        # narrow range of the last minutes, which leaves the slope to noise (or to the prior). Less than one
        # request per replica on average is requests decoding alone: batch 1.
        sample_batch = max(batch, 1.0)
        samples = (*(x for x in samples if round(x[0]) != round(sample_batch)),
                   (sample_batch, 1.0 / per_request))[-MAX_SPEED_SAMPLES:]
    # Never flatter than the prior: a fit over light batches extrapolated to full ones must not consolidate too far.
    shape = (config.batch_slowdown if config.batch_slowdown is not None
             else max(batch_slowdown(samples), PRIOR_BATCH_SLOWDOWN))
    slots_used = sized.requests_per_replica
    if measured:
        capacity = full_batch_capacity(per_request, max(batch, 1.0), shape, slots_used)
    elif source == "last measured":
        last_batch = samples[-1][0] if samples else 1.0
        capacity = full_batch_capacity(per_request, max(last_batch, 1.0), shape, slots_used)
    elif source == "prior":
        capacity = config.prior_capacity_tokens_per_second_per_replica or 0.0
        if slots_used < config.requests_per_replica:
            # The prior is for a full batch of --max-num-seqs: the KV cache holds fewer.
            capacity = full_batch_capacity(capacity / config.requests_per_replica, config.requests_per_replica,
                                           shape, slots_used)
    else:
        capacity = 0.0
    u = config.target_utilization
    # Prefill: the replicas' time spent prefilling (measured, a minute's rate) is time they do not decode; at the
    # target utilisation it needs prefill / u replicas on top of decoding's.
    prefill = obs.prefill_seconds_per_second if obs.prefill_seconds_per_second is not None else 0.0
    prefill_replicas = max(prefill, 0.0) / u
    # KV cache: the caches' use (a minute's mean, replicas' worth), grown by how much more a request will hold when
    # new replicas serve (prompts growing), plus the waiting requests' share, at the target utilisation of the caches.
    kv_steady = kv_replicas = 0.0
    usage = obs.kv_cache_usage_1m if obs.kv_cache_usage_1m is not None else obs.kv_cache_usage
    if share_ahead is not None and usage is not None:
        growth = max(share_ahead / share, 1.0) if share else 1.0
        kv_steady = usage * obs.reporting_replicas * growth / u
        kv_replicas = kv_steady + obs.waiting_requests * share_ahead / u
    surge_note = ""
    signal = "tokens"
    steady: int | None = None
    surge = 0.0
    if capacity <= 0:
        # Capacity unknown: no scale-up on it; an idle system (demand 0) may still go to its minimum.
        recommended = current if demand > 0 or in_system > 0 else 0
    else:
        decode_replicas = demand / (u * capacity)
        raw = decode_replicas + prefill_replicas
        if backlog > sustained:
            signal = "queue"
        elif prefill_replicas > decode_replicas:
            signal = "prefill"
        if kv_replicas > raw:
            raw, signal = kv_replicas, "kv"
        elif signal == "tokens" and slots < config.requests_per_replica:
            # Capacity is judged at the batch the KV cache holds: it is the KV cache that limits the replicas.
            signal = "kv"
        surge = surge_replicas(sized, state, obs, current, shape)
        if surge > raw:
            raw, surge_note, signal = surge, f", {in_system:.0f} requests in the system and rising (surge)", "surge"
        # Tolerance band as the HPA: the ratio to the current count decides whether to move at all.
        if current > 0 and abs(raw / current - 1.0) <= config.tolerance:
            recommended = current
        else:
            recommended = math.ceil(raw - 1e-9)
        # The sustained part alone (the arrivals' rate, without draining a queue or a surge's backlog): what the
        # load needs for as long as it lasts. The window remembers it (not a backlog's one-off drain, which held
        # every replica a queue once asked for through the whole window), and a scale-up reaches it at once.
        if demand_basis != "in system":
            sustained_raw = max(sustained / (u * capacity) + prefill_replicas, kv_steady)
            steady = current if current > 0 and abs(sustained_raw / current - 1.0) <= config.tolerance \
                else math.ceil(sustained_raw - 1e-9)
            steady = min(steady, recommended)
        else:
            steady = recommended
    recommended = _clamp(recommended, config)
    steady = _clamp(steady if steady is not None else recommended, config)
    inputs = Inputs(demand_tokens_per_second=round(demand, 3),
                    capacity_tokens_per_second_per_replica=round(capacity, 3),
                    per_request_tokens_per_second=round(per_request, 4), capacity_source=source,
                    running_requests=obs.running_requests, waiting_requests=obs.waiting_requests,
                    recommended=recommended, signal=signal, slots_per_replica=slots,
                    kv_cache_usage=obs.kv_cache_usage,
                    prefill_share=round(prefill / obs.reporting_replicas, 4) if obs.prefill_seconds_per_second
                    is not None else None, kv_replicas=round(kv_replicas, 3),
                    prefill_replicas=round(prefill_replicas, 3))
    window = stabilization_seconds(config, state)
    history = (*((t, r) for t, r in state.recommendations if t > now_seconds - window), (now_seconds, steady))
    first = state.first_observed_seconds if state.first_observed_seconds is not None else now_seconds
    previous_in_system = state.last_in_system[1] if state.last_in_system is not None else None
    arrivals = arrival_rate(state, obs, now_seconds)
    arrival_samples = tuple((t, a) for t, a in state.arrival_samples if t > now_seconds - TREND_WINDOW_SECONDS)
    if arrivals is not None:
        arrival_samples = (*arrival_samples, (now_seconds, arrivals))
    state = replace(state, recommendations=history, first_observed_seconds=first, speed_samples=samples,
                    last_in_system=(now_seconds, in_system), arrival_samples=arrival_samples)
    figures = (f"{signal}: demand {demand:.0f} tok/s ({demand_basis}), capacity {capacity:.0f} tok/s per replica "
               f"({source}){surge_note}")
    if slots < config.requests_per_replica:
        figures += f", KV cache holds {slots:.0f} requests per replica"
    if prefill_replicas > 0:
        figures += f", prefill {prefill / obs.reporting_replicas:.0%} of a replica's time"
    if kv_replicas > 0:
        figures += f", KV needs {kv_replicas:.1f} replicas"
    spare = obs.waiting_requests <= 0 and in_system < SPARE_OCCUPANCY * slots * current
    if recommended > current and spare:
        return Decision(current, current, f"hold: {figures} needs {recommended}, but no request waits and the "
                                          f"{in_system:.0f} in the system fill less than half the replicas' slots",
                        True, inputs), state
    if recommended > current:
        step = max(config.max_scale_up_step, math.floor(current * config.max_scale_up_percent / 100))
        # The step limit is for the uncertain part (a projected backlog's drain): the replicas the measured arrivals
        # need, and those the requests already in the system need at the planned batch (a surge: they are there,
        # not a noisy rate), are added at once, not a step per interval while requests wait a startup for each.
        # (Without a finished-request rate the demand counts the whole queue: beyond a surge, it is step-limited.)
        at_once = max(steady if demand_basis != "in system" else current, _clamp(math.ceil(surge - 1e-9), config))
        desired = min(recommended, max(current + step, at_once))
        step_note = "" if desired == recommended else f" (step limited to +{step})"
        scale_ups = state.scale_ups if config.scale_up_hold_seconds is None else (
            *state.scale_ups, (now_seconds, desired, None))
        state = replace(state, pending_scale_up=(now_seconds, desired), scale_ups=scale_ups)
        return Decision(current, desired, f"scale up: {figures} needs {recommended}{step_note}", True, inputs), state
    if recommended < current:
        # The highest recommendation over the window: scale down only as far as the whole window allows.
        floor = max(recommended, *(r for _, r in history))
        if now_seconds - first < window:
            return Decision(current, current, f"hold: {figures} needs {recommended}; observed for "
                                              f"{now_seconds - first:.0f}s of the {window:.0f}s window", True,
                            inputs), state
        if floor >= current:
            return Decision(current, current, f"hold: {figures} needs {recommended}, but the last "
                                              f"{window:.0f}s needed up to {floor}", True, inputs), state
        held = [(at, n, settled) for at, n, settled in state.scale_ups if n > recommended]
        if held:
            # A scale-up's replicas stay until they have all served, the queue they were asked for has drained, and
            # a hold has passed: removing them sooner is churn (they cost their start-up and served nothing).
            at, n, settled = max(held, key=lambda h: h[1])
            why = (f"its replicas serve with no request waiting since {settled:.0f}s" if settled is not None
                   else "its replicas do not all serve yet or requests wait")
            floor = max(floor, min(n, current))
            if floor >= current:
                return Decision(current, current, f"hold: {figures} needs {recommended}, but the scale-up to {n} "
                                                  f"at {at:.0f}s is kept ({why})", True, inputs), state
        if obs.waiting_requests >= 1:
            # A queue is still being served: the replicas it waits for are not removed (the window remembers the
            # load's sustained need, not the queue's).
            return Decision(current, current, f"hold: {figures} needs {recommended}, but "
                                              f"{obs.waiting_requests:.0f} requests wait", True, inputs), state
        if previous_in_system is not None and in_system > (1 + config.tolerance) * max(previous_in_system, 1.0):
            # The rates lag a rise (finished requests are a minute's average): capacity is not removed while the
            # requests in the system visibly grow; the next evaluation looks again.
            return Decision(current, current, f"hold: {figures} needs {recommended}, but the requests in the "
                                              f"system rose from {previous_in_system:.0f} to {in_system:.0f}",
                            True, inputs), state
        if state.last_scale_down_seconds is not None and now_seconds - state.last_scale_down_seconds < window:
            return Decision(current, current, f"hold: {figures} needs {recommended}; one scale-down per "
                                              f"{window:.0f}s", True, inputs), state
        state = replace(state, last_scale_down_seconds=now_seconds, pending_scale_up=None)
        floor = max(floor, config.min_replicas)
        return Decision(current, floor, f"scale down: {figures} needs {recommended} (highest over the last "
                                        f"{window:.0f}s: {floor})", True, inputs), state
    return Decision(current, current, f"steady: {figures} needs {current}", True, inputs), state
