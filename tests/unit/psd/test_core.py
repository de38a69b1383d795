"""The speculation core driven directly: a fake draft source (events handed in by the test) and hand-made outcomes,
in the style of vLLM's tests/v1/core: no vLLM, no drafter process, no clock but the test's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from minedraft.engine.psd.core import SpeculationCore, StepDecision, StepOutcome
from minedraft.engine.psd.events import (
    DrafterBusy,
    DrafterEvent,
    DrafterRestarted,
    DraftsArrived,
    JobFailed,
    JobHung,
    TokenReader,
    WaitResult,
)
from minedraft.engine.psd.inflight import InFlight, JobInFlight
from minedraft.engine.psd.planner import Draft, JobItemPlan, RequestState
from minedraft.engine.settings import Mode, SchedulerSettings

K = 3


@dataclass
class FakeSource:
    """A DraftSource whose drafter answers only what the test hands it."""

    jobs: InFlight = field(default_factory=InFlight)
    up: bool = True
    attached: bool = True
    loading: bool = False
    max_context_tokens: int = 0
    inbox: list[DrafterEvent] = field(default_factory=list)
    health: list[DrafterEvent] = field(default_factory=list)
    sent: list[tuple[int, list[JobItemPlan], list[Sequence[int]]]] = field(default_factory=list)
    abandoned: list[int] = field(default_factory=list)
    forgotten: list[str] = field(default_factory=list)
    restarts: list[str] = field(default_factory=list)
    unattributed: int = 0
    waits: list[tuple[int, float]] = field(default_factory=list)
    next_job: int = 1

    def poll(self, timeout_seconds: float) -> list[DrafterEvent]:
        out, self.inbox = self.inbox, []
        return out

    def check(self) -> bool:
        return self.up

    def take_events(self) -> list[DrafterEvent]:
        out, self.health = self.health, []
        return out

    def wait_for(self, group: int, budget_seconds: float) -> WaitResult:
        self.waits.append((group, budget_seconds))
        events = self.poll(0.0)
        return WaitResult(0.0, group not in self.jobs, tuple(events))

    def submit(self, group: int, items: Sequence[JobItemPlan], tokens: TokenReader, want_logprobs: bool) -> bool:
        carried = frozenset(item.request_id for item in items)
        drafted = frozenset(item.request_id for item in items if item.num_draft_tokens)
        self.jobs.add(JobInFlight(group, self.next_job, carried, drafted, 0.0))
        self.sent.append((group, list(items), [tokens(i.request_id, i.base_num_tokens, i.num_tokens) for i in items]))
        self.next_job += 1
        return True

    def abandon(self, group: int) -> None:
        self.jobs.cancel(group)
        self.abandoned.append(group)

    def forget(self, request_ids: list[str]) -> None:
        self.forgotten += request_ids

    def drafter_failed(self, reason: str) -> None:
        self.restarts.append(reason)
        self.jobs.drop_all()

    def job_failed_unattributed(self) -> None:
        self.unattributed += 1

    def answer(self, group: int, context: dict[str, int]) -> None:
        """The drafter answers `group`'s job with drafts made from each request's `context` length."""
        job = self.jobs.complete(self.jobs.get(group).job_id)  # type: ignore[union-attr]
        drafts = tuple((rid, Draft(n, [7] * K, None)) for rid, n in context.items())
        self.inbox.append(DraftsArrived(job, job.job_id if job else 0, drafts, 0.01, 0.0, 0.0))


def view(rid: str, num_tokens: int, decoding: bool = True) -> RequestState:
    return RequestState(rid, num_tokens, decoding, draft_room=100, pad_room=1000, last_token_id=1)


def make_core(mode: Mode = Mode.PSD, **changes: object) -> tuple[SpeculationCore, FakeSource, list[str]]:
    source = FakeSource()
    read: list[str] = []

    def tokens(rid: str, start: int, end: int) -> list[int]:
        read.append(rid)
        return list(range(start, end))

    settings = SchedulerSettings(mode=mode, num_speculative_tokens=K, max_num_speculative_tokens=5,
                                 check_invariants=True, **changes)  # type: ignore[arg-type]
    clock = iter(float(i) for i in range(10_000))
    return SpeculationCore(settings, source, tokens, clock=lambda: next(clock)), source, read


def run(core: SpeculationCore, views: list[RequestState], accepted: int = 0) -> tuple[StepDecision, list[RequestState]]:
    """One step: every request that runs gains 1 + min(accepted, its proposal) tokens (prompts: one)."""
    decision = core.schedule(views)
    ran = [v for v in views if v.request_id not in decision.held]
    core.commit(decision, [v.request_id for v in ran], {rid: p for rid, p in decision.proposals.items()})
    sampled = {v.request_id: (1 + min(accepted, len(decision.proposals.get(v.request_id, ()))) if v.decoding else 1)
               for v in ran}
    after = [view(v.request_id, v.num_tokens + sampled.get(v.request_id, 0)) for v in views]
    outcome = StepOutcome(views=after, verified={rid: p for rid, p in decision.proposals.items() if rid in sampled},
                          num_sampled=sampled, decoded=[v.request_id for v in ran if v.decoding],
                          num_prefill_requests=sum(not v.decoding for v in ran),
                          num_scheduled_tokens=sum(sampled.values()), verify_done_at=0.0, worker_seconds=0.01,
                          alive={v.request_id for v in after})
    core.update(decision, outcome)
    return decision, after


def test_psd_alternates_sub_batches_and_verifies_each_with_the_drafts_made_from_its_context():
    core, source, read = make_core()
    views = [view(f"r{i}", 10) for i in range(4)]
    first, views = run(core, views)  # no sub-batches yet: everyone decodes, then is admitted; group 0 gets a job
    assert first.verified_group == 0 and not first.proposals
    assert core.subbatches.sizes() == (2, 2)
    group0 = set(core.subbatches.members(0))
    assert source.sent and source.sent[-1][0] == 0 and {i.request_id for i in source.sent[-1][1]} == group0
    assert set(read) == group0, "the core reads tokens only for the requests it drafts"
    # Next step verifies sub-batch 1 (no drafts yet) while group 0's are coming: group 0 is held out.
    second, views = run(core, views)
    assert second.verified_group == 1 and second.plan.held_out == group0
    source.answer(0, {v.request_id: v.num_tokens for v in views if v.request_id in group0})
    third, views = run(core, views, accepted=K)
    assert third.verified_group == 0
    assert {rid for rid, p in third.proposals.items() if p == [7] * K} == group0
    record = core.stats.records()[-1]
    assert (record.num_requests_with_drafts, record.num_draft_tokens, record.num_accepted_tokens) == (2, 2 * K, 2 * K)


def test_drafts_for_an_older_context_are_never_verified():
    core, source, _ = make_core()
    views = [view("a", 10), view("b", 10)]
    _, views = run(core, views)
    group0 = core.subbatches.members(0)
    _, views = run(core, views)
    source.answer(0, {rid: 5 for rid in group0})  # made from a context the request no longer has
    decision, _ = run(core, views)
    assert decision.verified_group == 0 and all(p.count(7) == 0 for p in decision.proposals.values())


def test_a_job_that_brings_no_drafts_is_not_waited_for():
    """A job of catch-up chunks only drafts nothing: the step verifies at once, the job runs on."""
    core, source, _ = make_core()
    core.planner.subbatches.admit("new", 0)
    core.planner.record("new")
    source.jobs.add(JobInFlight(0, 99, frozenset({"new"}), frozenset(), 0.0))
    core.schedule([view("new", 512)])
    assert source.waits == [] and 0 in source.jobs


def test_a_late_job_is_abandoned_and_counted():
    core, source, _ = make_core()
    views = [view("a", 10), view("b", 10)]
    _, views = run(core, views)
    _, views = run(core, views)
    decision, _ = run(core, views)  # group 0's job never answers
    assert source.waits and source.abandoned == [0] and core.stats.totals().deadline_misses == 1
    assert decision.verified_group == 0 and not any(7 in p for p in decision.proposals.values())


def test_a_broken_drafter_is_restarted_and_no_request_is_quarantined():
    for failure in (dict(culprits=(), drafter_broken=True),
                    # A drafter without the probe naming every request of the job alone: the same verdict.
                    dict(culprits=("a", "b"), drafter_broken=False)):
        core, source, _ = make_core()
        run(core, [view("a", 10), view("b", 10), view("c", 10), view("d", 10)])
        job = source.jobs.complete(source.jobs.get(0).job_id)  # type: ignore[union-attr]
        assert job is not None and len(job.drafted) == 2
        source.inbox.append(JobFailed(job, job.job_id, "CUDA error", tuple(job.drafted) if failure["culprits"]
                                      else (), bool(failure["drafter_broken"])))
        # The second sub-batch's job of the same broken process, no longer tracked: no second restart.
        source.inbox.append(JobFailed(None, 1000, "CUDA error", (), True))
        core.poll_drafter()
        assert len(source.restarts) == 1 and core.planner.quarantined == set(), failure
        assert core.stats.totals().drafter_errors == 2


def test_a_poison_request_is_quarantined_and_the_drafter_left_alone():
    core, source, _ = make_core()
    run(core, [view("a", 10), view("b", 10), view("c", 10), view("d", 10)])
    job = source.jobs.complete(source.jobs.get(0).job_id)  # type: ignore[union-attr]
    assert job is not None
    poison = sorted(job.drafted)[0]
    source.inbox.append(JobFailed(job, job.job_id, "bad context", (poison,)))
    core.poll_drafter()
    assert core.planner.quarantined == {poison} and source.restarts == [] and source.unattributed == 0


def test_a_busy_answer_is_counted_a_hang_blames_the_longest_context_and_a_restart_resends_whole_contexts():
    core, source, _ = make_core()
    views = [view("a", 10), view("b", 10), view("c", 10), view("d", 10)]
    _, views = run(core, views)
    job = source.jobs.complete(source.jobs.get(0).job_id)  # type: ignore[union-attr]
    source.inbox.append(DrafterBusy(job, 1, "queue full"))
    core.poll_drafter()
    assert core.stats.totals().drafter_busy == 1
    assert core.planner.drafter_holds
    long_one = max(views, key=lambda v: v.num_tokens).request_id
    source.health += [JobHung(frozenset({long_one})), DrafterRestarted()]
    core.schedule(views)
    assert core.planner.records[long_one].hangs == 1
    assert core.planner.drafter_holds == {}, "a new drafter holds nothing: the next job sends whole contexts"


def test_finished_requests_are_forgotten_in_the_core_and_the_drafter():
    core, source, _ = make_core()
    run(core, [view("a", 10), view("b", 10)])
    core.release(["a", "b"])
    assert core.known() == set() and sorted(source.forgotten) == sorted(
        rid for group, items, _ in source.sent for rid in (i.request_id for i in items))


def test_ar_sends_no_jobs_and_sd_verifies_one_sub_batch_every_step():
    core, source, _ = make_core(Mode.AR)
    decision, _ = run(core, [view("a", 10)])
    assert decision.step_mode is Mode.AR and source.sent == [] and decision.widen
    core, source, _ = make_core(Mode.SD)
    views = [view("a", 10), view("b", 10)]
    for _ in range(3):
        decision, views = run(core, views)
        assert decision.verified_group == 0
    assert core.subbatches.sizes() == (2, 0)


def test_an_auto_decision_waits_for_the_step_scheduled_ahead():
    """A decision of auto's taken while a step scheduled ahead is in flight is applied once that step is updated."""
    core, _, _ = make_core(Mode.AUTO, async_steps=True)
    views = [view("a", 10), view("b", 10), view("c", 10), view("d", 10)]
    _, views = run(core, views)
    assert core.auto is not None
    first = core.schedule(views)
    core.commit(first, [v.request_id for v in views if v.request_id not in first.held])
    assert core.may_schedule_ahead(lambda rid: True)
    ahead_views = [view(v.request_id, v.num_tokens, decoding=v.request_id not in core.busy()) for v in views]
    ahead = core.schedule(ahead_views)
    assert ahead.verified_group == 1 - first.verified_group  # type: ignore[operator]
    core.commit(ahead, [v.request_id for v in ahead_views if v.decoding and v.request_id not in ahead.held])
    from minedraft.engine.control.auto import Decision

    switch = Decision(1, "sd", 2, "psd", K, "test", "switch", 4.0, 0.0, 0.0, 0.0)
    core.auto.on_step = lambda record, num_running: switch  # type: ignore[method-assign]
    outcome = StepOutcome(views=views, verified={}, num_sampled={}, decoded=[], num_prefill_requests=0,
                          num_scheduled_tokens=0, verify_done_at=0.0, worker_seconds=0.01,
                          alive={v.request_id for v in views})
    core.update(first, outcome)
    assert core.pending_decision is switch and core.chosen_mode is Mode.PSD
    assert not core.may_schedule_ahead(lambda rid: True), "nothing more is scheduled ahead while a switch waits"
    core.auto.on_step = lambda record, num_running: None  # type: ignore[method-assign]
    core.update(ahead, outcome)
    assert core.pending_decision is None and (core.chosen_mode, core.k) == (Mode.SD, 2)
