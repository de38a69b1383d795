"""vLLM V1 scheduler subclass that runs batch-parallel speculative decoding: a thin adapter.

The decisions live in minedraft/engine/psd/planner.py (pure, over plain dataclasses) and the drafter plumbing in
minedraft/engine/drafter/link.py; this class translates between them and vLLM's Request objects. Per step:
  schedule():            the planner picks the sub-batch whose turn it is; wait for its drafts at most the planner's
                         budget (a fraction of a measured step; a late job is abandoned and the sub-batch decodes
                         without drafts this once); attach the planned proposals; hold out the other sub-batch's
                         requests whose drafts are coming (vLLM's per-request `next_decode_eligible_step`).
  (target verifies)      vLLM's rejection sampler, proposals treated as deterministic: lossless.
  update_from_output():  commit accepted tokens (vLLM), then send the just-verified sub-batch's newly committed tokens
                         (deltas) to the drafter, which drafts it while the next step verifies the other sub-batch.

Drafts are keyed by the context length they were made from and used only if the request still has exactly that
many tokens: nothing is drafted on unverified tokens and nothing needs rolling back.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from minedraft.engine.control.auto import AutoController, AutoSettings, Decision
from minedraft.engine.control.cost_model import CostModel
from minedraft.engine.control.stats import StatsRecorder, StepRecord
from minedraft.engine.drafter import protocol
from minedraft.engine.drafter.client import DrafterClient, DrafterState
from minedraft.engine.drafter.link import DrafterLink, JobTimes, add_reply
from minedraft.engine.placement import ComputePlacement, should_widen
from minedraft.engine.psd.inflight import JobInFlight
from minedraft.engine.psd.planner import (
    DEFAULT_CATCH_UP_TOKENS_PER_JOB,
    QUARANTINE_AFTER_HANGS,
    Draft,
    PlannedStep,
    PSDPlanner,
    RequestState,
    WaitPolicy,
)
from minedraft.engine.psd.subbatch import SubBatches
from minedraft.engine.settings import DEFAULT_HANG_SECONDS, Mode
from minedraft.engine.vllm_adapter.resident_batches import skip_token_resend

log = logging.getLogger(__name__)

CONFIG_KEY = "minedraft"




@dataclass
class _StepTiming:
    started_at: float = 0.0
    wait_seconds: float = 0.0
    wait_budget_seconds: float = 0.0
    scheduled_at: float = 0.0
    draft_seconds: float = 0.0
    draft_first_token_seconds: float = 0.0
    drafter_idle_seconds: float = 0.0
    draft_jobs_in_flight: int = 0
    scheduled_ahead: bool = False
    # (draft, first-token, drafter-idle seconds) of the replies that arrived during this step, by sub-batch: the step
    # records only the verified sub-batch's (the job whose drafts it verified). Around a switch the other side's job
    # lands in the same step; summed in, it priced a draft of one sub-batch at two jobs' time in auto's cost model.
    drafts_by_group: dict[int, JobTimes] = field(default_factory=dict)


@dataclass
class _ScheduledStep:
    """What update_from_output needs of a step scheduled and not yet processed (two with async PSD steps)."""

    timing: _StepTiming
    plan: PlannedStep
    step_mode: Mode
    verified_group: int | None
    # Requests the step runs: none of them may be scheduled again before its output is processed.
    request_ids: frozenset[str]


def _is_decoding(request: Request) -> bool:
    """Past its prompt and holding exactly one uncomputed (just sampled) token: ready to decode or be drafted."""
    return (
        request.status == RequestStatus.RUNNING
        and request.num_output_tokens > 0
        and request.num_computed_tokens == request.num_tokens - 1
    )


class PSDScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        additional: Any = self.vllm_config.additional_config
        config = dict(additional.get(CONFIG_KEY, {}))
        configured_mode = Mode(config.get("mode", Mode.PSD.value))
        # The chosen mode: the concrete mode of the coming steps (psd, sd or ar); auto changes it by its decisions.
        # A step runs in its step mode: this one, or ar while the drafter is down (_step_mode).
        self.chosen_mode: Mode = Mode.PSD if configured_mode is Mode.AUTO else configured_mode
        self.planner = PSDPlanner(
            k=int(config.get("num_speculative_tokens", self.num_spec_tokens)),
            num_extra_draft_tokens=int(config.get("num_extra_draft_tokens", 0)),
            draft_token_budget=config.get("draft_token_budget"),
            pad_to_k=bool(config.get("pad_drafts_to_k", True)),
            catch_up_tokens_per_job=int(config.get("catch_up_tokens_per_job", DEFAULT_CATCH_UP_TOKENS_PER_JOB)),
        )
        self.auto_settings = AutoSettings(**{
            "k_candidates": tuple(range(1, self.num_spec_tokens + 1)),
            **config.get("auto", {}),
        })
        # Fed every step in every mode, so predictions are available (and exported) before auto mode is on.
        self.cost_model = CostModel()
        self.auto: AutoController | None = None
        # Auto's controller while fixed modes run, resumed when auto is turned back on.
        self._auto_parked: AutoController | None = None
        if configured_mode is Mode.AUTO:
            self.auto = self._new_auto_controller()
        deadline_seconds = float(config.get("deadline_seconds", 5.0))
        self.wait_policy = WaitPolicy(cap_seconds=deadline_seconds)
        self.check_invariants = bool(config.get("check_invariants", False))
        # With the model runner's resident sub-batches (set by the engine): no re-sending of whole contexts either.
        self.resident_sub_batches = bool(config.get("resident_sub_batches", True))
        self.stats = StatsRecorder(int(config.get("stats_history", 4096)))
        # Steps scheduled and not yet processed, oldest first: one, or two while async PSD steps overlap.
        self._scheduled: deque[_ScheduledStep] = deque()
        # The newest scheduled step's timing: draft replies that arrive while it is scheduled are recorded in it.
        self._timing = _StepTiming()
        # Async PSD steps (the engine's OverlappedSteps asks may_schedule_ahead): off unless the engine turns it on.
        self.async_steps = bool(config.get("async_steps", False))
        # Set by OverlappedSteps before each update: the seconds the model runner spent on the step (the engine
        # thread's own clock would include scheduling the next step).
        self.worker_seconds: float | None = None
        # An auto decision taken while a step scheduled ahead was still in flight: applied once that step's output is
        # processed (the queue drained), never under a step planned for the setting it leaves.
        self._pending_decision: Decision | None = None
        self._last_update_finished = 0.0
        self._num_steps = 0
        # The link writes the draft jobs in flight; the planner reads the same object (one owner, no copies).
        self.link = DrafterLink(None, hang_seconds=float(config.get("hang_seconds", DEFAULT_HANG_SECONDS)),
                                max_failed_jobs=int(config.get("max_missed_deadlines", 3)), jobs=self.planner.in_flight)
        self.placement = ComputePlacement(tuple(config.get("target_cpu_cores", ())),
                                          tuple(config.get("lend_cpu_cores", ())))
        drafter_settings = config.get("drafter")
        if config.get("drafter_prestarted"):
            pass  # the in-process Engine started it in parallel with model loading and attaches it next
        elif drafter_settings and self.chosen_mode is not Mode.AR:
            drafter = DrafterClient(
                drafter_settings,
                restart=bool(config.get("drafter_restart", True)),
                startup_timeout_seconds=float(config.get("drafter_startup_timeout_seconds", 300.0)),
            )
            drafter.start()
            self.link.attach(drafter)
        elif self.chosen_mode is not Mode.AR:
            log.warning("no drafter configured: serving without drafts")

    # -- views the engine and tests read --------------------------------------------------------------------------

    @property
    def drafter(self) -> DrafterClient | None:
        return self.link.client

    @property
    def subbatches(self) -> SubBatches:
        return self.planner.subbatches

    @property
    def drafts(self) -> dict[str, Draft]:
        return self.planner.drafts

    @property
    def k(self) -> int:
        return self.planner.k

    @property
    def num_extra_draft_tokens(self) -> int:
        return self.planner.num_extra_draft_tokens

    @property
    def deadline_seconds(self) -> float:
        """The longest a step waits for drafts (before anything is measured); a hang is drafter.hang_seconds."""
        return self.wait_policy.cap_seconds

    @deadline_seconds.setter
    def deadline_seconds(self, seconds: float) -> None:
        self.wait_policy.cap_seconds = seconds

    # -- control (called between steps by the engine thread) -------------------------------------------------

    @property
    def configured_mode(self) -> Mode:
        return Mode.AUTO if self.auto is not None else self.chosen_mode

    def set_mode(
        self,
        mode: Mode,
        k: int | None = None,
        num_extra_draft_tokens: int | None = None,
        auto_settings: AutoSettings | None = None,
    ) -> None:
        plain = k is None and num_extra_draft_tokens is None and auto_settings is None
        if mode is Mode.AUTO and plain and self.auto is not None:
            return
        # The operator's setting supersedes a decision of auto's still waiting for a step in flight.
        self._pending_decision = None
        if mode is Mode.AUTO:
            parked, self._auto_parked = self._auto_parked, None
            if plain and parked is not None:
                # Back on after fixed modes: carry on from its last choice with all it learned.
                resumed_mode, resumed_k = parked.resume()
                self._apply_mode(Mode(resumed_mode), None if resumed_mode == Mode.AR.value else resumed_k)
                self.auto = parked
                return
            if auto_settings is not None:
                if max(auto_settings.k_candidates) > self.num_spec_tokens:
                    raise ValueError(f"k_candidates: at most {self.num_spec_tokens} (max_num_speculative_tokens)")
                self.auto_settings = auto_settings
            self._apply_mode(self.chosen_mode, k, num_extra_draft_tokens)
            self.auto = self._new_auto_controller()
            return
        self._apply_mode(mode, k, num_extra_draft_tokens)
        if self.auto is not None:
            self._auto_parked, self.auto = self.auto, None

    def _new_auto_controller(self) -> AutoController:
        # A private cost model learns only from auto's own steps (benchmarks: auto pays for all it knows).
        cost_model = self.cost_model if self.auto_settings.learn_from_fixed_modes else CostModel()
        return AutoController(self.auto_settings, self.chosen_mode.value, self.k, cost_model)

    def _apply_mode(self, mode: Mode, k: int | None = None, num_extra_draft_tokens: int | None = None) -> None:
        """Switch at a step boundary: only sub-batch membership and draft lengths change, never a request's tokens
        (drafts held for the old setting stay valid: they are keyed by context length and trimmed to k + e)."""
        if mode is Mode.VLLM_SD:
            raise ValueError("mode: vllm-sd needs an engine built for it; it cannot be switched to at run time")
        new_k = self.k if k is None else k
        new_e = self.num_extra_draft_tokens if num_extra_draft_tokens is None else num_extra_draft_tokens
        if not 1 <= new_k <= self.num_spec_tokens:
            raise ValueError(f"num_speculative_tokens: {new_k} is outside 1..{self.num_spec_tokens}")
        if not 0 <= new_e <= self.num_spec_tokens - new_k:
            raise ValueError(
                f"num_extra_draft_tokens: {new_e} is outside 0..{self.num_spec_tokens - new_k} (k + e <= "
                f"{self.num_spec_tokens}, the engine's max_num_speculative_tokens)"
            )
        self.planner.switch_mode(self.chosen_mode, mode, new_k, new_e)
        self.chosen_mode = mode

    def attach_drafter(self, drafter: DrafterClient) -> None:
        self.link.attach(drafter)

    @property
    def drafter_up(self) -> bool:
        return self.drafter is not None and self.drafter.state is DrafterState.UP

    # -- schedule ----------------------------------------------------------------------------------------------

    def _busy(self) -> frozenset[str]:
        """Requests of steps scheduled and not yet processed: their next tokens are not known yet."""
        if not self._scheduled:
            return frozenset()
        return frozenset().union(*(step.request_ids for step in self._scheduled))

    def _states(self, busy: frozenset[str] = frozenset()) -> list[RequestState]:
        max_len = self.max_model_len
        states = []
        for request in self.running:
            num_tokens = request.num_tokens
            pad_room = max_len - num_tokens - 1
            states.append(RequestState(
                request_id=request.request_id,
                num_tokens=num_tokens,
                decoding=_is_decoding(request) and request.request_id not in busy,
                draft_room=min(request.max_tokens - request.num_output_tokens - 1, pad_room),
                pad_room=pad_room,
                last_token_id=request.all_token_ids[-1] if num_tokens else 0,
            ))
        return states

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        timing = _StepTiming(started_at=time.perf_counter())
        self._timing = timing
        step_mode = self._step_mode()
        # Async PSD steps: the step in flight verifies one sub-batch, this one the other (may_schedule_ahead).
        busy = self._busy()
        if self._scheduled and step_mode is Mode.PSD and self._scheduled[-1].verified_group is not None:
            self.planner.turn = 1 - self._scheduled[-1].verified_group
        states = self._states(busy)
        verified_group = self.planner.pick_group(states, step_mode)
        if verified_group is not None:
            self._await_drafts(verified_group, timing)
        # With no draft job in flight nothing drafts during this verification (ar; sd; psd with one side empty):
        # the target may compute on the drafter's cores too. A job in flight (psd's other side) keeps them apart.
        timing.draft_jobs_in_flight = len(self.link.jobs)
        # Scheduled ahead (async PSD steps): the step in flight's sub-batch is sent its draft job when that step's
        # output is processed, while this step verifies, so nothing is lent. (Only this thread's cores: the model
        # thread stays on the target's own.)
        ahead = bool(self._scheduled)
        self.placement.apply(wide=should_widen(step_mode is Mode.AR, bool(self.link.jobs) or ahead,
                                               self.link.loading))

        plan = self.planner.plan(states, step_mode, verified_group, pad=self.auto is None)
        step_after_next = self.current_step + 2  # schedule() increments current_step before its running loop
        for request in self.running:
            request_id = request.request_id
            # A fresh list: vLLM trims spec_token_ids in place.
            request.spec_token_ids = list(plan.proposals.get(request_id, ()))
            # (A request in flight must not run again before its output is in. vLLM 0.32 skips a decoding one itself,
            # its new-token count being at most zero; a prompt's next chunk it would schedule: held too.)
            held = request_id in plan.held_out or request_id in busy
            request.next_decode_eligible_step = step_after_next if held else 0
        if self.resident_sub_batches:
            skip_token_resend(self)

        output = super().schedule(*args, **kwargs)
        timing.scheduled_at = time.perf_counter()
        timing.scheduled_ahead = bool(self._scheduled)
        self._scheduled.append(_ScheduledStep(timing, plan, step_mode, verified_group,
                                              frozenset(output.num_scheduled_tokens)))
        if self.check_invariants:
            self.planner.check_step(plan, states, output.scheduled_spec_decode_tokens)
        return output

    def may_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled now, before the one step in flight has been processed.

        Only in psd (fixed, or auto's choice) with the drafter up, the step in flight verifying one sub-batch and
        the other holding decoding requests outside it: those are what the next step verifies, their tokens final
        since the step before. Not in sd or ar (every step verifies the same requests, whose tokens the step in
        flight is making), not with one side empty (psd then runs sequential sd on the other), and not while an
        auto decision waits for the step in flight to drain. Auto reads such steps apart (StepRecord.scheduled_ahead:
        its cost model learns their unhidden host work on its own and prices psd by it)."""
        if (not self.async_steps or len(self._scheduled) != 1 or self.chosen_mode is not Mode.PSD
                or self._pending_decision is not None):
            return False
        step = self._scheduled[0]
        if step.step_mode is not Mode.PSD or step.verified_group is None or not self.drafter_up:
            return False
        busy = step.request_ids
        for request_id in self.subbatches.members(1 - step.verified_group):
            request = self.requests.get(request_id)
            if request is not None and request_id not in busy and _is_decoding(request):
                return True
        return False

    def _step_mode(self) -> Mode:
        if self.chosen_mode is Mode.AR or self.drafter is None:
            return Mode.AR
        self.link.poll(0.0, self._on_message)
        alive = self.link.check()  # (a drafter found down drops its jobs in flight)
        self._after_link_check()
        if not alive:
            # Without a drafter, verifying half the batch per step would only halve throughput.
            return Mode.AR
        return self.chosen_mode

    def _await_drafts(self, group: int, timing: _StepTiming) -> None:
        if not self.link.jobs.coming(group):
            # Nothing drafted is coming (no job, or a job of catch-up chunks only): verify now, the job runs on.
            return
        budget = self.wait_policy.budget_seconds()
        timing.wait_budget_seconds = budget
        result = self.link.wait_for(group, budget, self._on_message)
        timing.wait_seconds = result.waited_seconds
        self._after_link_check()
        if group in self.link.jobs:
            # Later than the step is expected to take: verify this sub-batch without drafts now (plain decoding,
            # one step) instead of holding the whole replica. The drafter skips the job but keeps the requests'
            # tokens and KV, so the next job is a small delta again.
            self.link.abandon(group)
            self.stats.count(deadline_misses=1)
            log.debug("drafts for sub-batch %d later than %.3fs: verifying without them", group, budget)

    def _after_link_check(self) -> None:
        hung = self.link.take_hung_job()
        if hung:
            num_tokens = {request.request_id: request.num_tokens for request in self.running}
            quarantined = self.planner.job_hung(hung, num_tokens)
            if quarantined:
                log.warning("no more drafts for %s: the drafter hung on their context %d times", quarantined,
                            QUARANTINE_AFTER_HANGS)
        if self.link.take_restarted():
            self.planner.drafter_restarted()

    def _on_message(self, job: JobInFlight | None, message: protocol.FromDrafter) -> None:
        """A message from the drafter; `job`: the job it answers (the link has taken it out of flight), None for one
        abandoned or sent to a replaced process."""
        if isinstance(message, protocol.DrafterError):
            self.stats.count(drafter_errors=1)
            log.error("draft job %d failed in the drafter: %s", message.job_id, message.message)
            if message.drafter_broken or self.planner.blames_the_drafter(job, message.request_ids):
                # Not a poison request: the drafter fails whatever it is given. Restart it; blame nobody. (Not for a
                # job no longer tracked: one abandoned, or one of a process already being replaced, whose other job
                # reported the same; the next job of a still-broken drafter says so again.)
                if job is not None:
                    self.planner.drafter_failed(job)
                    self.link.drafter_failed(f"draft job {message.job_id} failed for every request: {message.message}")
                return
            quarantined = self.planner.job_failed(job, message.request_ids)
            if quarantined:
                log.warning("no more drafts for %s: every job that carried them failed", quarantined)
            if not message.request_ids:
                self.link.job_failed_unattributed()
            return
        if isinstance(message, protocol.DrafterBusy):
            # A shared drafter service pushed back (queue full or past this engine's deadline): this sub-batch is
            # verified without drafts now instead of waiting; counted, so metrics show a saturated service.
            self.stats.count(drafter_busy=1)
            return
        if not isinstance(message, protocol.DraftReply):
            return
        self.planner.need_full_context(message.need_context)
        # Late replies count too: a drafter slower than the budget would otherwise never be measured, every job
        # abandoned, and the budget never grow to fit it (a hung drafter sends nothing, so it cannot inflate it).
        self.wait_policy.observe_draft(message.draft_seconds)
        if job is None:
            return  # a job abandoned after its deadline: its drafts are stale
        self._timing.drafts_by_group[job.group] = add_reply(self._timing.drafts_by_group.get(job.group), message,
                                                            job.catch_up_tokens)
        self.planner.store_drafts(
            ((r.request_id, Draft(r.context_num_tokens, r.token_ids, r.logprobs)) for r in message.results),
            self._is_live,
        )

    def _is_live(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        return request is not None and not request.is_finished()

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        """The in-worker proposer proposes nothing; drafts come from our drafter, so ignore its empty lists."""

    def update_draft_token_ids_in_output(self, draft_token_ids: Any, scheduler_output: Any) -> None:
        """As above, for vLLM's asynchronous path (not used: custom proposers turn async scheduling off)."""

    # -- update ------------------------------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> Any:
        verify_done = time.perf_counter()
        step = self._scheduled.popleft()
        timing, plan, verified_group = step.timing, step.plan, step.verified_group
        worker_seconds, self.worker_seconds = self.worker_seconds, None
        drafted_per_position: list[int] = []
        accepted_per_position: list[int] = []
        num_draft_tokens = num_accepted_tokens = num_output_tokens = num_pad_tokens = num_with_drafts = 0
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        for req_id in scheduler_output.num_scheduled_tokens:
            if req_id in index and sampled:
                num_output_tokens += len(sampled[index[req_id]])
        for req_id, spec in scheduler_output.scheduled_spec_decode_tokens.items():
            if req_id not in index or not sampled:
                continue
            # Padding only fixes the batch's shape: acceptance counts the drafted tokens.
            drafted = min(len(spec), plan.drafted_lengths.get(req_id, 0))
            num_pad_tokens += len(spec) - drafted
            if not drafted:
                continue
            accepted = min(drafted, max(0, len(sampled[index[req_id]]) - 1))
            num_with_drafts += 1
            num_draft_tokens += drafted
            num_accepted_tokens += accepted
            _bump(drafted_per_position, drafted)
            _bump(accepted_per_position, accepted)
        new_request_ids = {r.req_id for r in scheduler_output.scheduled_new_reqs}
        num_decode = sum(1 for rid in scheduler_output.num_scheduled_tokens if rid not in new_request_ids)
        num_verified_members = sum(
            1 for rid in scheduler_output.num_scheduled_tokens
            if rid not in new_request_ids and self.subbatches.group_of(rid) == verified_group
        ) if verified_group is not None else 0

        outputs = super().update_from_output(scheduler_output, model_runner_output)

        step_mode = step.step_mode
        self._forget_finished()
        # (Requests of a step still in flight are not decoding yet: no newcomer admission or draft job for them.)
        states = self._states(self._busy())
        self.planner.after_step(states, step_mode, verified_group, self.chosen_mode)
        if step_mode in (Mode.PSD, Mode.SD) and verified_group is not None:
            self._submit_drafts(verified_group, states)
            if self._scheduled and verified_group in self.link.jobs:
                # The next step, scheduled ahead, verifies while this job drafts.
                self._scheduled[-1].timing.draft_jobs_in_flight += 1
        if self.check_invariants:
            alive = {rid for rid, r in self.requests.items() if not r.is_finished()}
            self.planner.check_invariants(states, alive, self.chosen_mode)

        finished = time.perf_counter()
        job = timing.drafts_by_group.get(verified_group, JobTimes()) if verified_group is not None else JobTimes()
        timing.draft_seconds, timing.draft_first_token_seconds = job.draft_seconds, job.first_token_seconds
        timing.drafter_idle_seconds = job.idle_seconds
        # With a step scheduled ahead, the engine thread's clock from scheduled_at would include that scheduling.
        verify_seconds = worker_seconds if worker_seconds is not None else max(0.0, verify_done - timing.scheduled_at)
        if step_mode is not Mode.AR:
            self.wait_policy.observe_verify(verify_seconds)
        self._num_steps += 1
        record = StepRecord(
            step=self._num_steps,
            started_at=timing.started_at,
            mode=step_mode.value,
            verified_group=verified_group,
            group_sizes=self.subbatches.sizes(),
            num_decode_requests=num_decode,
            num_prefill_requests=len(scheduler_output.scheduled_new_reqs),
            num_requests_with_drafts=num_with_drafts,
            num_draft_tokens=num_draft_tokens,
            num_accepted_tokens=num_accepted_tokens,
            drafted_per_position=tuple(drafted_per_position),
            accepted_per_position=tuple(accepted_per_position),
            num_output_tokens=num_output_tokens,
            num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
            verify_seconds=verify_seconds,
            wait_seconds=timing.wait_seconds,
            draft_seconds=timing.draft_seconds,
            draft_first_token_seconds=timing.draft_first_token_seconds,
            drafter_idle_seconds=timing.drafter_idle_seconds,
            schedule_seconds=max(0.0, timing.scheduled_at - timing.started_at - timing.wait_seconds),
            # Steps scheduled ahead overlap: each one counts from the previous step's end, so the steps' times add up
            # to the wall time (the same as finished - started_at for a step scheduled after the previous update).
            step_seconds=finished - max(timing.started_at, self._last_update_finished),
            drafter_up=self.drafter_up,
            k=self.k,
            draft_token_budget=plan.draft_token_budget or 0,
            auto=self.auto is not None,
            widened=bool(self.placement.wide) and self.placement.can_widen,
            draft_jobs_in_flight=timing.draft_jobs_in_flight,
            num_held_out=len(plan.held_out),
            num_verified_members=num_verified_members,
            num_pad_tokens=num_pad_tokens,
            wait_budget_seconds=timing.wait_budget_seconds,
            update_seconds=max(0.0, finished - verify_done),
            draft_job_requests=job.requests,
            draft_job_length=job.length,
            draft_job_catch_up_tokens=job.catch_up_tokens,
            scheduled_ahead=timing.scheduled_ahead,
        )
        self._last_update_finished = finished
        self.stats.record(record)
        self.cost_model.async_psd_steps = self.async_steps
        if self.auto is not None:
            self.auto.cost_model.async_psd_steps = self.async_steps
            num_running = sum(1 for r in self.running if _is_decoding(r) or r.num_output_tokens > 0)
            decision = self.auto.on_step(record, num_running)
            if self._pending_decision is not None and not self._scheduled:
                # The step that was in flight at the decision is done: switch now, before anything is scheduled.
                self._apply_decision(self._pending_decision)
                self._pending_decision = None
            if decision is not None:
                if self._scheduled:
                    # A step scheduled ahead is in flight, planned for the current setting: drain it first (no more
                    # steps are scheduled ahead meanwhile) and switch once its output is in.
                    self._pending_decision = decision
                else:
                    self._apply_decision(decision)
            if self.auto.cost_model is not self.cost_model:
                self.cost_model.observe(record)
        else:
            self.cost_model.observe(record)
        return outputs

    def _apply_decision(self, decision: Decision) -> None:
        mode = Mode(decision.mode)
        self._apply_mode(mode, decision.k if mode is not Mode.AR else None)
        if (decision.mode, decision.k) != (decision.previous_mode, decision.previous_k):
            # (Keeping what a probe ran is a decision too, but not a switch.)
            self.stats.count(mode_switches=1)
        self.stats.record_decision(decision)
        log.info("auto: %s k=%d -> %s k=%d (%s)", decision.previous_mode, decision.previous_k, decision.mode,
                 decision.k, decision.reason)

    def _submit_drafts(self, group: int, states: list[RequestState]) -> None:
        if self.drafter is None or not self.link.up:
            return
        if self.link.take_restarted():
            self.planner.drafter_restarted()
        self.planner.drafter_max_tokens = int(getattr(self.drafter, "max_context_tokens", 0))
        plans = self.planner.draft_job(states, group)
        if not plans:
            return
        items: list[protocol.DraftItem] = []
        for item in plans:
            request = self.requests[item.request_id]
            # (A catch-up chunk sends fewer tokens than committed and drafts nothing.)
            if self.check_invariants and (request.spec_token_ids or len(request.all_token_ids) < item.num_tokens or (
                    item.num_draft_tokens and len(request.all_token_ids) != item.num_tokens)):
                raise AssertionError(f"{item.request_id}: drafting would build on unverified tokens")
            # Only what the drafter does not hold yet: O(new tokens), not O(context), per request per step.
            new_tokens = request.all_token_ids[item.base_num_tokens:item.num_tokens]
            items.append(protocol.DraftItem(item.request_id, new_tokens, item.num_draft_tokens,
                                            item.base_num_tokens))
        if self.link.submit(group, items, want_logprobs=self.num_extra_draft_tokens > 0):
            self.planner.job_sent(plans)
        elif self.link.take_restarted():
            self.planner.drafter_restarted()

    def _forget_finished(self) -> None:
        """Requests that left the running set: finished or aborted ones lose their PSD state (planner.forget, the one
        cleanup path, and the drafter's copy of their tokens); preempted ones only their sub-batch slot."""
        planner = self.planner
        gone: list[str] = []
        preempted: list[str] = []
        for request_id in planner.known():
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                gone.append(request_id)
            elif request.status != RequestStatus.RUNNING:
                preempted.append(request_id)
        planner.leave_sub_batches(preempted)
        if gone:
            # Finished requests are forgotten in the drafter too (their tokens and KV), not only here.
            self.link.forget(planner.forget(gone))

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, *args, **kwargs)
        self.stats.count(preemptions=1)

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus) -> list[Request]:
        finished = super().finish_requests(request_ids, finished_status)
        if finished:
            self._forget_finished()
        return finished

    def shutdown(self) -> None:
        self.link.shutdown()
        super().shutdown()


def _bump(counts: list[int], upto: int) -> None:
    if len(counts) < upto:
        counts.extend([0] * (upto - len(counts)))
    for i in range(upto):
        counts[i] += 1
