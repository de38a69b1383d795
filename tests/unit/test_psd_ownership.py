"""Who owns what in a PSD engine, driven through random lives: the speculation core (psd/core.py: the same object the
vLLM scheduler and the twin drive) over the real drafter link, against a simulated drafter that answers, fails,
refuses, hangs and is replaced at random, with hand-made step outcomes.

The bug class: in-flight draft work with two records kept in step by hand (the planner's and the link's), and
per-request state in side dicts each with its own cleanup. Any path that updates one record and not the other leaves
the engine waiting for drafts no drafter will send, or sending a sub-batch a second job, or keeping state of requests
long gone. Checked after every step of every life:
  - there is one record of jobs in flight, and it is exactly the jobs the drafter has taken and not yet answered;
  - a request held out of a step has drafts coming in that record, or holds a usable draft;
  - a job never drafts a quarantined request, and never goes to a sub-batch that has one in flight;
  - sub-batch membership is unique; every member has a record; records are kept only for live requests;
  - once every request has finished, the planner holds nothing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.request import RequestStatus

from minedraft.engine.drafter import protocol
from minedraft.engine.drafter.client import DrafterState, JobTicket
from minedraft.engine.drafter.link import DrafterLink
from minedraft.engine.psd.core import SpeculationCore, StepOutcome
from minedraft.engine.psd.planner import RequestState
from minedraft.engine.settings import Mode, SchedulerSettings

K = 3
HANG_SECONDS = 5.0
MAX_MODEL_LEN = 400


@dataclass
class SimDrafter:
    """A drafter process stand-in: jobs it has taken and not answered, on its current process only."""

    rng: random.Random
    state: DrafterState = DrafterState.UP
    num_starts: int = 1
    max_context_tokens: int = 300
    # Job id -> its items, for jobs taken by the current process and not yet answered (or cancelled).
    unanswered: dict[int, list[protocol.DraftItem]] = field(default_factory=dict)
    inbox: list[protocol.FromDrafter] = field(default_factory=list)
    next_job: int = 1
    quarantined_when_sent: list[set[str]] = field(default_factory=list)
    # The engine's clock moves on while it waits for drafts (DrafterLink.wait_for polls with a timeout).
    advance: Any = None

    # -- the DrafterClient surface the link uses --
    def submit(self, items: list[protocol.DraftItem], want_logprobs: bool) -> JobTicket | None:
        if self.rng.random() < 0.05:
            return None  # the send failed (the socket is backed up)
        job_id, self.next_job = self.next_job, self.next_job + 1
        self.unanswered[job_id] = list(items)
        return JobTicket(job_id, frozenset(i.request_id for i in items), 0.0)

    def cancel_jobs(self, job_ids: list[int]) -> None:
        for job_id in job_ids:
            self.unanswered.pop(job_id, None)

    def cancel(self, request_ids: list[str]) -> None:
        pass

    def receive(self, timeout_seconds: float) -> list[protocol.FromDrafter]:
        if timeout_seconds > 0:
            self.advance(timeout_seconds)
            if self.unanswered and self.rng.random() < 0.7:
                self.answer()  # answered while the step waits (else the step goes ahead without the drafts)
        out, self.inbox = self.inbox, []
        return out

    def check_alive(self) -> bool:
        return self.state is DrafterState.UP

    def mark_hung(self, reason: str) -> None:
        self.replace()

    # -- what the test makes it do --
    def replace(self) -> None:
        """A new process: the old one's jobs and unsent answers are gone."""
        self.num_starts += 1
        self.unanswered.clear()
        self.inbox.clear()

    def die_or_come_back(self) -> None:
        """The process dies (its jobs with it), or a new one comes up."""
        if self.state is DrafterState.UP:
            self.state = DrafterState.DOWN
            self.unanswered.clear()
            self.inbox.clear()
        else:
            self.state = DrafterState.UP
            self.num_starts += 1

    def answer(self) -> None:
        job_id = self.rng.choice(sorted(self.unanswered))
        items = self.unanswered.pop(job_id)
        roll = self.rng.random()
        if roll < 0.7:
            results = [protocol.DraftResult(i.request_id, i.base_num_tokens + len(i.token_ids),
                                            [self.rng.randrange(50) for _ in range(i.num_draft_tokens)])
                       for i in items if i.num_draft_tokens]
            lost = [i.request_id for i in items if self.rng.random() < 0.05]
            self.inbox.append(protocol.DraftReply(job_id, results, 0.01, 0.0, need_context=lost))
        elif roll < 0.8:
            culprits = [i.request_id for i in items if self.rng.random() < 0.3]
            self.inbox.append(protocol.DrafterError(job_id, "failed", culprits))
        elif roll < 0.85:
            self.inbox.append(protocol.DrafterError(job_id, "device error", [], drafter_broken=True))
        else:
            self.inbox.append(protocol.DrafterBusy(job_id, "queue full"))


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    max_tokens: int
    num_output_tokens: int = 0
    status: RequestStatus = RequestStatus.RUNNING
    spec_token_ids: list[int] = field(default_factory=list)
    prefilled: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)


class Engine:
    """A host of the core: fake requests -> views, random verification -> outcomes."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = 100.0
        self.client = SimDrafter(random.Random(seed + 1))
        self.client.advance = self._advance
        self.link = DrafterLink(self.client, hang_seconds=HANG_SECONDS, max_failed_jobs=3,  # type: ignore[arg-type]
                                clock=lambda: self.now)
        settings = SchedulerSettings(mode=Mode.PSD, num_speculative_tokens=K, max_num_speculative_tokens=K,
                                     catch_up_tokens_per_job=24, deadline_seconds=0.05, check_invariants=True)
        self.core = SpeculationCore(settings, self.link, self._tokens, clock=lambda: self.now)
        self.planner = self.core.planner
        self.requests: dict[str, FakeRequest] = {}
        self.ever: set[str] = set()
        self.num_held_out = 0
        self._next_request = 0

    def _advance(self, seconds: float) -> None:
        self.now += seconds

    def _tokens(self, request_id: str, start: int, end: int) -> list[int]:
        request = self.requests[request_id]
        assert end <= len(request.all_token_ids), "a job sends tokens the request does not have"
        return request.all_token_ids[start:end]

    @property
    def running(self) -> list[FakeRequest]:
        return [r for r in self.requests.values() if r.status == RequestStatus.RUNNING]

    def left(self) -> tuple[list[str], list[str]]:
        gone = [rid for rid in self.core.known() if rid not in self.requests or self.requests[rid].is_finished()]
        preempted = [rid for rid in self.core.known()
                     if rid in self.requests and self.requests[rid].status == RequestStatus.PREEMPTED]
        return gone, preempted

    # -- a life --
    def states(self) -> list[RequestState]:
        return [RequestState(r.request_id, r.num_tokens, r.prefilled,
                             draft_room=min(r.max_tokens - r.num_output_tokens - 1, MAX_MODEL_LEN - r.num_tokens - 1),
                             pad_room=MAX_MODEL_LEN - r.num_tokens - 1, last_token_id=r.all_token_ids[-1])
                for r in self.running]

    def arrive(self) -> None:
        rid = f"r{self._next_request}"
        self._next_request += 1
        prompt = [self.rng.randrange(50) for _ in range(self.rng.choice((3, 8, 40, 120, 310)))]
        self.requests[rid] = FakeRequest(rid, prompt, max_tokens=self.rng.randint(1, 60))
        self.ever.add(rid)

    def drafter_events(self) -> None:
        for _ in range(self.rng.randint(0, 3)):
            roll = self.rng.random()
            if roll < 0.75:
                if self.client.unanswered:
                    self.client.answer()
            elif roll < 0.8:
                self.client.replace()
            elif roll < 0.83:
                self.now += HANG_SECONDS + 1  # silence with work outstanding: taken for hung
            elif roll < 0.85 or (self.client.state is not DrafterState.UP and roll < 0.95):
                self.client.die_or_come_back()

    def step(self) -> None:
        # schedule: the core hears the drafter, looks after it, picks the sub-batch, waits for its drafts at most its
        # budget (the simulated drafter answers during the wait or not), and plans the step.
        states = self.states()
        decision = self.core.schedule(states)
        self.check_owner()
        plan, group = decision.plan, decision.verified_group
        self.check_held_out(plan.held_out, states, group)
        self.num_held_out += len(plan.held_out)
        ran = [r for r in self.running if r.request_id not in decision.held]
        self.core.commit(decision, [r.request_id for r in ran], now=self.now)
        # The target verifies: accepted drafts and one more token each; prompts are taken in whole.
        num_sampled: dict[str, int] = {}
        decoded: list[str] = []
        for request in ran:
            rid = request.request_id
            if not request.prefilled:
                request.prefilled = True
                new = 1
            else:
                decoded.append(rid)
                proposal = plan.proposals.get(rid, [])
                new = 1 + self.rng.randint(0, len(proposal))
            num_sampled[rid] = new
            new = min(new, request.max_tokens - request.num_output_tokens, MAX_MODEL_LEN - request.num_tokens)
            request.all_token_ids += [self.rng.randrange(50) for _ in range(new)]
            request.num_output_tokens += new
            if request.num_output_tokens >= request.max_tokens or request.num_tokens >= MAX_MODEL_LEN:
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        self.now += 0.01
        for request in list(self.requests.values()):
            roll = self.rng.random()
            if roll < 0.03 and not request.is_finished():
                request.status = RequestStatus.FINISHED_ABORTED
            elif roll < 0.06 and request.status == RequestStatus.RUNNING:
                request.status = RequestStatus.PREEMPTED
                request.prefilled = False  # recomputed on resumption, as vLLM does
            elif roll < 0.2 and request.status == RequestStatus.PREEMPTED:
                request.status = RequestStatus.RUNNING
        # update: the core forgets who left, admits and rebalances, sends the verified sub-batch its next job.
        gone, preempted = self.left()
        self.requests = {rid: r for rid, r in self.requests.items() if not r.is_finished()}
        quarantined = self.planner.quarantined
        had_job = group is not None and group in self.link.jobs
        before = self.link.jobs.get(group)
        outcome = StepOutcome(
            views=self.states(), verified={rid: plan.proposals[rid] for rid in decoded if rid in plan.proposals},
            num_sampled=num_sampled, decoded=decoded, num_prefill_requests=len(ran) - len(decoded),
            num_scheduled_tokens=sum(num_sampled.values()), verify_done_at=self.now, worker_seconds=0.01,
            gone=gone, preempted=preempted, alive=set(self.requests))
        record = self.core.update(decision, outcome)
        assert record.num_decode_requests == len(decoded)
        if decision.step_mode is Mode.PSD and group is not None:
            job = self.link.jobs.get(group)
            if had_job:
                assert job is before, "a second job went to a sub-batch with one in flight"
            elif job is not None:
                assert not job.drafted & quarantined, f"a job drafts quarantined {sorted(job.drafted & quarantined)}"
        members = self.planner.subbatches.groups
        assert not set(members[0]) & set(members[1]), "a request in both sub-batches"

    def check_owner(self) -> None:
        """One record of jobs in flight, and it is the drafter's truth (once the engine has looked at its drafter)."""
        assert self.planner.in_flight is self.link.jobs
        tracked = {job.job_id for job in self.link.jobs}
        assert tracked == set(self.client.unanswered), (
            f"in flight {sorted(tracked)}, the drafter owes {sorted(self.client.unanswered)}")
        for job in self.link.jobs:
            assert job.drafted <= job.carried and job.carried <= self.ever

    def check_held_out(self, held_out: frozenset[str], states: list[RequestState], group: int | None) -> None:
        by_id = {state.request_id: state for state in states}
        coming = self.link.jobs.coming(1 - group) if group is not None else frozenset()
        for rid in held_out:
            assert self.planner.subbatches.group_of(rid) not in (None, group)
            assert rid in coming or self.planner.usable_draft(by_id[rid]), f"{rid} held out with nothing coming"

    def finish_everything(self) -> None:
        for request in self.requests.values():
            request.status = RequestStatus.FINISHED_STOPPED
        self.core.release(*self.left())
        self.requests.clear()
        while self.client.unanswered or self.client.inbox:
            if self.client.unanswered:
                self.client.answer()
            self.core.poll_drafter()
        self.core.release(*self.left())


def test_random_lives_keep_one_owner_of_in_flight_work_and_leave_no_state_behind() -> None:
    totals = {"jobs": 0, "quarantined": 0, "restarts": 0, "held_out": 0}
    for seed in range(60):
        engine = Engine(seed)
        for _ in range(engine.rng.randint(20, 80)):
            for _ in range(engine.rng.choice((0, 0, 1, 2))):
                engine.arrive()
            engine.drafter_events()
            engine.step()
            totals["quarantined"] += len(engine.planner.quarantined)
        totals["jobs"] += engine.client.next_job - 1
        totals["restarts"] += engine.client.num_starts - 1
        totals["held_out"] += engine.num_held_out
        engine.finish_everything()
        assert engine.planner.records == {}, f"seed {seed}: state left after every request finished"
        assert engine.planner.known() == set(), f"seed {seed}"
        assert not engine.link.jobs, f"seed {seed}: jobs in flight after the drafter answered them all"
    # The lives did exercise what they are about.
    assert totals["jobs"] > 1000 and totals["held_out"] > 1000, totals
    assert totals["quarantined"] > 0 and totals["restarts"] > 20, totals
