"""One engine replica on simulated time: the engine's own speculation core (engine/psd/core.py: planner,
sub-batches, wait policy, auto controller, statistics) and drafter link, with step and draft times from cost curves.

The twin is one of the core's three hosts (with the vLLM scheduler and the unit tests): each step it turns its plain
requests into the core's views, calls `SpeculationCore.schedule` (which polls the drafter link, picks the sub-batch,
waits for its drafts through `DrafterLink.wait_for` under the wait policy's budget on the simulated clock, abandoning
a late job, and plans the proposals), prices the verification from the curves, commits tokens drawn from the
acceptance model, and hands the outcome to `SpeculationCore.update` (admission, rebalancing, the next draft job, the
step record, auto's decisions): there is no copy of the engine's loop here. The drafter is a simulated
`DrafterClient`: a job occupies the
drafter device from max(submission, drafter free) for the curves' draft-loop time plus its catch-up tokens at the
drafter's per-token price (calibrated from the engine's jobs, where the curve file gives one), times a draw from the
drafter's time spread where one is given (a drafter on shared cores), and its reply arrives then: churn (newcomers'
prompts) and a slow job make drafts late, an abandoned job still occupies the drafter and delays the next, as in the
engine. vLLM itself (prefill chunking, preemption, the KV cache, CUDA graph choice) is not simulated.

Host work per step: the engine's synchronous steps pay it after the forward pass. vLLM's own plain decoding
(`vllm-ar`) and colocated SD (`vllm-sd`) hide it behind the step's device time (async scheduling), and so does psd
with async steps wherever the engine runs them (`async_psd_steps`: psd, set by the operator or chosen by auto, at
TP = 1, both sub-batches non-empty; their wait for drafts is still paid in series here, which is conservative). A
decision of auto's taken while a step is scheduled ahead waits for that step, and the step after the switch runs
synchronously (the engine drains its queue before switching).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from minedraft.engine.control.cost_model import LOCAL_PAIR_RANK_GIVEN_REJECTION
from minedraft.engine.control.stats import StepRecord
from minedraft.engine.drafter import protocol
from minedraft.engine.drafter.client import DrafterState, JobTicket
from minedraft.engine.drafter.link import DrafterLink, catch_up_tokens
from minedraft.engine.psd.core import AutoSettings, Decision, RequestState, SpeculationCore, StepOutcome
from minedraft.engine.psd.subbatch import SubBatches
from minedraft.engine.settings import (
    DEFAULT_LOOKAHEAD_FANOUT,
    MAX_NUM_SPECULATIVE_TOKENS,
    Mode,
    SchedulerSettings,
)
from minedraft.twin.costs import DRAFTER_SINK_TOKENS, AcceptanceModel, StepCosts
from minedraft.twin.tokens import TokenModel, stream_of

MAX_MODEL_LEN = 1 << 20
# Plain decoding in vLLM itself (no MineDraft): the target alone, with vLLM's async scheduling.
VLLM_AR = "vllm-ar"


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _Job:
    job_id: int
    start: float
    end: float
    reply: protocol.DraftReply
    submitted: float = 0.0


def job_catch_up_ms(costs: StepCosts, items: list[protocol.DraftItem], k: int, colocated: bool) -> float:
    """The drafter's time to take in what a job carries before drafting, besides the draft loop (one definition for
    a drafter of its own and a shared one).

    Measured price (`catch_up_ms_per_token`, calibrated from the engine's jobs, whose loop is learned net of it):
    every catch-up token, the accepted tokens since each request's last job and newcomers' prompts alike. Not
    measured: the tokens beyond the k + 1 the curves' loop takes in on its first pass (a newcomer's prompt) at the
    drafter's prefill price. MineDraft's window bounds each request's catch-up to the sinks + W positions a later
    query can see (the windowed drafter takes in no more); vLLM's colocated drafter has no window, and its prefill
    splits over the target's tensor parallelism as its loop does."""
    window = costs.hardware.drafter_window_tokens
    bound = window + DRAFTER_SINK_TOKENS if window and not colocated else None

    def bounded(tokens: int) -> int:
        return tokens if bound is None else min(tokens, bound)

    price = costs.drafter.catch_up_ms_per_token
    if price is not None:
        ms = price * sum(bounded(catch_up_tokens([item])) for item in items)
    else:
        ms = costs.drafter_prefill_ms(sum(bounded(max(0, len(item.token_ids) - (k + 1))) for item in items))
    tp = costs.hardware.tensor_parallel_size
    if colocated and tp > 1 and costs.hardware.colocated_draft_scales_with_tp:
        ms /= tp
    return ms


class SimDrafter:
    """A `DrafterClient` on simulated time: what the engine's DrafterLink talks to in the twin."""

    def __init__(self, clock: SimClock, costs: StepCosts, colocated: bool, seed: int = 0,
                 hold_jobs_behind_abandoned: bool = False) -> None:
        """`hold_jobs_behind_abandoned`: refuse a job while only abandoned ones occupy the drafter (ReplicaSettings)."""
        self.clock = clock
        self.hold_jobs_behind_abandoned = hold_jobs_behind_abandoned
        # Jobs the engine went ahead without (cancel_jobs) that the drafter still works on.
        self.abandoned: set[int] = set()
        self.costs = costs
        self.colocated = colocated
        # Draws of the drafter's time spread (Hardware.drafter_time_spread), apart from the acceptance's draws.
        self.rng = random.Random(seed)
        self.state = DrafterState.UP
        self.num_starts = 1
        self.free_at = 0.0
        self.jobs: list[_Job] = []
        self._next_id = 0
        self.busy_seconds = 0.0
        # The drafter's choices as token ids (the replica hands it the one its target commits from).
        self.tokens = TokenModel()
        # Per request: its committed length and last committed token, as the jobs carried them.
        self._last: dict[str, tuple[int, int]] = {}

    def draft_results(self, items: list[protocol.DraftItem], top_f: int = 0) -> list[protocol.DraftResult]:
        """Each item's draft: the drafter's top choices from its context on (token ids the target commits from); a
        lookahead branch's context is its committed tokens and its tail. `top_f`: with the top-F candidates at each
        drafted position and the one after (lookahead)."""
        results = []
        for item in items:
            end = item.base_num_tokens + len(item.token_ids)
            if item.token_ids:
                previous = item.token_ids[-1]
                self._last[item.request_id] = (end, previous)
            else:
                known = self._last.get(item.request_id)
                previous = known[1] if known is not None and known[0] == end else 0
            if item.tail:
                previous = item.tail[-1]
            stream, context = stream_of(item.request_id), end + len(item.tail)
            if top_f:
                drafted, ranked = self.tokens.draft_with_candidates(stream, context, previous, item.num_draft_tokens,
                                                                    top_f)
                results.append(protocol.DraftResult(item.request_id, context, drafted, branch=item.branch,
                                                    tail=list(item.tail), candidates=ranked))
            else:
                drafted = self.tokens.draft(stream, context, previous, item.num_draft_tokens)
                results.append(protocol.DraftResult(item.request_id, context, drafted))
        return results

    def check_alive(self) -> bool:
        return True

    def mark_hung(self, reason: str) -> None:  # the simulated drafter never hangs
        raise AssertionError(f"twin drafter taken for hung: {reason}")

    def submit(self, items: list[protocol.DraftItem], want_logprobs: bool, top_f: int = 0) -> JobTicket | None:
        now = self.clock.now
        if (self.hold_jobs_behind_abandoned and self.free_at > now and self.jobs
                and all(job.job_id in self.abandoned for job in self.jobs)):
            return None  # (nothing of the engine's in flight, yet the drafter is busy: an abandoned job)
        self._next_id += 1
        batch = len(items)
        k = max(item.num_draft_tokens for item in items)
        context = sum(item.base_num_tokens + len(item.token_ids) for item in items) / batch
        catch_up_ms = job_catch_up_ms(self.costs, items, k, self.colocated)
        seconds = (self.costs.draft_ms(batch, context, k, colocated=self.colocated) + catch_up_ms) / 1000.0
        spread = self.costs.hardware.drafter_time_spread
        if spread:
            seconds *= self.rng.choice(spread)
        start = max(now, self.free_at)
        results = self.draft_results(items, top_f)
        reply = protocol.DraftReply(self._next_id, results, draft_seconds=seconds,
                                    idle_seconds=max(0.0, now - self.free_at))
        self.jobs.append(_Job(self._next_id, start, start + seconds, reply, now))
        self.free_at = start + seconds
        self.busy_seconds += seconds
        return JobTicket(self._next_id, frozenset(item.request_id for item in items), now)

    def contend(self, start: float, seconds: float, contention: float) -> float:
        """A verification on the drafter's device over [start, start + seconds]: both stretch by `contention` of the
        time they overlap. Returns the verification's seconds."""
        extra = 0.0
        for job in self.jobs:
            overlap = min(job.end, start + seconds) - max(job.start, start)
            if overlap > 0:
                extra += contention * overlap
                job.end += contention * overlap
                self.free_at = max(self.free_at, job.end)
        return seconds + extra

    def receive(self, timeout_seconds: float) -> list[protocol.FromDrafter]:
        due = [job for job in self.jobs if job.end <= self.clock.now]
        if not due and timeout_seconds > 0 and self.jobs:
            self.clock.now = min(self.clock.now + timeout_seconds, min(job.end for job in self.jobs))
            due = [job for job in self.jobs if job.end <= self.clock.now]
        elif not due and timeout_seconds > 0:
            self.clock.now += timeout_seconds
        for job in due:
            self.jobs.remove(job)
            self.abandoned.discard(job.job_id)
        return [job.reply for job in sorted(due, key=lambda j: j.end)]

    def cancel(self, request_ids: list[str]) -> None:
        """Forgotten requests: their last tokens."""
        for request_id in request_ids:
            self._last.pop(request_id, None)

    def cancel_jobs(self, job_ids: list[int]) -> None:
        """Abandoned jobs: one the drafter has started still occupies it (its reply goes nowhere); one still queued
        behind another is dropped unstarted, as the drafter process drops it (DrafterServer: CancelJobs), and the
        jobs after it move up."""
        doomed = set(job_ids)
        self.abandoned |= doomed
        now = self.clock.now
        dropped = [job for job in self.jobs if job.job_id in doomed and job.start > now]
        if not dropped:
            return
        for job in dropped:
            self.jobs.remove(job)
            self.abandoned.discard(job.job_id)
            self.busy_seconds -= job.end - job.start
        free = max([now] + [job.end for job in self.jobs if job.start <= now])
        for job in sorted((job for job in self.jobs if job.start > now), key=lambda job: job.job_id):
            seconds = job.end - job.start
            job.start = max(job.submitted, free)
            job.end = free = job.start + seconds
        self.free_at = max([now] + [job.end for job in self.jobs])

    def shutdown(self) -> None:
        self.jobs.clear()


@dataclass
class SimRequest:
    request_id: str
    prompt_tokens: int
    max_output_tokens: int
    arrival_s: float
    output_tokens: int = 0
    prefilled: bool = False
    first_token_s: float | None = None
    finished_s: float | None = None
    # The output's token ids (TokenModel's), as many as output_tokens once the replica has stepped it.
    tokens: list[int] = field(default_factory=list, repr=False, compare=False)
    _state: RequestState | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    def state(self) -> RequestState:
        num_tokens = self.num_tokens
        cached = self._state
        # Unchanged since the last step (the other sub-batch's members): the same state (they are immutable).
        if cached is not None and cached.num_tokens == num_tokens and cached.decoding == self.prefilled:
            return cached
        pad_room = MAX_MODEL_LEN - num_tokens - 1
        self._state = RequestState(self.request_id, num_tokens, self.prefilled,
                                   min(self.max_output_tokens - self.output_tokens - 1, pad_room), pad_room, 0)
        return self._state


@dataclass
class StepOutcomeSim:
    end_s: float
    output_tokens: int
    finished: list[SimRequest]


@dataclass
class ReplicaSettings:
    mode: str  # ar, sd, psd, auto, vllm-sd, vllm-ar
    k: int = 3
    max_num_seqs: int = 512
    deadline_seconds: float = 5.0
    auto: AutoSettings = field(default_factory=AutoSettings)
    seed: int = 0
    # Check the planner's invariants after every step (tests), as the engine does with check_invariants.
    check_invariants: bool = False
    # The engine's --async-psd-steps: psd steps scheduled while the previous one computes (see the module's doc).
    async_psd_steps: bool = False
    # A policy tried in the twin, not in the engine: send no draft job while the drafter is still finishing an
    # abandoned one (the new job would only queue behind it, and its step wait its whole budget for it); the steps
    # meanwhile verify without drafts at once. (The engine's drafter drops an abandoned job it has not started
    # without a word, so its link cannot yet tell when the drafter is free: see docs/gpu.md.)
    hold_jobs_behind_abandoned: bool = False
    # Lookahead's most branches per request per round (the engine's --lookahead-fanout); the core drafts fewer
    # where its measured drafter time would not hide behind a verification.
    lookahead_fanout: int = DEFAULT_LOOKAHEAD_FANOUT
    # The drafter's rank of the target's token where its top choice was wrong, P(rank = r | rank >= 2) for
    # r = 2, 3, ... (twin/tokens.py; default: measured on the local pair).
    rank_given_rejection: tuple[float, ...] = LOCAL_PAIR_RANK_GIVEN_REJECTION
    # Lookahead: a miss verified with a backup branch (the engine's default; --no-lookahead-backups: without drafts).
    lookahead_backups: bool = True
    # The engine's --draft-length (fixed or adaptive) for sd and psd.
    draft_length: str = "fixed"
    # Heterogeneous acceptance: (low, high) gives each request its own constant per-position acceptance rate, drawn
    # uniformly within, seeded by the run's seed and the request's id (the same request draws the same rate in every
    # mode); the acceptance model's rates then apply to none. Empty: every request follows the acceptance model.
    acceptance_spread: tuple[float, ...] = ()


class TwinReplica:
    def __init__(self, costs: StepCosts, acceptance: AcceptanceModel, settings: ReplicaSettings,
                 drafter: Callable[[SimClock], SimDrafter] | None = None) -> None:
        """`drafter`: makes the replica's drafter client on its clock (default: a drafter device of its own, or the
        target's); the shared-drafter twin passes one that drafts on a device many replicas share."""
        self.costs = costs
        self.acceptance = acceptance
        self.settings = settings
        self.rng = random.Random(settings.seed)
        self.clock = SimClock()
        colocated = settings.mode == Mode.VLLM_SD.value
        # vLLM's own modes: no MineDraft in the loop; their host work hides behind the device with async scheduling.
        self.vllm_own = settings.mode in (VLLM_AR, Mode.VLLM_SD.value)
        self.shared_device = colocated or costs.hardware.drafter_placement == "shared"
        self.drafter = (drafter(self.clock) if drafter is not None
                        else SimDrafter(self.clock, costs, colocated, seed=settings.seed + 1))
        self.drafter.hold_jobs_behind_abandoned = settings.hold_jobs_behind_abandoned
        self.link = DrafterLink(self.drafter, hang_seconds=1e9, max_failed_jobs=3, clock=self.clock)  # type: ignore[arg-type]
        configured = Mode.AR if settings.mode == VLLM_AR else Mode(settings.mode)
        # vLLM's colocated SD is sequential SD whose drafter shares the target's GPUs (costs alike, no extra GPU).
        configured = Mode.SD if configured is Mode.VLLM_SD else configured
        # The engine bounds one draft job's catch-up (newcomers' prompts) because the drafter's prefill takes time. The
        # curves hold no prefill, so unless a prefill or catch-up cost is given the simulated drafter takes prompts for
        # free, and the bound would only hold newcomers' drafts back for nothing it models: it applies when priced.
        priced = bool(costs.hardware.prefill_ms_per_token) or costs.drafter.catch_up_ms_per_token is not None
        core_settings = SchedulerSettings(
            mode=configured, num_speculative_tokens=settings.k,
            max_num_speculative_tokens=max(settings.k, MAX_NUM_SPECULATIVE_TOKENS, *settings.auto.k_candidates),
            catch_up_tokens_per_job=SchedulerSettings.catch_up_tokens_per_job if priced else 2**62,
            deadline_seconds=settings.deadline_seconds, check_invariants=settings.check_invariants,
            async_steps=settings.async_psd_steps, lookahead_fanout=settings.lookahead_fanout,
            lookahead_backup_drafts=settings.lookahead_backups, draft_length=settings.draft_length)
        # The engine's own core on simulated time: its planner, wait policy, drafter link and auto controller.
        self.core = SpeculationCore(core_settings, self.link, self._token_ids, clock=self.clock,
                                    auto_settings=settings.auto)
        # Token ids: the simulated drafter drafts from them, the target commits from them (twin/tokens.py), with draws
        # of their own (the acceptance's draws stay those of a run without them).
        self.token_model = TokenModel(settings.rank_given_rejection, seed=settings.seed + 7)
        self.drafter.tokens = self.token_model
        self.requests: dict[str, SimRequest] = {}  # admitted (running), in arrival order
        # With an acceptance spread: each running request's own acceptance model.
        self._acceptance_of: dict[str, AcceptanceModel] = {}
        self.waiting: list[SimRequest] = []
        self.step_number = 0
        self.records: list[StepRecord] = []  # kept only with settings.check_invariants (tests)
        self.steps_by_mode: dict[str, int] = {}
        # Decode steps run at each setting ("psd-k3", "ar"), for what auto chose.
        self.steps_by_setting: dict[str, int] = {}
        # Lookahead: steps whose branch job used each fan-out (the core's, from measured drafter and verify times).
        self.lookahead_fanouts: dict[int, int] = {}
        # Async steps under auto: whether the next step follows a drain (an auto decision waited for a step in
        # flight: the next step is scheduled synchronously, nothing in flight).
        self._drained = False

    @property
    def mode(self) -> Mode:
        """The chosen mode (psd, sd or ar)."""
        return self.core.chosen_mode

    @property
    def k(self) -> int:
        return self.core.k

    @property
    def subbatches(self) -> SubBatches:
        return self.core.subbatches

    @property
    def decisions(self) -> list[Decision]:
        """Auto's latest decisions (its statistics keep the last few hundred; num_decisions counts all)."""
        return self.core.stats.decisions()

    @property
    def num_decisions(self) -> int:
        return self.core.num_decisions

    @property
    def deadline_misses(self) -> int:
        return self.core.stats.totals().deadline_misses

    # -- arrivals ------------------------------------------------------------------------------------------------

    def add(self, request: SimRequest) -> None:
        self.waiting.append(request)

    def _admit(self) -> None:
        while (self.waiting and len(self.requests) < self.settings.max_num_seqs
               and self.waiting[0].arrival_s <= self.clock.now):
            request = self.waiting.pop(0)
            self.requests[request.request_id] = request

    @property
    def num_in_system(self) -> int:
        return len(self.requests) + len(self.waiting)

    def idle_until(self, time_s: float) -> None:
        self.clock.now = max(self.clock.now, time_s)

    # -- the step: the core's schedule, the target on the curves, the core's update ---------------------------------

    def acceptance_of(self, request_id: str) -> AcceptanceModel:
        """The request's acceptance: its own rate drawn from the spread, or the replica's model."""
        spread = self.settings.acceptance_spread
        if not spread:
            return self.acceptance
        model = self._acceptance_of.get(request_id)
        if model is None:
            rate = random.Random(f"{self.settings.seed}:{request_id}").uniform(min(spread), max(spread))
            model = self._acceptance_of[request_id] = AcceptanceModel.constant(rate)
        return model

    def _token_ids(self, request_id: str, start: int, end: int) -> list[int]:
        """The core's TokenReader: a request's tokens [start, end) (its prompt's are 0)."""
        request = self.requests.get(request_id)
        if request is None:
            return [0] * (end - start)
        prompt = request.prompt_tokens
        out = [0] * max(0, min(end, prompt) - start)
        out += request.tokens[max(0, start - prompt):max(0, end - prompt)]
        return out

    def _fill_tokens(self, request: SimRequest) -> None:
        """Outputs a load started part-way (run.py's steady states): their earlier tokens, the drafter's top choices."""
        missing = request.output_tokens - len(request.tokens)
        if missing > 0:
            previous = request.tokens[-1] if request.tokens else 0
            request.tokens += self.token_model.draft(stream_of(request.request_id), request.prompt_tokens
                                                     + len(request.tokens), previous, missing)

    def step(self) -> StepOutcomeSim:
        self._admit()
        for request in self.requests.values():
            if len(request.tokens) < request.output_tokens:
                self._fill_tokens(request)
        core = self.core
        started = self.clock.now
        decision = core.schedule([r.state() for r in self.requests.values()], now=started)
        plan, mode, group = decision.plan, decision.step_mode, decision.verified_group
        wait_seconds = self.clock.now - started  # (the core's wait for drafts is the only simulated time it takes)
        core.commit(decision, (), now=self.clock.now)

        # Who the target computes: decoders not held out (with their proposals), and prompts taken in this step.
        decoders = [r for r in self.requests.values() if r.prefilled and r.request_id not in plan.held_out]
        prefills = [r for r in self.requests.values() if not r.prefilled]
        scheduled_tokens = sum(1 + len(plan.proposals.get(r.request_id, ())) for r in decoders)
        verify_ms = 0.0
        if decoders:
            context = sum(r.num_tokens for r in decoders) / len(decoders)
            verify_ms = self.costs.verify_ms(len(decoders), context, scheduled_tokens / len(decoders))
        prompt_tokens = sum(r.prompt_tokens for r in prefills)
        verify_ms += prompt_tokens * self.costs.hardware.prefill_ms_per_token
        if prefills and not decoders:
            verify_ms = max(verify_ms, self.costs.verify_ms(len(prefills), 1, 1))
        verify_seconds = verify_ms / 1000.0
        verify_start = self.clock.now
        if self.shared_device and self.drafter.jobs:
            verify_seconds = self.drafter.contend(verify_start, verify_seconds, self.costs.hardware.shared_contention)
        self.clock.now = verify_start + verify_seconds

        # Commit: the bonus token plus the accepted drafts (vLLM's rejection sampler), capped at the budget.
        num_sampled: dict[str, int] = {}
        output_tokens = 0
        finished: list[SimRequest] = []
        now = self.clock.now
        for request in decoders:
            rid = request.request_id
            proposal = plan.proposals.get(rid, ())
            drafted = min(len(proposal), plan.drafted_lengths.get(rid, 0))
            acceptance = self.acceptance_of(rid)
            drawn = acceptance.sample(drafted, self.rng) if drafted else 0
            # The target judges the proposal's own tokens: a draft made from another context is rejected where it
            # leaves the drafter's choices in this one (twin/tokens.py).
            committed = self.token_model.judge(
                stream_of(rid), request.num_tokens, request.tokens[-1] if request.tokens else 0, proposal[:drafted],
                drawn, acceptance.conditional(drafted))
            accepted = len(committed) - 1
            num_sampled[rid] = accepted + 1
            gained = min(accepted + 1, request.max_output_tokens - request.output_tokens)
            request.tokens += committed[:gained]
            request.output_tokens += gained
            output_tokens += gained
        for request in prefills:
            request.prefilled = True
            request.tokens = [self.token_model.target_token(stream_of(request.request_id), request.prompt_tokens, 0,
                                                            self.acceptance_of(request.request_id).conditional(0))]
            request.output_tokens = 1
            request.first_token_s = now
            output_tokens += 1
        for request in [*decoders, *prefills]:
            if request.output_tokens >= request.max_output_tokens:
                request.finished_s = now
                finished.append(request)
                del self.requests[request.request_id]
                self._acceptance_of.pop(request.request_id, None)

        overhead_seconds = self.costs.step_overhead_ms(len(decoders) + len(prefills), mode is not Mode.AR) / 1000.0
        # The device's time in this step: the forward, and for vLLM's colocated SD its draft loop on the same GPU.
        device_seconds = verify_seconds + (wait_seconds if self.vllm_own else 0.0)
        hidden = self._hides_host_work(mode, group) and not self._drained
        if hidden:
            # Host work overlapping the next forward: the next draft job goes out as the tokens are in.
            end = self.clock.now + self.costs.step_period_s(device_seconds, overhead_seconds, True) - device_seconds
        else:
            # A synchronous step: its host work (committing, planning, the next step's scheduling and inputs) runs
            # with both devices idle: the next draft job goes out only once this step's tokens are committed, and
            # the next verification needs those drafts, so none of it overlaps the drafter's work either.
            self.clock.now += overhead_seconds
            end = self.clock.now
        outcome = StepOutcome(
            views=[r.state() for r in self.requests.values()], verified=plan.proposals, num_sampled=num_sampled,
            decoded=[r.request_id for r in decoders], num_prefill_requests=len(prefills),
            num_scheduled_tokens=scheduled_tokens + prompt_tokens, verify_done_at=now, worker_seconds=verify_seconds,
            gone=[r.request_id for r in finished], alive=set(self.requests) if self.settings.check_invariants else (),
            num_output_tokens=output_tokens, overlapped=hidden and not self.vllm_own, update_seconds=overhead_seconds)
        pending = core.pending_decision
        record = core.update(decision, outcome, now=end)
        # An auto decision that waited for the step in flight was applied: the next step is scheduled synchronously.
        self._drained = pending is not None and core.pending_decision is not pending
        self.clock.now = end
        self.step_number += 1
        self.steps_by_mode[mode.value] = self.steps_by_mode.get(mode.value, 0) + 1
        setting = mode.value if mode is Mode.AR else f"{mode.value}-k{record.k}"
        self.steps_by_setting[setting] = self.steps_by_setting.get(setting, 0) + 1
        if record.lookahead_fanout:
            self.lookahead_fanouts[record.lookahead_fanout] = self.lookahead_fanouts.get(record.lookahead_fanout, 0) + 1
        if self.settings.check_invariants:
            self.records.append(record)
        return StepOutcomeSim(self.clock.now, output_tokens, finished)

    def _hides_host_work(self, mode: Mode, group: int | None) -> bool:
        """Whether this step's host work overlaps a forward pass (async scheduling) rather than following it."""
        if self.vllm_own:
            return self.costs.hardware.vllm_async_scheduling
        # The engine schedules psd steps ahead only where they verify disjoint requests: psd (set by the operator or
        # chosen by auto, whose cost model reads such steps apart), one GPU for the target, both sub-batches in use
        # (and not the first step after a switch of auto's: see step()).
        # (Both sub-batches as the core's update leaves them: in psd every running request is admitted and the two
        # rebalanced to within one, so both hold members exactly when two requests or more run on.)
        return (self.settings.async_psd_steps and mode is Mode.PSD and group is not None
                and self.costs.hardware.tensor_parallel_size == 1 and len(self.requests) >= 2)

    def switch(self, mode_name: str, k: int) -> None:
        """Run `mode_name` at draft length k from the next step, as the engine applies an operator's switch."""
        mode = Mode(mode_name)
        self.core.set_mode(mode, None if mode is Mode.AR else k)


def _bump(counts: list[int], upto: int) -> None:
    if len(counts) < upto:
        counts.extend([0] * (upto - len(counts)))
    for i in range(upto):
        counts[i] += 1


Arrivals = Callable[[float], list[SimRequest]]
