"""One engine replica on simulated time: the engine's own planner, sub-batches, drafter link, wait policy and auto
controller, with step and draft times from cost curves.

The loop is the scheduler's (engine/vllm_adapter/scheduler.py: schedule() then update_from_output()), over plain
requests instead of vLLM's: each step polls the drafter link, lets the planner pick the sub-batch, waits for its
drafts through `DrafterLink.wait_for` under the `WaitPolicy` budget (abandoning a late job as the engine does), asks
the planner for the step's proposals, verifies (time from the curves), commits tokens drawn from the acceptance
model, hands the planner the step's outcome, sends the verified sub-batch's next draft job through the link, builds
the engine's `StepRecord` and feeds it to the `AutoController` in auto mode (applying its decisions through the
planner's `switch_mode`, as the scheduler does). The drafter is a simulated `DrafterClient`: a job occupies the
drafter device from max(submission, drafter free) for the curves' draft-loop time plus its catch-up tokens at the
drafter's per-token price (calibrated from the engine's jobs, where the curve file gives one), times a draw from the
drafter's time spread where one is given (a drafter on shared cores), and its reply arrives then: churn (newcomers'
prompts) and a slow job make drafts late, an abandoned job still occupies the drafter and delays the next, as in the
engine. vLLM
itself (prefill chunking, preemption, the KV cache, CUDA graph choice) is not simulated.

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

from minedraft.engine.control.auto import AutoController, AutoSettings, Decision
from minedraft.engine.control.cost_model import CostModel
from minedraft.engine.control.stats import StepRecord
from minedraft.engine.drafter import protocol
from minedraft.engine.drafter.client import DrafterState, JobTicket
from minedraft.engine.drafter.link import DrafterLink, JobTimes, add_reply, catch_up_tokens
from minedraft.engine.psd.inflight import JobInFlight
from minedraft.engine.psd.planner import Draft, PSDPlanner, RequestState, WaitPolicy
from minedraft.engine.settings import Mode
from minedraft.twin.costs import DRAFTER_SINK_TOKENS, AcceptanceModel, StepCosts

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

    def __init__(self, clock: SimClock, costs: StepCosts, colocated: bool, seed: int = 0) -> None:
        self.clock = clock
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

    def check_alive(self) -> bool:
        return True

    def mark_hung(self, reason: str) -> None:  # the simulated drafter never hangs
        raise AssertionError(f"twin drafter taken for hung: {reason}")

    def submit(self, items: list[protocol.DraftItem], want_logprobs: bool) -> JobTicket | None:
        self._next_id += 1
        now = self.clock.now
        batch = len(items)
        k = max(item.num_draft_tokens for item in items)
        context = sum(item.base_num_tokens + len(item.token_ids) for item in items) / batch
        catch_up_ms = job_catch_up_ms(self.costs, items, k, self.colocated)
        seconds = (self.costs.draft_ms(batch, context, k, colocated=self.colocated) + catch_up_ms) / 1000.0
        spread = self.costs.hardware.drafter_time_spread
        if spread:
            seconds *= self.rng.choice(spread)
        start = max(now, self.free_at)
        results = [protocol.DraftResult(item.request_id, item.base_num_tokens + len(item.token_ids),
                                        [0] * item.num_draft_tokens) for item in items]
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
        return [job.reply for job in sorted(due, key=lambda j: j.end)]

    def cancel(self, request_ids: list[str]) -> None:
        """Forgotten requests: nothing to free in a simulation."""

    def cancel_jobs(self, job_ids: list[int]) -> None:
        """Abandoned jobs: one the drafter has started still occupies it (its reply goes nowhere); one still queued
        behind another is dropped unstarted, as the drafter process drops it (DrafterServer: CancelJobs), and the
        jobs after it move up."""
        doomed = set(job_ids)
        now = self.clock.now
        dropped = [job for job in self.jobs if job.job_id in doomed and job.start > now]
        if not dropped:
            return
        for job in dropped:
            self.jobs.remove(job)
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
class StepOutcome:
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
        self.link = DrafterLink(self.drafter, hang_seconds=1e9, max_failed_jobs=3, clock=self.clock)  # type: ignore[arg-type]
        # The engine bounds one draft job's catch-up (newcomers' prompts) because the drafter's prefill takes time. The
        # curves hold no prefill, so unless a prefill or catch-up cost is given the simulated drafter takes prompts for
        # free, and the bound would only hold newcomers' drafts back for nothing it models: it applies when priced.
        self.planner = PSDPlanner(k=settings.k, in_flight=self.link.jobs)
        if not costs.hardware.prefill_ms_per_token and costs.drafter.catch_up_ms_per_token is None:
            self.planner.catch_up_tokens_per_job = 2**62
        self.wait_policy = WaitPolicy(cap_seconds=settings.deadline_seconds)
        configured = Mode.AR if settings.mode == VLLM_AR else Mode(settings.mode)
        self.auto: AutoController | None = None
        if configured is Mode.AUTO:
            self.mode = Mode.PSD
            self.auto = AutoController(settings.auto, Mode.PSD.value, settings.k,
                                       CostModel(async_psd_steps=settings.async_psd_steps))
        else:
            # vLLM's colocated SD is sequential SD whose drafter shares the target's GPUs (costs alike, no extra GPU).
            self.mode = Mode.SD if configured is Mode.VLLM_SD else configured
        self.requests: dict[str, SimRequest] = {}  # admitted (running), in arrival order
        self.waiting: list[SimRequest] = []
        self.decisions: list[Decision] = []
        self.step_number = 0
        self.records: list[StepRecord] = []  # kept only with settings.check_invariants (tests)
        self.deadline_misses = 0
        self.steps_by_mode: dict[str, int] = {}
        # Decode steps run at each setting ("psd-k3", "ar"), for what auto chose.
        self.steps_by_setting: dict[str, int] = {}
        self._drafts_by_group: dict[int, JobTimes] = {}
        # Async steps under auto: whether the last step was scheduled ahead (the next one is then already in flight
        # when a decision comes: the decision waits one step for it, as the scheduler drains its queue), the decision
        # waiting, and whether the next step follows a drain (scheduled synchronously, nothing in flight).
        self._last_ahead = False
        self._pending: Decision | None = None
        self._drained = False

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

    # -- the step (scheduler.schedule + update_from_output) -------------------------------------------------------

    def _on_message(self, job: JobInFlight | None, message: protocol.FromDrafter) -> None:
        if not isinstance(message, protocol.DraftReply):
            return
        self.wait_policy.observe_draft(message.draft_seconds)
        if job is None:
            return
        self._drafts_by_group[job.group] = add_reply(self._drafts_by_group.get(job.group), message, job.catch_up_tokens)
        self.planner.store_drafts(((r.request_id, Draft(r.context_num_tokens, r.token_ids, r.logprobs))
                                   for r in message.results), lambda rid: rid in self.requests)

    def step(self) -> StepOutcome:
        self._admit()
        started = self.clock.now
        self._drafts_by_group = {}
        states = [r.state() for r in self.requests.values()]
        mode = self.mode
        if mode is not Mode.AR:
            self.link.poll(0.0, self._on_message)
        group = self.planner.pick_group(states, mode)
        wait_seconds = wait_budget = 0.0
        if group is not None and group in self.link.jobs:
            wait_budget = self.wait_policy.budget_seconds()
            result = self.link.wait_for(group, wait_budget, self._on_message)
            wait_seconds = result.waited_seconds
            if group in self.link.jobs:
                self.link.abandon(group)
                self.deadline_misses += 1
        jobs_in_flight = len(self.link.jobs)
        plan = self.planner.plan(states, mode, group, pad=self.auto is None)

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
        drafted_pp: list[int] = []
        accepted_pp: list[int] = []
        output_tokens = num_with_drafts = num_draft = num_accepted = num_pad = 0
        finished: list[SimRequest] = []
        now = self.clock.now
        for request in decoders:
            rid = request.request_id
            proposal = plan.proposals.get(rid, ())
            drafted = min(len(proposal), plan.drafted_lengths.get(rid, 0))
            num_pad += len(proposal) - drafted
            accepted = self.acceptance.sample(drafted, self.rng) if drafted else 0
            if drafted:
                num_with_drafts += 1
                num_draft += drafted
                num_accepted += accepted
                _bump(drafted_pp, drafted)
                _bump(accepted_pp, accepted)
            gained = min(accepted + 1, request.max_output_tokens - request.output_tokens)
            request.output_tokens += gained
            output_tokens += gained
        for request in prefills:
            request.prefilled = True
            request.output_tokens = 1
            request.first_token_s = now
            output_tokens += 1
        for request in [*decoders, *prefills]:
            if request.output_tokens >= request.max_output_tokens:
                request.finished_s = now
                finished.append(request)
                del self.requests[request.request_id]
        if finished:
            self.link.forget(self.planner.forget([r.request_id for r in finished]))

        after = [r.state() for r in self.requests.values()]
        chosen = self.mode
        self.planner.after_step(after, mode, group, chosen)
        overhead_seconds = self.costs.step_overhead_ms(len(decoders) + len(prefills), mode is not Mode.AR) / 1000.0
        # The device's time in this step: the forward, and for vLLM's colocated SD its draft loop on the same GPU.
        device_seconds = verify_seconds + (wait_seconds if self.vllm_own else 0.0)
        hidden = self._hides_host_work(mode, group) and not self._drained
        self._drained = False
        if not hidden:
            # A synchronous step: its host work (committing, planning, the next step's scheduling and inputs) runs
            # with both devices idle: the next draft job goes out only once this step's tokens are committed, and
            # the next verification needs those drafts, so none of it overlaps the drafter's work either.
            self.clock.now += overhead_seconds
        if mode in (Mode.PSD, Mode.SD) and group is not None:
            self._submit(group, after)
        if self.settings.check_invariants:
            self.planner.check_invariants(after, set(self.requests), chosen)
        if mode is not Mode.AR:
            self.wait_policy.observe_verify(verify_seconds)
        # As the scheduler records it: the drafting of the job whose drafts this step verified.
        job = self._drafts_by_group.get(group, JobTimes()) if group is not None else JobTimes()
        if hidden:
            self.clock.now += self.costs.step_period_s(device_seconds, overhead_seconds, True) - device_seconds
        self.step_number += 1
        self.steps_by_mode[mode.value] = self.steps_by_mode.get(mode.value, 0) + 1
        setting = mode.value if mode is Mode.AR else f"{mode.value}-k{self.planner.k}"
        self.steps_by_setting[setting] = self.steps_by_setting.get(setting, 0) + 1
        record = StepRecord(
            step=self.step_number, started_at=started, mode=mode.value, verified_group=group,
            group_sizes=self.planner.subbatches.sizes(), num_decode_requests=len(decoders),
            num_prefill_requests=len(prefills), num_requests_with_drafts=num_with_drafts,
            num_draft_tokens=num_draft, num_accepted_tokens=num_accepted,
            drafted_per_position=tuple(drafted_pp), accepted_per_position=tuple(accepted_pp),
            num_output_tokens=output_tokens, num_scheduled_tokens=scheduled_tokens + prompt_tokens,
            verify_seconds=verify_seconds, wait_seconds=wait_seconds, draft_seconds=job.draft_seconds,
            drafter_idle_seconds=0.0, schedule_seconds=0.0, step_seconds=self.clock.now - started,
            drafter_up=True, k=self.planner.k, auto=self.auto is not None, widened=False,
            draft_jobs_in_flight=jobs_in_flight, num_held_out=len(plan.held_out),
            num_pad_tokens=num_pad, wait_budget_seconds=wait_budget, update_seconds=overhead_seconds,
            draft_job_requests=job.requests, draft_job_length=job.length,
            draft_job_catch_up_tokens=job.catch_up_tokens,
            scheduled_ahead=hidden and not self.vllm_own,
        )
        if self.settings.check_invariants:
            self.records.append(record)
        if self.auto is not None:
            num_running = sum(1 for r in self.requests.values() if r.prefilled)
            decision = self.auto.on_step(record, num_running)
            if self._pending is not None:
                # The step in flight at the decision is done: switch, and schedule the next step synchronously.
                self._apply(self._pending)
                self._pending, self._drained = None, True
            if decision is not None:
                if record.scheduled_ahead:
                    self._pending = decision  # (the next step is already scheduled, for the setting it leaves)
                else:
                    self._apply(decision)
        return StepOutcome(self.clock.now, output_tokens, finished)

    def _hides_host_work(self, mode: Mode, group: int | None) -> bool:
        """Whether this step's host work overlaps a forward pass (async scheduling) rather than following it."""
        if self.vllm_own:
            return self.costs.hardware.vllm_async_scheduling
        # The engine schedules psd steps ahead only where they verify disjoint requests: psd (set by the operator or
        # chosen by auto, whose cost model reads such steps apart), one GPU for the target, both sub-batches in use
        # (and not the first step after a switch of auto's: see step()).
        return (self.settings.async_psd_steps and mode is Mode.PSD and group is not None
                and self.costs.hardware.tensor_parallel_size == 1 and min(self.planner.subbatches.sizes()) > 0)

    def _submit(self, group: int, states: list[RequestState]) -> None:
        if self.settings.hold_jobs_behind_abandoned and not self.link.jobs and self.drafter.free_at > self.clock.now:
            return  # (nothing of ours in flight, yet the drafter is busy: an abandoned job)
        plans = self.planner.draft_job(states, group)
        if not plans:
            return
        items = [protocol.DraftItem(p.request_id, [0] * (p.num_tokens - p.base_num_tokens), p.num_draft_tokens,
                                    p.base_num_tokens) for p in plans]
        if self.link.submit(group, items, want_logprobs=False):
            self.planner.job_sent(plans)

    def _apply(self, decision: Decision) -> None:
        self.switch(decision.mode, decision.k)
        self.decisions.append(decision)

    def switch(self, mode_name: str, k: int) -> None:
        """Run `mode_name` at draft length k from the next step, as the scheduler applies a switch (auto's, or the
        operator's): through the planner's switch_mode, requests in flight carrying on."""
        mode = Mode(mode_name)
        k = self.planner.k if mode is Mode.AR else k
        self.planner.switch_mode(self.mode, mode, k, 0)
        self.mode = mode


def _bump(counts: list[int], upto: int) -> None:
    if len(counts) < upto:
        counts.extend([0] * (upto - len(counts)))
    for i in range(upto):
        counts[i] += 1


Arrivals = Callable[[float], list[SimRequest]]
