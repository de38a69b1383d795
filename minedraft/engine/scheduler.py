"""vLLM V1 scheduler subclass that runs batch-parallel speculative decoding.

Per step (docs/architecture.md, One step):
  schedule():            pick the sub-batch whose turn it is, attach the drafts the drafter made for it during the
                         previous step (waiting for them with a deadline if the drafter is late), keep the other
                         sub-batch out of the step (vLLM's per-request `next_decode_eligible_step`).
  (target verifies)      vLLM's rejection sampler, proposals treated as deterministic: lossless.
  update_from_output():  commit accepted tokens (vLLM), then send the just-verified sub-batch's committed context
                         to the drafter, which drafts it while the next step verifies the other sub-batch.

Drafts are keyed by the context length they were made from and used only if the request still has exactly that
many tokens: nothing is drafted on unverified tokens and nothing needs rolling back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from minedraft.engine import protocol
from minedraft.engine.auto import AutoController, AutoSettings, Decision
from minedraft.engine.cost_model import CostModel
from minedraft.engine.drafter_client import DrafterClient, DrafterState, JobTicket
from minedraft.engine.placement import ComputePlacement
from minedraft.engine.settings import Mode
from minedraft.engine.stats import StatsRecorder, StepRecord
from minedraft.engine.subbatch import SubBatches, select_draft_lengths

log = logging.getLogger(__name__)

CONFIG_KEY = "minedraft"


@dataclass(frozen=True)
class Draft:
    context_num_tokens: int
    token_ids: list[int]
    logprobs: list[float] | None


@dataclass
class _StepTiming:
    started_at: float = 0.0
    wait_seconds: float = 0.0
    scheduled_at: float = 0.0
    draft_seconds: float = 0.0
    draft_first_token_seconds: float = 0.0
    drafter_idle_seconds: float = 0.0
    draft_token_budget: int = 0
    draft_jobs_in_flight: int = 0


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
        # The concrete mode of the coming steps (psd, sd or ar); auto mode changes it through its controller.
        self.mode: Mode = Mode.PSD if configured_mode is Mode.AUTO else configured_mode
        self.k = int(config.get("num_speculative_tokens", self.num_spec_tokens))
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
        self.num_extra_draft_tokens = int(config.get("num_extra_draft_tokens", 0))
        self.draft_token_budget: int | None = config.get("draft_token_budget")
        self.deadline_seconds = float(config.get("deadline_seconds", 5.0))
        self.max_missed_deadlines = int(config.get("max_missed_deadlines", 3))
        self.check_invariants = bool(config.get("check_invariants", False))
        self.stats = StatsRecorder(int(config.get("stats_history", 4096)))
        self.subbatches = SubBatches()
        self.drafts: dict[str, Draft] = {}
        # At most one job in flight per sub-batch; in sd mode only sub-batch 0 is used.
        self.tickets: dict[int, JobTicket] = {}
        self.turn = 0
        self.missed_deadlines = 0
        self._verified_group: int | None = None
        self._effective_mode: Mode = self.mode
        self._timing = _StepTiming()
        self._num_steps = 0
        self.drafter: DrafterClient | None = None
        self.placement = ComputePlacement(tuple(config.get("target_cpu_cores", ())),
                                          tuple(config.get("lend_cpu_cores", ())))
        drafter_settings = config.get("drafter")
        if config.get("drafter_prestarted"):
            pass  # the in-process Engine started it in parallel with model loading and attaches it next
        elif drafter_settings and self.mode is not Mode.AR:
            self.drafter = DrafterClient(
                drafter_settings,
                restart=bool(config.get("drafter_restart", True)),
                startup_timeout_seconds=float(config.get("drafter_startup_timeout_seconds", 300.0)),
            )
            self.drafter.start()
        elif self.mode is not Mode.AR:
            log.warning("no drafter configured: serving without drafts")

    # -- control (called between steps by the engine thread) -------------------------------------------------

    @property
    def configured_mode(self) -> Mode:
        return Mode.AUTO if self.auto is not None else self.mode

    def set_mode(
        self,
        mode: Mode,
        k: int | None = None,
        num_extra_draft_tokens: int | None = None,
        auto_settings: AutoSettings | None = None,
    ) -> None:
        if mode is Mode.AUTO:
            plain = k is None and num_extra_draft_tokens is None and auto_settings is None
            if plain and self.auto is not None:
                return
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
            self._apply_mode(self.mode, k, num_extra_draft_tokens)
            self.auto = self._new_auto_controller()
            return
        self._apply_mode(mode, k, num_extra_draft_tokens)
        if self.auto is not None:
            self._auto_parked, self.auto = self.auto, None

    def _new_auto_controller(self) -> AutoController:
        # A private cost model learns only from auto's own steps (benchmarks: auto pays for all it knows).
        cost_model = self.cost_model if self.auto_settings.learn_from_fixed_modes else CostModel()
        return AutoController(self.auto_settings, self.mode.value, self.k, cost_model)

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
        self.k, self.num_extra_draft_tokens = new_k, new_e
        if mode is Mode.SD:
            self.subbatches.merge_into(0)
            self.turn = 0
        elif mode is Mode.PSD and self.mode is not Mode.PSD:
            self.subbatches.rebalance()
        self.mode = mode

    def attach_drafter(self, drafter: DrafterClient) -> None:
        self.drafter = drafter

    @property
    def drafter_up(self) -> bool:
        return self.drafter is not None and self.drafter.state is DrafterState.UP

    # -- schedule ----------------------------------------------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        timing = _StepTiming(started_at=time.perf_counter())
        self._timing = timing
        mode = self._current_mode()
        self._effective_mode = mode

        verified_group: int | None = None
        if mode in (Mode.PSD, Mode.SD):
            verified_group = self._pick_group(mode)
            self._await_drafts(verified_group, timing)
        self._verified_group = verified_group
        # With no draft job in flight nothing drafts during this verification (ar; sd; psd with one side empty):
        # the target may compute on the drafter's cores too. A job in flight (psd's other side) keeps them apart.
        timing.draft_jobs_in_flight = len(self.tickets)
        self.placement.apply(wide=mode is Mode.AR or not self.tickets)

        budget = self._draft_budget(verified_group)
        timing.draft_token_budget = budget or 0
        drafts_for_step: dict[str, list[int]] = {}
        for request in self.running:
            request.spec_token_ids = []
            decoding = _is_decoding(request)
            group = self.subbatches.group_of(request.request_id)
            if mode is Mode.PSD and decoding and group is not None and group != verified_group:
                # Skip this request for one step: schedule() increments current_step before its running loop.
                request.next_decode_eligible_step = self.current_step + 2
                continue
            request.next_decode_eligible_step = 0
            if verified_group is not None and decoding:
                tokens = self._usable_draft(request)
                if tokens:
                    drafts_for_step[request.request_id] = tokens
        if drafts_for_step:
            lengths = select_draft_lengths(
                {rid: self._draft_logprobs(rid, len(tokens)) for rid, tokens in drafts_for_step.items()},
                self.k,
                budget,
            )
            for request in self.running:
                selected = drafts_for_step.get(request.request_id)
                if selected:
                    request.spec_token_ids = selected[: lengths[request.request_id]]

        output = super().schedule(*args, **kwargs)
        timing.scheduled_at = time.perf_counter()
        return output

    def _current_mode(self) -> Mode:
        if self.mode is Mode.AR or self.drafter is None:
            return Mode.AR
        self._poll_drafter(timeout_seconds=0.0)
        if not self.drafter.check_alive():
            self.tickets.clear()
            # Without a drafter, verifying half the batch per step would only halve throughput.
            return Mode.AR
        return self.mode

    def _pick_group(self, mode: Mode) -> int:
        if mode is Mode.SD:
            return 0
        decoding_members = [0, 0]
        for request in self.running:
            group = self.subbatches.group_of(request.request_id)
            if group is not None and _is_decoding(request):
                decoding_members[group] += 1
        if decoding_members[self.turn] == 0 and decoding_members[1 - self.turn] > 0:
            # One side empty: fall back to sequential SD on the other instead of stalling.
            self.turn = 1 - self.turn
        return self.turn

    def _await_drafts(self, group: int, timing: _StepTiming) -> None:
        ticket = self.tickets.get(group)
        if ticket is None or self.drafter is None:
            return
        waited_from = time.perf_counter()
        deadline = waited_from + self.deadline_seconds
        while group in self.tickets:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            self._poll_drafter(timeout_seconds=min(remaining, 0.5))
            if self.drafter.state is not DrafterState.UP or not self.drafter.check_alive():
                self.tickets.clear()
                break
        timing.wait_seconds = time.perf_counter() - waited_from
        if group in self.tickets:
            # Late drafts would be stale by the time they arrive (the step goes ahead without them): drop them,
            # and tell the drafter so it does not spend the next step on them.
            ticket = self.tickets.pop(group)
            self.drafter.cancel(sorted(ticket.request_ids))
            self.stats.count(deadline_misses=1)
            log.warning("drafter missed its %.1fs deadline", self.deadline_seconds)
            self._note_miss("missed deadlines")
        else:
            self.missed_deadlines = 0

    def _note_miss(self, reason: str) -> None:
        assert self.drafter is not None
        self.missed_deadlines += 1
        if self.missed_deadlines >= self.max_missed_deadlines:
            self.tickets.clear()
            self.drafter.mark_hung(f"{self.missed_deadlines} in a row: {reason}")
            self.missed_deadlines = 0

    def _poll_drafter(self, timeout_seconds: float) -> None:
        assert self.drafter is not None
        for message in self.drafter.receive(timeout_seconds):
            if isinstance(message, protocol.DrafterError):
                self.stats.count(drafter_errors=1)
                log.error("draft job %d failed in the drafter: %s", message.job_id, message.message)
                self._drop_ticket(message.job_id)
                # Failing jobs cost as much as late ones: the same escalation applies (restart, then AR meanwhile).
                self._note_miss(f"draft job failed: {message.message}")
                continue
            if not isinstance(message, protocol.DraftReply):
                continue
            group = self._drop_ticket(message.job_id)
            if group is None:
                continue  # a job abandoned after a deadline: its drafts are stale
            self._timing.draft_seconds += message.draft_seconds
            self._timing.draft_first_token_seconds += message.first_token_seconds
            self._timing.drafter_idle_seconds += message.idle_seconds
            for result in message.results:
                request = self.requests.get(result.request_id)
                if request is None or request.is_finished():
                    continue
                self.drafts[result.request_id] = Draft(result.context_num_tokens, result.token_ids, result.logprobs)

    def _drop_ticket(self, job_id: int) -> int | None:
        for group, ticket in list(self.tickets.items()):
            if ticket.job_id == job_id:
                del self.tickets[group]
                return group
        return None

    def _usable_draft(self, request: Request) -> list[int]:
        draft = self.drafts.get(request.request_id)
        if draft is None or draft.context_num_tokens != request.num_tokens:
            return []
        room = min(
            request.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
            self.k + self.num_extra_draft_tokens,
        )
        return draft.token_ids[: max(0, room)]

    def _draft_logprobs(self, request_id: str, length: int) -> list[float]:
        draft = self.drafts[request_id]
        if draft.logprobs is None:
            return [0.0] * length
        return draft.logprobs[:length]

    def _draft_budget(self, group: int | None) -> int | None:
        if not self.num_extra_draft_tokens or group is None:
            return None
        if self.draft_token_budget is not None:
            return self.draft_token_budget
        members = sum(1 for r in self.running if self.subbatches.group_of(r.request_id) == group)
        return self.k * max(1, members)

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        """The in-worker proposer proposes nothing; drafts come from our drafter, so ignore its empty lists."""

    def update_draft_token_ids_in_output(self, draft_token_ids: Any, scheduler_output: Any) -> None:
        """As above, for vLLM's asynchronous path (not used: custom proposers turn async scheduling off)."""

    # -- update ------------------------------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> Any:
        verify_done = time.perf_counter()
        timing = self._timing
        drafted_per_position: list[int] = []
        accepted_per_position: list[int] = []
        num_draft_tokens = num_accepted_tokens = num_output_tokens = 0
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        for req_id in scheduler_output.num_scheduled_tokens:
            if req_id in index and sampled:
                num_output_tokens += len(sampled[index[req_id]])
        for req_id, spec in scheduler_output.scheduled_spec_decode_tokens.items():
            if req_id not in index or not sampled:
                continue
            accepted = max(0, len(sampled[index[req_id]]) - 1)
            num_draft_tokens += len(spec)
            num_accepted_tokens += accepted
            _bump(drafted_per_position, len(spec))
            _bump(accepted_per_position, accepted)
        new_request_ids = {r.req_id for r in scheduler_output.scheduled_new_reqs}
        num_decode = sum(1 for rid in scheduler_output.num_scheduled_tokens if rid not in new_request_ids)

        outputs = super().update_from_output(scheduler_output, model_runner_output)

        mode = self._effective_mode
        self._forget_finished()
        verified_group = self._verified_group
        preferred = verified_group if verified_group is not None else self.turn
        for request in self.running:
            if _is_decoding(request) and request.request_id not in self.subbatches:
                if self.mode is Mode.SD:
                    self.subbatches.admit(request.request_id, 0, balance=False)
                else:
                    self.subbatches.admit(request.request_id, preferred)
        if self.mode is Mode.PSD:
            self.subbatches.rebalance()
        if mode in (Mode.PSD, Mode.SD) and verified_group is not None:
            self._submit_drafts(verified_group)
        if mode is Mode.PSD and verified_group is not None:
            self.turn = 1 - verified_group
        if self.check_invariants:
            self._check_invariants()

        finished = time.perf_counter()
        self._num_steps += 1
        record = StepRecord(
            step=self._num_steps,
            started_at=timing.started_at,
            mode=mode.value,
            verified_group=verified_group,
            group_sizes=self.subbatches.sizes(),
            num_decode_requests=num_decode,
            num_prefill_requests=len(scheduler_output.scheduled_new_reqs),
            num_requests_with_drafts=len(scheduler_output.scheduled_spec_decode_tokens),
            num_draft_tokens=num_draft_tokens,
            num_accepted_tokens=num_accepted_tokens,
            drafted_per_position=tuple(drafted_per_position),
            accepted_per_position=tuple(accepted_per_position),
            num_output_tokens=num_output_tokens,
            num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
            verify_seconds=max(0.0, verify_done - timing.scheduled_at),
            wait_seconds=timing.wait_seconds,
            draft_seconds=timing.draft_seconds,
            draft_first_token_seconds=timing.draft_first_token_seconds,
            drafter_idle_seconds=timing.drafter_idle_seconds,
            schedule_seconds=max(0.0, timing.scheduled_at - timing.started_at - timing.wait_seconds),
            step_seconds=finished - timing.started_at,
            drafter_up=self.drafter_up,
            k=self.k,
            draft_token_budget=timing.draft_token_budget,
            auto=self.auto is not None,
            widened=bool(self.placement.wide) and self.placement.can_widen,
            draft_jobs_in_flight=timing.draft_jobs_in_flight,
        )
        self.stats.record(record)
        if self.auto is not None:
            num_running = sum(1 for r in self.running if _is_decoding(r) or r.num_output_tokens > 0)
            decision = self.auto.on_step(record, num_running)
            if decision is not None:
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

    def _submit_drafts(self, group: int) -> None:
        if self.drafter is None or group in self.tickets:
            return
        items: list[protocol.DraftItem] = []
        num_draft_tokens = self.k + self.num_extra_draft_tokens
        for request in self.running:
            if self.subbatches.group_of(request.request_id) != group or not _is_decoding(request):
                continue
            existing = self.drafts.get(request.request_id)
            if existing is not None and existing.context_num_tokens == request.num_tokens:
                continue  # still holds valid drafts (it was not verified this step)
            room = min(num_draft_tokens, request.max_tokens - request.num_output_tokens - 1,
                       self.max_model_len - request.num_tokens - 1)
            if room <= 0:
                continue
            token_ids = list(request.all_token_ids)
            if self.check_invariants and (request.spec_token_ids or len(token_ids) != request.num_tokens):
                raise AssertionError(f"{request.request_id}: drafting would build on unverified tokens")
            items.append(protocol.DraftItem(request.request_id, token_ids, room))
        ticket = self.drafter.submit(items, want_logprobs=self.num_extra_draft_tokens > 0)
        if ticket is not None:
            self.tickets[group] = ticket

    def _forget_finished(self) -> None:
        """Drop the sub-batch slot, stored drafts and drafter-side work of requests that left the running set."""
        gone: list[str] = []
        for request_id in self.subbatches.all_members():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                self.subbatches.remove(request_id)
                if request is None or request.is_finished():
                    gone.append(request_id)
        for request_id in list(self.drafts):
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                del self.drafts[request_id]
                gone.append(request_id)
        if gone and self.drafter is not None:
            in_flight = {rid for t in self.tickets.values() for rid in t.request_ids}
            doomed = sorted(set(gone) & in_flight)
            if doomed:
                self.drafter.cancel(doomed)

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, *args, **kwargs)
        self.stats.count(preemptions=1)

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus) -> list[Request]:
        finished = super().finish_requests(request_ids, finished_status)
        if finished:
            self._forget_finished()
        return finished

    def _check_invariants(self) -> None:
        running_decoding = {r.request_id for r in self.running if _is_decoding(r)}
        members = self.subbatches.all_members()
        missing = running_decoding - members
        if missing:
            raise AssertionError(f"decoding requests outside both sub-batches: {sorted(missing)}")
        stale = members - {r.request_id for r in self.running}
        if stale:
            raise AssertionError(f"sub-batch members that are not running: {sorted(stale)}")
        if self.mode is Mode.PSD:
            self.subbatches.check_balanced()
        elif self.mode is Mode.SD and self.subbatches.sizes()[1]:
            raise AssertionError("sd mode keeps every request in sub-batch 0")
        leaked = [rid for rid in self.drafts if rid not in self.requests or self.requests[rid].is_finished()]
        if leaked:
            raise AssertionError(f"drafts kept for finished requests: {leaked}")

    def shutdown(self) -> None:
        if self.drafter is not None:
            self.drafter.shutdown()
        super().shutdown()


def _bump(counts: list[int], upto: int) -> None:
    if len(counts) < upto:
        counts.extend([0] * (upto - len(counts)))
    for i in range(upto):
        counts[i] += 1
