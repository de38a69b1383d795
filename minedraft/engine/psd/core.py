"""The speculation core: one engine step of batch-parallel speculative decoding, in one place, driven by three hosts.

Shaped like vLLM's own scheduler, two calls per step (and one to say what was launched):

    decision = core.schedule(views, now)          which sub-batch is verified, with which drafts, who is held out
    core.commit(decision, scheduled_ids, ...)     the host built the step from it (vLLM scheduled these requests)
    record = core.update(decision, outcome, now)  commit the outcome: admit, rebalance, send the next draft job,
                                                  record the step, feed auto mode (and apply its decision)

The core owns the planner (psd/planner.py), the draft jobs in flight (read through its DraftSource, psd/events.py),
the wait policy, auto mode's controller and cost model, the statistics, the steps scheduled ahead (async PSD steps)
and an auto decision waiting for them. It never sees a token id (the host's TokenReader hands the draft source the
tokens a job sends), a clock it was not given, vLLM, torch or a transport (an import-linter contract holds this).

Its hosts: the vLLM scheduler subclass (vllm_adapter/scheduler.py: vLLM requests -> views, a decision -> spec tokens,
runner output -> outcome), the digital twin (twin/replica.py: simulated requests, curves and a simulated clock, the
real drafter link over a simulated drafter), and the unit tests (a fake draft source and hand-made outcomes).

How a mode plugs in. A mode is a policy over the same three calls: what `schedule` verifies and proposes (the
decision carries per-request proposals, `plan.proposals`, and who is held out), and what `update` submits to the
draft source afterwards (`_submit`: the draft jobs, each a list of JobItemPlans for one key of InFlight). psd and sd
are the planner's `pick_group`/`plan`/`draft_job` with the sub-batch as the job key. Lookahead (psd/lookahead.py)
is the same three calls with the whole batch as sub-batch 0: `schedule` verifies each request with the branch whose
tail its committed tokens match (planner._plan_lookahead), `commit` sends the next round's branch job at once (the
likeliest outcomes of the step just launched, `_submit_branches`) and `update` learns acceptance and bonus ranks from
the outcome; events, waits, statistics, auto and the hosts stay.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from minedraft.engine.control.auto import AutoController, AutoSettings, Decision
from minedraft.engine.control.cost_model import CostModel
from minedraft.engine.control.stats import StatsRecorder, StepRecord
from minedraft.engine.psd.events import (
    DrafterBusy,
    DrafterEvent,
    DrafterRestarted,
    DraftsArrived,
    DraftSource,
    JobFailed,
    JobHung,
    JobTimes,
    TokenReader,
)
from minedraft.engine.psd.lookahead import (
    LookaheadStats,
    Outcome,
    Verified,
    allot,
    bonus_rank,
    choose_shape,
    outcomes,
    refresh_pays,
)
from minedraft.engine.psd.planner import (
    QUARANTINE_AFTER_HANGS,
    PlannedStep,
    PSDPlanner,
    RequestState,
    WaitPolicy,
    should_widen,
)
from minedraft.engine.psd.subbatch import SubBatches
from minedraft.engine.psd.verify_budget import DraftLengthPolicy
from minedraft.engine.settings import Mode, SchedulerSettings

log = logging.getLogger(__name__)

# The core's surface for its hosts (the twin imports no planner or auto class of its own: these are re-exported).
__all__ = ["AutoSettings", "Decision", "RequestState", "SpeculationCore", "StepDecision", "StepOutcome"]


@dataclass(frozen=True, slots=True)
class StepDecision:
    """What one step runs, decided before it runs and never changed (vLLM's SchedulerOutput is the model)."""

    plan: PlannedStep
    # Requests that must not run in this step: held out by the plan (their drafts are coming) or still in a step
    # scheduled ahead (their next tokens are not known yet).
    held: frozenset[str]
    # The target may compute on the drafter's cores during this step (nothing drafts meanwhile).
    widen: bool
    # The views the decision was made from (the host's, not copied).
    views: Sequence[RequestState]

    @property
    def step_mode(self) -> Mode:
        return self.plan.step_mode

    @property
    def verified_group(self) -> int | None:
        return self.plan.verified_group

    @property
    def proposals(self) -> dict[str, list[int]]:
        return self.plan.proposals


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What a step did, as its host saw it."""

    # Committed state after the step: the running requests (those in a step still scheduled ahead not decoding).
    views: Sequence[RequestState]
    # Proposal tokens the target verified per request (vLLM may cut a planned proposal) and tokens it produced.
    verified: Mapping[str, Sequence[int]]
    num_sampled: Mapping[str, int]
    # Requests of the step past their prompt (the rest took in prompt tokens).
    decoded: Collection[str]
    num_prefill_requests: int
    num_scheduled_tokens: int
    # When the target's work was in (the host's clock), and, where the host measured it apart, its seconds.
    verify_done_at: float
    worker_seconds: float | None = None
    # Requests that finished or were aborted, and those preempted back to waiting, since the last look.
    gone: Collection[str] = ()
    preempted: Collection[str] = ()
    # Every unfinished request (running, waiting, preempted): only read with check_invariants.
    alive: Collection[str] = ()
    # None: the sum of num_sampled.
    num_output_tokens: int | None = None
    widened: bool = False
    # A host on simulated time that overlaps this step's host work with the next step's forward without scheduling
    # it ahead (the twin): the step counts as scheduled ahead, and an auto decision waits one step as it would.
    overlapped: bool = False
    # A host on simulated time: its own price of the step's host work (else measured: now - verify_done_at).
    update_seconds: float | None = None


@dataclass(slots=True)
class StepTiming:
    started_at: float = 0.0
    wait_seconds: float = 0.0
    wait_budget_seconds: float = 0.0
    scheduled_at: float = 0.0
    draft_jobs_in_flight: int = 0
    scheduled_ahead: bool = False
    # The job times of the replies that arrived during this step, by sub-batch: the step records only the verified
    # sub-batch's (summed in, a switch priced one sub-batch's draft at two jobs' time in auto's cost model).
    drafts_by_group: dict[int, JobTimes] = field(default_factory=dict)
    # Lookahead: seconds this step waited for a refresh of its misses (part of wait_seconds).
    refresh_seconds: float = 0.0


@dataclass(slots=True)
class _Launched:
    decision: StepDecision
    timing: StepTiming
    # Requests the step runs: none of them may be scheduled again before its output is processed.
    request_ids: frozenset[str]
    # Lookahead: what each request's verification carried with candidates (learned from once the outcome is in), and
    # the branch job sent at launch (its branches beyond the roots, and the fan-out it used).
    verified: dict[str, Verified] = field(default_factory=dict)
    num_branches: int = 0
    fanout: int = 0
    depth: int = 0


class SpeculationCore:
    def __init__(self, settings: SchedulerSettings, source: DraftSource, tokens: TokenReader,
                 clock: Callable[[], float] = time.perf_counter, auto_settings: AutoSettings | None = None) -> None:
        """`tokens`: reads a request's committed tokens for a draft job; `clock`: the host's (simulated in the twin);
        `auto_settings`: auto's whole settings (default: settings.auto over AutoSettings' defaults)."""
        self.settings = settings
        self.source = source
        self.tokens = tokens
        self.clock = clock
        self.max_num_speculative_tokens = settings.max_num_speculative_tokens
        configured = settings.mode
        # The chosen mode: psd, sd or ar for the coming steps (auto changes it); a step runs in its step mode: this
        # one, or ar while the drafter is down.
        self.chosen_mode: Mode = Mode.PSD if configured is Mode.AUTO else configured
        self.planner = PSDPlanner(
            k=settings.num_speculative_tokens, num_extra_draft_tokens=settings.num_extra_draft_tokens,
            draft_token_budget=settings.draft_token_budget, pad_to_k=settings.pad_drafts_to_k,
            catch_up_tokens_per_job=settings.catch_up_tokens_per_job, in_flight=source.jobs,
            lookahead_backups=settings.lookahead_backup_drafts)
        self.auto_settings = auto_settings or AutoSettings(**{
            "k_candidates": tuple(range(1, self.max_num_speculative_tokens + 1)), **settings.auto})
        # Fed every step in every mode, so predictions are available (and exported) before auto mode is on.
        self.cost_model = CostModel()
        self.set_draft_length(settings.draft_length)
        self.async_steps = settings.async_steps
        self.auto: AutoController | None = None
        # Auto's controller while fixed modes run, resumed when auto is turned back on.
        self._auto_parked: AutoController | None = None
        if configured is Mode.AUTO:
            self.auto = self._new_auto_controller()
        self.wait_policy = WaitPolicy(cap_seconds=settings.deadline_seconds)
        # Lookahead: acceptance per position, bonus-token ranks and branch-job times per shape, measured here.
        self.lookahead_stats = LookaheadStats()
        self.lookahead_fanout = settings.lookahead_fanout
        # Branch jobs in flight (or abandoned and still to answer) -> the shape (fan-out, depth) they were sent with.
        self._lookahead_jobs: dict[int, tuple[int, int]] = {}
        # Lookahead: a branch job sent as its step was planned, before the host scheduled it (send_branches_early),
        # for commit() to take over; and whether hosts may do so (benchmarks compare both).
        self._sent_early: _Launched | None = None
        self.early_branch_jobs = True
        self.stats = StatsRecorder(settings.stats_history)
        self.check_invariants = settings.check_invariants
        # Steps scheduled and not yet updated, oldest first: one, or two while async PSD steps overlap.
        self._launched: deque[_Launched] = deque()
        # The newest step's timing: draft replies that arrive while it is scheduled are recorded in it (benchmarks
        # read its wait).
        self.timing = StepTiming()
        # An auto decision taken while a step scheduled ahead was in flight: applied once it is updated.
        self.pending_decision: Decision | None = None
        self._views: Sequence[RequestState] = ()
        self._last_update_finished = 0.0
        self._num_steps = 0
        # Auto's decisions applied (the statistics keep only the latest few).
        self.num_decisions = 0

    # -- read-only views --------------------------------------------------------------------------------------

    @property
    def k(self) -> int:
        return self.planner.k

    @property
    def num_extra_draft_tokens(self) -> int:
        return self.planner.num_extra_draft_tokens

    @property
    def subbatches(self) -> SubBatches:
        return self.planner.subbatches

    @property
    def configured_mode(self) -> Mode:
        return Mode.AUTO if self.auto is not None else self.chosen_mode

    @property
    def deadline_seconds(self) -> float:
        """The longest a step waits for drafts before anything is measured (a hang is the link's own setting)."""
        return self.wait_policy.cap_seconds

    @deadline_seconds.setter
    def deadline_seconds(self, seconds: float) -> None:
        self.wait_policy.cap_seconds = seconds

    def busy(self, after_oldest: bool = False) -> frozenset[str]:
        """Requests of steps scheduled and not yet updated: their next tokens are not known yet (hosts mark them
        not decoding in their views). `after_oldest`: of those after the oldest (the one being updated)."""
        launched = list(self._launched)[1:] if after_oldest else self._launched
        if not launched:
            return frozenset()
        return frozenset().union(*(step.request_ids for step in launched))

    def launched(self) -> tuple[StepDecision, ...]:
        """Decisions of the steps launched and not yet updated, oldest first (two while async steps overlap)."""
        return tuple(step.decision for step in self._launched)

    def known(self) -> set[str]:
        """Every request the core holds state of: the host reports which of them left (StepOutcome.gone/preempted,
        or `release`)."""
        return self.planner.known()

    # -- the step ---------------------------------------------------------------------------------------------

    def schedule(self, views: Sequence[RequestState], now: float | None = None) -> StepDecision:
        """`views`: the running requests, in the host's order, those of a step scheduled ahead not decoding."""
        timing = StepTiming(started_at=self.clock() if now is None else now)
        self.timing = timing
        self._views = views
        step_mode = self._step_mode()
        busy = self.busy()
        last = self._launched[-1] if self._launched else None
        if last is not None and step_mode is Mode.PSD and last.decision.verified_group is not None:
            # Async PSD steps: the step in flight verifies one sub-batch, this one the other.
            self.planner.turn = 1 - last.decision.verified_group
        group = self.planner.pick_group(views, step_mode)
        if self.planner.draft_lengths is not None:
            # (sd drafts in series with its verification: a deeper job delays the step; psd drafts beside it.)
            self.planner.draft_lengths.drafts_in_series = step_mode is Mode.SD
        if group is not None:
            self._await_drafts(group, timing)
        # With no draft job in flight nothing drafts during this verification (ar; sd; psd with one side empty): the
        # target may compute on the drafter's cores too. Scheduled ahead, the step in flight's sub-batch is sent its
        # job while this one verifies, so nothing is lent.
        timing.draft_jobs_in_flight = len(self.source.jobs)
        jobs_or_ahead = bool(self.source.jobs) or last is not None
        # (Lookahead drafts the next round during every verification: its job is sent once the step is launched.)
        widen = (should_widen(step_mode is Mode.AR, jobs_or_ahead, self.source.loading)
                 and step_mode is not Mode.LOOKAHEAD)
        plan = self.planner.plan(views, step_mode, group, pad=self.auto is None, reader=self.tokens, busy=busy)
        if step_mode is Mode.LOOKAHEAD and plan.branch_misses and self.settings.lookahead_refresh_misses:
            plan = self._refresh_misses(plan, views, timing)
        held = plan.held_out | busy if busy else plan.held_out
        return StepDecision(plan, held, widen, views)

    def send_branches_early(self, decision: StepDecision) -> bool:
        """Lookahead: send the next round's branch job as soon as the step is planned, before the host's own
        scheduling (vLLM's, a few tenths of a millisecond a step on a CPU), through which the drafter would otherwise
        idle: in lookahead the drafter's next job can only go out once the job just waited for has answered, so
        whatever runs between that answer and the send is time the drafter does not draft. The host calls this only
        where no request can complete its prompt in the step (none mid-prompt, none waiting): such a request's root
        is known only once the host has scheduled. The job is built from the plan (every decoding request not held
        runs, with the proposals planned); a request the host then leaves out gets branches nobody takes, which costs
        drafter time, never correctness (a branch is a proposal). True if sent: commit() then sends none."""
        self._sent_early = None
        if decision.step_mode is not Mode.LOOKAHEAD or not self.early_branch_jobs:
            return False
        launched = _Launched(decision, self.timing, frozenset())
        self._submit_branches(launched, None)
        self._sent_early = launched
        return True

    def commit(self, decision: StepDecision, request_ids: Iterable[str],
               verified: Mapping[str, list[int]] | None = None, now: float | None = None,
               finishing: Sequence[RequestState] = ()) -> None:
        """The host launched the step: `request_ids` run in it (with `verified`'s proposals: checked against the
        plan with check_invariants); `finishing`: requests whose prompt the step completes (their first token is
        sampled in it: lookahead drafts their roots beside it, so their first decode step can have a branch)."""
        timing = self.timing
        timing.scheduled_at = self.clock() if now is None else now
        timing.scheduled_ahead = bool(self._launched)
        launched = _Launched(decision, timing, frozenset(request_ids))
        self._launched.append(launched)
        if self.check_invariants and verified is not None:
            self.planner.check_step(decision.plan, decision.views, verified)
        early, self._sent_early = self._sent_early, None
        if early is not None and early.decision is decision:
            launched.verified, launched.num_branches = early.verified, early.num_branches
            launched.fanout, launched.depth = early.fanout, early.depth
        elif decision.step_mode is Mode.LOOKAHEAD:
            # The drafter drafts the next round while the target verifies this one.
            self._submit_branches(launched, verified, finishing)

    def update(self, decision: StepDecision, outcome: StepOutcome, now: float | None = None) -> StepRecord:
        """The step's outcome is in (the host committed its tokens): returns the step's record."""
        launched = self._launched.popleft()
        if launched.decision is not decision:
            raise AssertionError("update() for a step other than the oldest one scheduled")
        timing, plan = launched.timing, decision.plan
        step_mode, group = plan.step_mode, plan.verified_group
        drafted_per_position: list[int] = []
        accepted_per_position: list[int] = []
        num_draft = num_accepted = num_pad = num_with_drafts = 0
        num_sampled = outcome.num_sampled
        drafted_lengths = plan.drafted_lengths
        for request_id, spec in outcome.verified.items():
            sampled = num_sampled.get(request_id)
            if sampled is None:
                continue
            # Padding only fixes the batch's shape: acceptance counts the drafted tokens.
            drafted = min(len(spec), drafted_lengths.get(request_id, 0))
            num_pad += len(spec) - drafted
            if not drafted:
                continue
            accepted = min(drafted, max(0, sampled - 1))
            num_with_drafts += 1
            num_draft += drafted
            num_accepted += accepted
            _bump(drafted_per_position, drafted)
            _bump(accepted_per_position, accepted)
        bonus = self._learn_lookahead(launched, outcome) if launched.verified else (0, 0, 0, 0)
        if step_mode in (Mode.PSD, Mode.SD):
            self._learn_draft_lengths(plan, outcome)
        subbatches = self.planner.subbatches
        num_verified_members = sum(
            1 for rid in outcome.decoded if subbatches.group_of(rid) == group) if group is not None else 0
        self.release(outcome.gone, outcome.preempted)
        views = self._views = outcome.views
        self.planner.after_step(views, step_mode, group, self.chosen_mode)
        if step_mode in (Mode.PSD, Mode.SD) and group is not None:
            self._submit(group, views)
            if self._launched and group in self.source.jobs:
                # The next step, scheduled ahead, verifies while this job drafts.
                self._launched[-1].timing.draft_jobs_in_flight += 1
        if self.check_invariants:
            self.planner.check_invariants(views, set(outcome.alive), self.chosen_mode)

        finished = self.clock() if now is None else now
        job = timing.drafts_by_group.get(group, JobTimes()) if group is not None else JobTimes()
        verify_seconds = (outcome.worker_seconds if outcome.worker_seconds is not None
                          else max(0.0, outcome.verify_done_at - timing.scheduled_at))
        if step_mode is not Mode.AR:
            self.wait_policy.observe_verify(verify_seconds)
        self._num_steps += 1
        record = StepRecord(
            step=self._num_steps,
            started_at=timing.started_at,
            mode=step_mode.value,
            verified_group=group,
            group_sizes=subbatches.sizes(),
            num_decode_requests=len(outcome.decoded),
            num_prefill_requests=outcome.num_prefill_requests,
            num_requests_with_drafts=num_with_drafts,
            num_draft_tokens=num_draft,
            num_accepted_tokens=num_accepted,
            drafted_per_position=tuple(drafted_per_position),
            accepted_per_position=tuple(accepted_per_position),
            num_output_tokens=(sum(num_sampled.values()) if outcome.num_output_tokens is None
                               else outcome.num_output_tokens),
            num_scheduled_tokens=outcome.num_scheduled_tokens,
            verify_seconds=verify_seconds,
            wait_seconds=timing.wait_seconds,
            draft_seconds=job.draft_seconds,
            draft_first_token_seconds=job.first_token_seconds,
            drafter_idle_seconds=job.idle_seconds,
            schedule_seconds=max(0.0, timing.scheduled_at - timing.started_at - timing.wait_seconds),
            # Steps scheduled ahead overlap: each counts from the previous step's end, so the steps' times add up to
            # the wall time.
            step_seconds=finished - max(timing.started_at, self._last_update_finished),
            drafter_up=self.source.up,
            k=self.k,
            draft_token_budget=plan.draft_token_budget or 0,
            auto=self.auto is not None,
            widened=outcome.widened,
            draft_jobs_in_flight=timing.draft_jobs_in_flight,
            num_held_out=len(plan.held_out),
            num_verified_members=num_verified_members,
            num_pad_tokens=num_pad,
            wait_budget_seconds=timing.wait_budget_seconds,
            update_seconds=(max(0.0, finished - outcome.verify_done_at) if outcome.update_seconds is None
                            else outcome.update_seconds),
            draft_job_requests=job.requests,
            draft_job_length=job.length,
            draft_job_catch_up_tokens=job.catch_up_tokens,
            scheduled_ahead=timing.scheduled_ahead or outcome.overlapped,
            num_branches_drafted=launched.num_branches,
            num_branch_hits=sum(1 for rid in plan.branches
                                if rid in num_sampled and rid not in plan.backups and rid not in plan.refreshed),
            num_branch_misses=sum(1 for rid in plan.branch_misses if rid in num_sampled),
            num_refreshed=sum(1 for rid in plan.refreshed if rid in num_sampled),
            refresh_seconds=timing.refresh_seconds,
            num_bonus_after_full=bonus[0],
            num_bonus_covered_after_full=bonus[1],
            num_bonus_after_reject=bonus[2],
            num_bonus_covered_after_reject=bonus[3],
            lookahead_fanout=launched.fanout,
            lookahead_depth=launched.depth,
        )
        self._last_update_finished = finished
        if self.planner.draft_lengths is not None and step_mode in (Mode.PSD, Mode.SD) and record.num_decode_requests:
            self.planner.draft_lengths.observe_step(record.step_seconds, verify_seconds, timing.wait_seconds)
        if step_mode is Mode.LOOKAHEAD and outcome.decoded:
            at_once = [outcome.num_sampled[rid] for rid in plan.branch_misses
                       if rid in outcome.num_sampled and rid not in plan.refreshed]
            self.lookahead_stats.observe_miss_tokens(sum(at_once), len(at_once))
            # (Without a refresh's wait: what a step costs when its misses are verified at once.)
            self.lookahead_stats.observe_step(record.step_seconds - timing.refresh_seconds, record.update_seconds)
        self.stats.record(record)
        self._control(record, views, outcome.overlapped)
        return record

    def _learn_draft_lengths(self, plan: PlannedStep, outcome: StepOutcome) -> None:
        """Adaptive draft lengths: each decoding request's drafted and accepted tokens (0, 0 without drafts)."""
        if self.planner.draft_lengths is None:
            return
        for request_id in outcome.decoded:
            sampled = outcome.num_sampled.get(request_id)
            if sampled is None:
                continue
            spec = outcome.verified.get(request_id, ())
            drafted = min(len(spec), plan.drafted_lengths.get(request_id, 0))
            self.planner.observe_acceptance(request_id, drafted, min(drafted, max(0, sampled - 1)))

    def _learn_lookahead(self, launched: _Launched, outcome: StepOutcome) -> tuple[int, int, int, int]:
        """Acceptance per position and the bonus token's rank among the candidates, from a lookahead step's outcome
        (requests still running: a finished one's tokens are gone). Returns (after a full acceptance: verifications,
        bonus covered by the top-F; after a rejection: the same)."""
        stats = self.lookahead_stats
        running = {view.request_id for view in outcome.views}
        counts = [0, 0, 0, 0]
        for request_id, verified in launched.verified.items():
            sampled = outcome.num_sampled.get(request_id)
            if sampled is None or request_id not in running:
                continue
            stats.observe_acceptance(len(verified.drafted), max(0, sampled - 1))
            committed = self.tokens(request_id, verified.num_tokens, verified.num_tokens + sampled)
            found = bonus_rank(verified, sampled, committed)
            if found is None:
                continue
            full, rank = found
            (stats.after_full if full else stats.after_reject).observe(rank)
            at = 0 if full else 2
            counts[at] += 1
            counts[at + 1] += rank is not None
        return counts[0], counts[1], counts[2], counts[3]

    def may_schedule_ahead(self, is_decoding: Callable[[str], bool]) -> bool:
        """Whether the next step may be scheduled now, before the one step in flight has been updated.

        Only in psd (fixed, or auto's choice) with the drafter up, the step in flight verifying one sub-batch and the
        other holding decoding requests outside it (`is_decoding`: the host's view of a request): those are what the
        next step verifies, their tokens final since the step before. Not in sd or ar (every step verifies the
        requests the step in flight is making tokens for), not with one side empty (psd then runs sequential sd on
        the other), and not while an auto decision waits for the step in flight to drain. Auto reads such steps
        apart (StepRecord.scheduled_ahead: its cost model learns their unhidden host work on its own)."""
        if (not self.async_steps or len(self._launched) != 1 or self.chosen_mode is not Mode.PSD
                or self.pending_decision is not None):
            return False
        step = self._launched[0]
        group = step.decision.verified_group
        if step.decision.step_mode is not Mode.PSD or group is None or not self.source.up:
            return False
        busy = step.request_ids
        return any(rid not in busy and is_decoding(rid) for rid in self.planner.subbatches.members(1 - group))

    def release(self, gone: Collection[str], preempted: Collection[str] = ()) -> None:
        """Requests that left the running set: finished or aborted ones lose their state (planner.forget, the one
        cleanup path, and the drafter's copy of their tokens); preempted ones only their sub-batch slot."""
        if preempted:
            self.planner.leave_sub_batches(preempted)
        if gone:
            self.source.forget(self.planner.forget(gone))

    # -- control (between steps) -------------------------------------------------------------------------------

    def set_mode(self, mode: Mode, k: int | None = None, num_extra_draft_tokens: int | None = None,
                 auto_settings: AutoSettings | None = None) -> None:
        """The operator's switch (auto on or off, a fixed mode, k, e) at the next step boundary."""
        plain = k is None and num_extra_draft_tokens is None and auto_settings is None
        if mode is Mode.AUTO and plain and self.auto is not None:
            return
        # The operator's setting supersedes a decision of auto's still waiting for a step in flight.
        self.pending_decision = None
        if mode is Mode.AUTO:
            parked, self._auto_parked = self._auto_parked, None
            if plain and parked is not None:
                # Back on after fixed modes: carry on from its last choice with all it learned.
                resumed_mode, resumed_k = parked.resume()
                self._apply_mode(Mode(resumed_mode), None if resumed_mode == Mode.AR.value else resumed_k)
                self.auto = parked
                return
            if auto_settings is not None:
                if max(auto_settings.k_candidates) > self.max_num_speculative_tokens:
                    raise ValueError(f"k_candidates: at most {self.max_num_speculative_tokens} "
                                     "(max_num_speculative_tokens)")
                self.auto_settings = auto_settings
            # (Auto chooses among psd, sd and ar: turned on from lookahead it starts from psd, as a configured auto
            # does.)
            start = Mode.PSD if self.chosen_mode is Mode.LOOKAHEAD else self.chosen_mode
            self._apply_mode(start, k, num_extra_draft_tokens)
            self.auto = self._new_auto_controller()
            return
        self._apply_mode(mode, k, num_extra_draft_tokens)
        if self.auto is not None:
            self._auto_parked, self.auto = self.auto, None

    def set_draft_length(self, draft_length: str) -> None:
        """--draft-length, at a step boundary: "adaptive" gives sd and psd each request's own draft length and each
        step a verify budget (psd/verify_budget.py), priced by the verify and draft seconds measured here; "fixed"
        drafts and verifies k."""
        if draft_length not in ("fixed", "adaptive"):
            raise ValueError(f"draft_length: expected fixed or adaptive, got {draft_length!r}")
        self.planner.draft_lengths = (
            DraftLengthPolicy(self.planner.k, self.cost_model.verify_seconds_at, self.cost_model.draft_seconds_at)
            if draft_length == "adaptive" else None)

    def _new_auto_controller(self) -> AutoController:
        # A private cost model learns only from auto's own steps (benchmarks: auto pays for all it knows).
        cost_model = self.cost_model if self.auto_settings.learn_from_fixed_modes else CostModel()
        cost_model.async_psd_steps = self.async_steps
        return AutoController(self.auto_settings, self.chosen_mode.value, self.k, cost_model)

    def _apply_mode(self, mode: Mode, k: int | None = None, num_extra_draft_tokens: int | None = None) -> None:
        """Switch at a step boundary: only sub-batch membership and draft lengths change, never a request's tokens
        (drafts held for the old setting stay valid: they are keyed by context length and trimmed to k + e)."""
        if mode is Mode.VLLM_SD:
            raise ValueError("mode: vllm-sd needs an engine built for it; it cannot be switched to at run time")
        most = self.max_num_speculative_tokens
        new_k = self.k if k is None else k
        new_e = self.num_extra_draft_tokens if num_extra_draft_tokens is None else num_extra_draft_tokens
        if not 1 <= new_k <= most:
            raise ValueError(f"num_speculative_tokens: {new_k} is outside 1..{most}")
        if not 0 <= new_e <= most - new_k:
            raise ValueError(f"num_extra_draft_tokens: {new_e} is outside 0..{most - new_k} (k + e <= {most}, the "
                             "engine's max_num_speculative_tokens)")
        self.planner.switch_mode(self.chosen_mode, mode, new_k, new_e)
        self.chosen_mode = mode

    def _control(self, record: StepRecord, views: Sequence[RequestState], overlapped: bool) -> None:
        """Feed the cost model and auto; apply auto's decision now, or once the step scheduled ahead is updated."""
        self.cost_model.async_psd_steps = self.async_steps
        if self.auto is None:
            self.cost_model.observe(record)
            return
        self.auto.cost_model.async_psd_steps = self.async_steps
        busy = self.busy()
        num_running = sum(1 for view in views if view.decoding or view.request_id in busy)
        decision = self.auto.on_step(record, num_running)
        if self.pending_decision is not None and not self._launched:
            # The step that was in flight at the decision is done: switch now, before anything is scheduled.
            self._apply_decision(self.pending_decision)
            self.pending_decision = None
        if decision is not None:
            if self._launched or overlapped:
                # A step scheduled ahead is in flight, planned for the current setting: drain it first (no more steps
                # are scheduled ahead meanwhile) and switch once its output is in.
                self.pending_decision = decision
            else:
                self._apply_decision(decision)
        if self.auto.cost_model is not self.cost_model:
            self.cost_model.observe(record)

    def _apply_decision(self, decision: Decision) -> None:
        mode = Mode(decision.mode)
        self._apply_mode(mode, decision.k if mode is not Mode.AR else None)
        if (decision.mode, decision.k) != (decision.previous_mode, decision.previous_k):
            # (Keeping what a probe ran is a decision too, but not a switch.)
            self.stats.count(mode_switches=1)
        self.stats.record_decision(decision)
        self.num_decisions += 1
        log.info("auto: %s k=%d -> %s k=%d (%s)", decision.previous_mode, decision.previous_k, decision.mode,
                 decision.k, decision.reason)

    # -- the drafter ------------------------------------------------------------------------------------------

    def poll_drafter(self, timeout_seconds: float = 0.0) -> None:
        """Take in the drafter's answers between steps (waiting at most `timeout_seconds` for one)."""
        self._handle(self.source.poll(timeout_seconds))

    def _step_mode(self) -> Mode:
        if self.chosen_mode is Mode.AR or not self.source.attached:
            return Mode.AR
        self._handle(self.source.poll(0.0))
        alive = self.source.check()  # (a drafter found down drops its jobs in flight)
        self._handle(self.source.take_events())
        # Without a drafter, verifying half the batch per step would only halve throughput.
        return self.chosen_mode if alive else Mode.AR

    def _await_drafts(self, group: int, timing: StepTiming) -> None:
        if not self.source.jobs.coming(group):
            return  # nothing drafted is coming (no job, or catch-up chunks only): verify now, the job runs on
        budget = self.wait_policy.budget_seconds()
        timing.wait_budget_seconds = budget
        result = self.source.wait_for(group, budget)
        self._handle(result.events)
        # (+=: a lookahead step may wait twice, for its branch job and for a refresh of its misses.)
        timing.wait_seconds += result.waited_seconds
        self._handle(self.source.take_events())
        if group in self.source.jobs:
            # Later than the step is expected to take: verify this sub-batch without drafts now (plain decoding, one
            # step) instead of holding the whole replica. The drafter skips the job but keeps the requests' tokens
            # and KV, so the next job is a small delta again.
            self.source.abandon(group)
            self.stats.count(deadline_misses=1)
            log.debug("drafts for sub-batch %d later than %.3fs: verifying without them", group, budget)

    def _submit(self, group: int, views: Sequence[RequestState]) -> None:
        source = self.source
        if not source.attached or not source.up:
            return
        self._handle(source.take_events())
        self.planner.drafter_max_tokens = source.max_context_tokens
        plans = self.planner.draft_job(views, group)
        if not plans:
            return
        if source.submit(group, plans, self.tokens, want_logprobs=self.num_extra_draft_tokens > 0):
            self.planner.job_sent(plans)
        else:
            self._handle(source.take_events())

    def _refresh_misses(self, plan: PlannedStep, views: Sequence[RequestState], timing: StepTiming) -> PlannedStep:
        """A lookahead step whose requests missed: where it pays (lookahead.refresh_pays), draft the missed ones from
        their real context now (roots for exactly their committed tokens, with candidates for the next round's
        outcomes) and wait for that draft, then verify them with it; else, or if it comes too late, `plan` as is
        (backups, or no drafts)."""
        source, planner = self.source, self.planner
        if not source.attached or not source.up or 0 in source.jobs:
            return plan
        num_running = sum(1 for view in views if view.decoding)
        if not refresh_pays(num_running, len(plan.branch_misses), self.lookahead_stats, self.k):
            return plan
        misses = plan.branch_misses
        planner.drafter_max_tokens = source.max_context_tokens
        items = planner.lookahead_job(views, misses.__contains__, {rid: [()] for rid in misses}, fresh=True)
        if not items:
            return plan
        sent_at = self.clock()
        if not source.submit(0, items, self.tokens, want_logprobs=False, top_f=self.lookahead_fanout):
            self._handle(source.take_events())
            return plan
        planner.job_sent(items)
        self._await_drafts(0, timing)
        waited = self.clock() - sent_at
        timing.refresh_seconds += waited
        self.lookahead_stats.observe_refresh(waited)
        if 0 in source.jobs:
            return plan
        return planner.refresh(plan, views, self.auto is None, self.tokens)

    def _submit_branches(self, launched: _Launched, verified: Mapping[str, list[int]] | None,
                         finishing: Sequence[RequestState] = ()) -> None:
        """The next round's branch job, sent as a lookahead step is launched: each request's likeliest outcomes of
        this verification (psd/lookahead.py), its root for one verified without drafts or whose prompt the step
        finishes."""
        source = self.source
        if not source.attached or not source.up:
            return
        self._handle(source.take_events())
        if 0 in source.jobs:
            # A job nothing waited for (catch-up chunks only): the drafter has taken its tokens in already.
            source.abandon(0)
        planner, decision = self.planner, launched.decision
        planner.drafter_max_tokens = source.max_context_tokens
        plan, held = decision.plan, decision.held
        ran = launched.request_ids
        # (A host that does not name the requests it ran, the twin: every decoding request not held out ran.)
        scheduled = ran.__contains__ if ran else (lambda rid: rid not in held)
        ranked: dict[str, list[Outcome]] = {}
        tails: dict[str, list[tuple[int, ...]]] = {}
        for view in finishing:
            # Its first token is sampled in this step: the root's first drafted token guesses it.
            tails[view.request_id] = [()]
        for view in decision.views:
            rid = view.request_id
            if not view.decoding or not scheduled(rid):
                continue
            if rid in plan.backups:
                # Its root, not outcomes of the backup: the backup's candidates follow a context the request does not
                # have (ranked from them, the next round missed again, and again: a chain of backups that never
                # drafted from the real context). A backup is mostly rejected at once, and the root's first drafted
                # token is the drafter's guess for the target's token then.
                tails[rid] = [()]
                continue
            spec = verified.get(rid, []) if verified is not None else plan.proposals.get(rid, [])
            drafted = tuple(spec[:plan.drafted_lengths.get(rid, 0)])
            branch = plan.branches.get(rid)
            candidates = branch[0].candidates[branch[1]:branch[1] + len(drafted) + 1] if branch else ()
            found = outcomes(rid, drafted, candidates, self.lookahead_stats, self.lookahead_fanout) \
                if drafted and candidates else []
            if found:
                ranked[rid] = found
                launched.verified[rid] = Verified(view.num_tokens, drafted, candidates)
            else:
                tails[rid] = [()]
        fanout, depth = choose_shape(ranked, self.lookahead_stats, self.lookahead_fanout, self.k,
                                     self.wait_policy.verify_seconds)
        for rid, chosen in allot(ranked, fanout * len(ranked)).items():
            tails[rid] = [outcome.tail for outcome in chosen]
        finishing_ids = frozenset(view.request_id for view in finishing)
        views = [*(v for v in decision.views if v.request_id not in finishing_ids), *finishing]
        items = planner.lookahead_job(views, scheduled, tails, finishing_ids, depth)
        if not items:
            return
        if source.submit(0, items, self.tokens, want_logprobs=False, top_f=self.lookahead_fanout):
            planner.job_sent(items)
            launched.num_branches = sum(1 for item in items if item.tail)
            launched.fanout, launched.depth = fanout, depth
            job = source.jobs.get(0)
            if job is not None and ranked:
                # (Priced by the shape it was sent with once it answers, late or not; roots-only jobs are not.)
                self._lookahead_jobs[job.job_id] = (fanout, depth)
                while len(self._lookahead_jobs) > 64:  # (jobs a replaced drafter never answered)
                    del self._lookahead_jobs[next(iter(self._lookahead_jobs))]
        else:
            self._handle(source.take_events())

    def _handle(self, events: Iterable[DrafterEvent]) -> None:
        """Each drafter event, in one place."""
        planner = self.planner
        for event in events:
            if isinstance(event, DraftsArrived):
                planner.need_full_context(event.need_context)
                # Late replies count too: a drafter slower than the budget would otherwise never be measured, every
                # job abandoned, and the budget never grow to fit it.
                self.wait_policy.observe_draft(event.draft_seconds)
                shape = self._lookahead_jobs.pop(event.job_id, None)
                if shape is not None:
                    # (A lookahead job's price, late or not: the late ones are the dear ones.)
                    self.lookahead_stats.observe_job(event.draft_seconds, shape)
                job = event.job
                if job is None:
                    continue  # a job abandoned after its deadline: its drafts are stale
                by_group = self.timing.drafts_by_group
                by_group[job.group] = by_group.get(job.group, JobTimes()).add(event, job.catch_up_tokens)
                # (Drafts of requests forgotten meanwhile are dropped: the planner keeps records of live ones only.)
                if self.chosen_mode is Mode.LOOKAHEAD or any(d.tail or d.candidates for _, d in event.drafts):
                    planner.store_branches(event.drafts, planner.records.__contains__)
                else:
                    planner.store_drafts(event.drafts, planner.records.__contains__)
            elif isinstance(event, JobFailed):
                self._job_failed(event)
            elif isinstance(event, DrafterBusy):
                # A shared drafter service pushed back: this sub-batch is verified without drafts now; counted, so
                # metrics show a saturated service.
                self.stats.count(drafter_busy=1)
            elif isinstance(event, JobHung):
                num_tokens = {view.request_id: view.num_tokens for view in self._views}
                quarantined = planner.job_hung(event.carried, num_tokens)
                if quarantined:
                    log.warning("no more drafts for %s: the drafter hung on their context %d times", quarantined,
                                QUARANTINE_AFTER_HANGS)
            elif isinstance(event, DrafterRestarted):
                planner.drafter_restarted()

    def _job_failed(self, event: JobFailed) -> None:
        self.stats.count(drafter_errors=1)
        log.error("draft job %d failed in the drafter: %s", event.job_id, event.message)
        job = event.job
        if event.drafter_broken or self.planner.blames_the_drafter(job, event.culprits):
            # Not a poison request: the drafter fails whatever it is given. Restart it; blame nobody. (Not for a job
            # no longer tracked: one abandoned, or one of a process already being replaced; the next job of a
            # still-broken drafter says so again.)
            if job is not None:
                self.planner.drafter_failed(job)
                self.source.drafter_failed(f"draft job {event.job_id} failed for every request: {event.message}")
            return
        quarantined = self.planner.job_failed(job, event.culprits)
        if quarantined:
            log.warning("no more drafts for %s: every job that carried them failed", quarantined)
        if not event.culprits:
            self.source.job_failed_unattributed()


def _bump(counts: list[int], upto: int) -> None:
    if len(counts) < upto:
        counts.extend([0] * (upto - len(counts)))
    for i in range(upto):
        counts[i] += 1
