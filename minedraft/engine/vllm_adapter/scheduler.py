"""vLLM V1 scheduler subclass for batch-parallel speculative decoding: a host of the speculation core, translation only.

The step itself lives in minedraft/engine/psd/core.py (SpeculationCore: planner, draft jobs in flight, wait policy,
auto mode, statistics) and the drafter plumbing in minedraft/engine/drafter/link.py. This class translates:
  schedule():            vLLM's running requests -> the core's views; the core's decision -> each request's
                         proposal (`spec_token_ids`) and, for requests held out, vLLM's `next_decode_eligible_step`;
                         then vLLM schedules, and the core is told which requests the step runs.
  (target verifies)      vLLM's rejection sampler, proposals treated as deterministic: lossless.
  update_from_output():  vLLM commits the accepted tokens; the runner's output -> the core's outcome; the core sends
                         the just-verified sub-batch's newly committed tokens to the drafter (lookahead: the core
                         sent its branch job when the step was scheduled, in commit()).

Drafts are keyed by the context length they were made from and used only if the request still has exactly that
many tokens: nothing is drafted on unverified tokens and nothing needs rolling back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from minedraft.engine.drafter.client import DrafterClient, DrafterState
from minedraft.engine.drafter.link import DrafterLink
from minedraft.engine.placement import ComputePlacement
from minedraft.engine.psd.core import SpeculationCore, StepOutcome
from minedraft.engine.psd.planner import RequestState
from minedraft.engine.settings import Mode, SchedulerSettings
from minedraft.engine.vllm_adapter.resident_batches import skip_token_resend

log = logging.getLogger(__name__)

CONFIG_KEY = "minedraft"


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
        settings = SchedulerSettings.from_config(dict(additional[CONFIG_KEY]))
        self.settings = settings
        self.link = DrafterLink(None, hang_seconds=settings.hang_seconds, max_failed_jobs=settings.max_missed_deadlines)
        self.core = SpeculationCore(settings, self.link, self._tokens)
        self.placement = ComputePlacement(settings.target_cpu_cores, settings.lend_cpu_cores)
        # With the model runner's resident sub-batches (set by the engine): no re-sending of whole contexts either.
        self.resident_sub_batches = settings.resident_sub_batches
        # Set by OverlappedSteps before each update: the seconds the model runner spent on the step (the engine
        # thread's own clock would include scheduling the next step).
        self.worker_seconds: float | None = None
        if settings.drafter_prestarted:
            pass  # the in-process Engine started it in parallel with model loading and attaches it next
        elif settings.drafter and self.core.chosen_mode is not Mode.AR:
            drafter = DrafterClient(settings.drafter, restart=settings.drafter_restart,
                                    startup_timeout_seconds=settings.drafter_startup_timeout_seconds)
            drafter.start()
            self.link.attach(drafter)
        elif self.core.chosen_mode is not Mode.AR:
            log.warning("no drafter configured: serving without drafts")

    @property
    def drafter(self) -> DrafterClient | None:
        return self.link.client

    @property
    def drafter_up(self) -> bool:
        return self.drafter is not None and self.drafter.state is DrafterState.UP

    def attach_drafter(self, drafter: DrafterClient) -> None:
        self.link.attach(drafter)

    # -- translation ----------------------------------------------------------------------------------------------

    def _views(self, busy: frozenset[str]) -> list[RequestState]:
        """The core's view of each running request, built once per call (requests of a step in flight: not
        decoding, their next tokens are not known yet)."""
        max_len = self.max_model_len
        views = []
        for request in self.running:
            num_tokens = request.num_tokens
            pad_room = max_len - num_tokens - 1
            views.append(RequestState(
                request.request_id, num_tokens, _is_decoding(request) and request.request_id not in busy,
                min(request.max_tokens - request.num_output_tokens - 1, pad_room), pad_room,
                request.all_token_ids[-1] if num_tokens else 0,
            ))
        return views

    def _tokens(self, request_id: str, start: int, end: int) -> Sequence[int]:
        """A draft job's tokens of a request: committed ones only (checked with check_invariants). vLLM keeps a
        step's proposals apart (spec_token_ids), never in all_token_ids: lookahead reads committed tokens while its
        step's proposals are out, and sends its speculative tails apart from them."""
        request = self.requests[request_id]
        if self.core.check_invariants and len(request.all_token_ids) < end:
            raise AssertionError(f"{request_id}: drafting would build on unverified tokens")
        return request.all_token_ids[start:end]

    def _is_decoding_id(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        return request is not None and _is_decoding(request)

    # -- vLLM's hooks ---------------------------------------------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        core = self.core
        decision = core.schedule(self._views(core.busy()))
        self.placement.apply(wide=decision.widen)
        proposals, held = decision.proposals, decision.held
        step_after_next = self.current_step + 2  # schedule() increments current_step before its running loop
        for request in self.running:
            request_id = request.request_id
            # A fresh list: vLLM trims spec_token_ids in place.
            request.spec_token_ids = list(proposals.get(request_id, ()))
            # (A request in flight must not run again before its output is in. vLLM 0.32 skips a decoding one itself,
            # its new-token count being at most zero; a prompt's next chunk it would schedule: held too.)
            request.next_decode_eligible_step = step_after_next if request_id in held else 0
        if self.resident_sub_batches:
            skip_token_resend(self)
        if decision.step_mode is Mode.LOOKAHEAD and not self.waiting and all(
                r.num_computed_tokens >= r.num_prompt_tokens for r in self.running):
            # No prompt can complete in this step: the branch job goes out now, not after vLLM's scheduling.
            core.send_branches_early(decision)
        output = super().schedule(*args, **kwargs)
        core.commit(decision, output.num_scheduled_tokens, output.scheduled_spec_decode_tokens,
                    finishing=self._finishing_prompts(output) if decision.step_mode is Mode.LOOKAHEAD else ())
        return output

    def _finishing_prompts(self, output: SchedulerOutput) -> list[RequestState]:
        """Views of the requests whose prompt this step completes (vLLM has advanced their computed tokens past it):
        their first token is sampled in the step. Newly admitted ones were not among the views the step was planned
        from."""
        max_len = self.max_model_len
        views = []
        for request_id in output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if (request is None or request.num_output_tokens or request.num_computed_tokens < request.num_prompt_tokens
                    or not request.num_tokens):
                continue
            pad_room = max_len - request.num_tokens - 1
            views.append(RequestState(request_id, request.num_tokens, False,
                                      min(request.max_tokens - 1, pad_room), pad_room, request.all_token_ids[-1]))
        return views

    def may_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled before the one in flight is updated (SpeculationCore's rule)."""
        return self.core.may_schedule_ahead(self._is_decoding_id)

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput) -> Any:
        verify_done = time.perf_counter()
        decision = self.core.launched()[0]
        worker_seconds, self.worker_seconds = self.worker_seconds, None
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        num_sampled = {rid: len(sampled[i]) for rid, i in index.items()} if sampled else {}
        new_request_ids = {r.req_id for r in scheduler_output.scheduled_new_reqs}
        scheduled = scheduler_output.num_scheduled_tokens
        decoded = [rid for rid in scheduled if rid not in new_request_ids]
        num_output_tokens = sum(num_sampled.get(rid, 0) for rid in scheduled)

        outputs = super().update_from_output(scheduler_output, model_runner_output)

        core = self.core
        gone, preempted = self._left(core.known())
        outcome = StepOutcome(
            views=self._views(core.busy(after_oldest=True)), verified=scheduler_output.scheduled_spec_decode_tokens,
            num_sampled=num_sampled, decoded=decoded, num_prefill_requests=len(new_request_ids),
            num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens, verify_done_at=verify_done,
            worker_seconds=worker_seconds, gone=gone, preempted=preempted,
            alive=[rid for rid, r in self.requests.items() if not r.is_finished()] if core.check_invariants else (),
            num_output_tokens=num_output_tokens,
            widened=bool(self.placement.wide) and self.placement.can_widen,
        )
        core.update(decision, outcome)
        return outputs

    def _left(self, known: set[str]) -> tuple[list[str], list[str]]:
        """Of the requests the core knows: those finished or aborted, and those preempted back to waiting."""
        gone: list[str] = []
        preempted: list[str] = []
        for request_id in known:
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                gone.append(request_id)
            elif request.status != RequestStatus.RUNNING:
                preempted.append(request_id)
        return gone, preempted

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        """The in-worker proposer proposes nothing; drafts come from our drafter, so ignore its empty lists."""

    def update_draft_token_ids_in_output(self, draft_token_ids: Any, scheduler_output: Any) -> None:
        """As above, for vLLM's asynchronous path (not used: custom proposers turn async scheduling off)."""

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, *args, **kwargs)
        self.core.stats.count(preemptions=1)

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus) -> list[Request]:
        finished = super().finish_requests(request_ids, finished_status)
        if finished:
            self.core.release(*self._left(self.core.known()))
        return finished

    def shutdown(self) -> None:
        self.link.shutdown()
        super().shutdown()
