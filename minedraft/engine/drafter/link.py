"""The verifier's link to the drafter: draft jobs in flight per sub-batch, bounded waits, hang detection and restarts.

No policy lives here (the planner decides what to draft and how long a step may wait); this module keeps the one
record of which job is in flight for which sub-batch (psd.inflight.InFlight, which the planner reads by reference:
the link is its only writer), routes the drafter's answers to their job, and notices a drafter that makes no
progress with work outstanding, which it restarts in the background (the new process loads while the engine keeps
serving without drafts).

Slow is not hung: a working drafter reports progress after its steps (protocol.Progress), so a job may take any time
while steps keep finishing (a long prompt's prefill, a drafter sharing its cores); late drafts only cost the planner
a step without them. Only `hang_seconds` without any message while a job is outstanding means hung: a restart loses
every request's drafter-side tokens and KV, so it is kept for a drafter that has stopped.

Broken is not poisoned: a drafter that fails every job (a sticky device error) says so (protocol.DrafterError's
drafter_broken, after a probe job fails too), and is restarted instead of having every request quarantined; the
client backs its restarts off until a job succeeds again. After a hang the link keeps the stuck job's requests
(a `JobHung` event), so the planner can find the context that makes the drafter hang rather than resend it forever.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from minedraft.engine.drafter import protocol
from minedraft.engine.drafter.client import DrafterClient, DrafterState
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
from minedraft.engine.psd.planner import Draft, JobItemPlan

log = logging.getLogger(__name__)

def catch_up_tokens(items: list[protocol.DraftItem]) -> int:
    """The tokens a job makes the drafter take in before it can draft: per request, the committed tokens it carries
    beyond the last one (which the draft loop's first pass reads anyway): the tokens accepted since the drafter last
    saw the request, or a newcomer's whole prompt (a catch-up chunk's tokens all count)."""
    return sum(max(0, len(item.token_ids) - 1) if item.num_draft_tokens else len(item.token_ids) for item in items)


def _as_list(token_ids: Sequence[int]) -> list[int]:
    """A reader's tokens as the message's list, copied only if they are not one already (a slice of vLLM's token list
    is)."""
    return token_ids if isinstance(token_ids, list) else list(token_ids)


def to_event(job: JobInFlight | None, message: protocol.FromDrafter) -> DrafterEvent | None:
    """The core's event for a drafter's answer to a job (`job`: the job it answers, already out of flight; None for
    one abandoned or sent to a replaced process). None: nothing the core acts on."""
    if isinstance(message, protocol.DraftReply):
        drafts = tuple((r.request_id, Draft(r.context_num_tokens, r.token_ids, r.logprobs, tuple(r.tail),
                                            tuple(tuple(c) for c in r.candidates))) for r in message.results)
        return DraftsArrived(job, message.job_id, drafts, message.draft_seconds, message.first_token_seconds,
                             message.idle_seconds, tuple(message.need_context))
    if isinstance(message, protocol.DrafterError):
        return JobFailed(job, message.job_id, message.message, tuple(message.request_ids), message.drafter_broken)
    if isinstance(message, protocol.DrafterBusy):
        return DrafterBusy(job, message.job_id, message.reason)
    return None


class DrafterLink:
    def __init__(self, client: DrafterClient | None, hang_seconds: float, max_failed_jobs: int,
                 clock: Callable[[], float] = time.monotonic, jobs: InFlight | None = None) -> None:
        self.client = client
        # The jobs in flight: shared with the planner (PSDPlanner.in_flight), written only here.
        self.jobs = jobs if jobs is not None else InFlight()
        # Work outstanding and no progress from the drafter for this long: it is hung (alive but stopped). Its own
        # setting (drafter.hang_seconds), not the draft deadline: a job later than its step is normal under load.
        self.hang_seconds = hang_seconds
        self.max_failed_jobs = max_failed_jobs
        self._clock = clock
        self._starts_seen = client.num_starts if client is not None else 0
        # Silence is judged over the time jobs were outstanding since the drafter was last heard from, added up across
        # spells with none (between bursts of requests): a stopped drafter never answers any of them, while a live one
        # answers a new job within a step. Starting afresh with each spell let a stopped drafter serving short bursts
        # go unnoticed until the engine's sends to it backed up.
        self._busy_since: float | None = None
        self._busy_before_seconds = 0.0
        self._last_heard_at = clock()
        self.consecutive_failed_jobs = 0
        self.num_hangs = 0
        self.num_drafter_failures = 0
        self.num_progress_reports = 0
        # Health events noticed and not yet taken (take_events): a hang, a new process.
        self._events: list[DrafterEvent] = []

    def attach(self, client: DrafterClient) -> None:
        self.client = client
        self._starts_seen = client.num_starts
        self.jobs.drop_all()

    @property
    def up(self) -> bool:
        return self.client is not None and self.client.state is DrafterState.UP

    @property
    def attached(self) -> bool:
        return self.client is not None

    @property
    def max_context_tokens(self) -> int:
        return int(getattr(self.client, "max_context_tokens", 0) or 0)

    @property
    def loading(self) -> bool:
        """A drafter process is starting (loading its model on its cores): the target must not widen onto them."""
        return self.client is not None and self.client.state is DrafterState.STARTING

    # -- health ----------------------------------------------------------------------------------------------------

    def check(self) -> bool:
        """Whether the drafter can take jobs now; restarts a dead or hung one (without waiting for it)."""
        if self.client is None:
            return False
        now = self._clock()
        # A new process (killed and replaced since the last look): jobs sent to the old one will never be answered,
        # and their age says nothing about the new one.
        self._notice_restart()
        silent_busy_seconds = self.silent_busy_seconds(now)
        stuck = self.jobs.oldest()
        if stuck is not None and silent_busy_seconds > self.hang_seconds:
            self.num_hangs += 1
            self._events.append(JobHung(stuck.carried))
            self._restart(f"no progress for {silent_busy_seconds:.1f}s with a job outstanding")
        alive = self.client.check_alive()
        if not alive:
            self._clear()
        return alive

    def silent_busy_seconds(self, now: float) -> float:
        """Time with a job outstanding since the drafter was last heard from (every spell of outstanding work)."""
        current = now - max(self._busy_since, self._last_heard_at) if self._busy_since is not None else 0.0
        return self._busy_before_seconds + max(0.0, current)

    def _set_idle(self, now: float) -> None:
        if self._busy_since is not None:
            self._busy_before_seconds += max(0.0, now - max(self._busy_since, self._last_heard_at))
        self._busy_since = None

    def _notice_restart(self) -> None:
        """Once per new drafter process (it holds no request's tokens): drop what was in flight, say so."""
        if self.client is None or self.client.num_starts == self._starts_seen:
            return
        self._starts_seen = self.client.num_starts
        self._clear()
        self._events.append(DrafterRestarted())

    def take_events(self) -> list[DrafterEvent]:
        """Health events since the last call, in order: JobHung (the requests of the job the drafter was stuck on),
        DrafterRestarted (once after each new process started)."""
        self._notice_restart()
        events, self._events = self._events, []
        return events

    def drafter_failed(self, reason: str) -> None:
        """The drafter, not a request, fails jobs: restart it (the client backs off while this repeats)."""
        self.num_drafter_failures += 1
        self._restart(reason)

    def job_failed_unattributed(self) -> None:
        """A job failed and the drafter could not name a request: after enough in a row, restart it."""
        self.consecutive_failed_jobs += 1
        if self.consecutive_failed_jobs >= self.max_failed_jobs:
            self._restart(f"{self.consecutive_failed_jobs} draft jobs failed in a row")

    def _restart(self, reason: str) -> None:
        assert self.client is not None
        self._clear()
        self.consecutive_failed_jobs = 0
        self.client.mark_hung(reason)

    def _clear(self) -> None:
        self.jobs.drop_all()
        self._busy_since = None
        self._busy_before_seconds = 0.0

    # -- jobs ------------------------------------------------------------------------------------------------------

    def submit(self, group: int, items: Sequence[JobItemPlan], tokens: TokenReader, want_logprobs: bool,
               top_f: int = 0) -> bool:
        """The core's job for `group`: per request only the tokens the drafter does not hold yet (O(new tokens), not
        O(context), per request per step); lookahead's branches carry their speculative tails apart."""
        return self.send(group, [protocol.DraftItem(
            item.request_id, _as_list(tokens(item.request_id, item.base_num_tokens, item.num_tokens)),
            item.num_draft_tokens, item.base_num_tokens, list(item.tail), item.branch) for item in items],
            want_logprobs, top_f)

    def send(self, group: int, items: list[protocol.DraftItem], want_logprobs: bool, top_f: int = 0) -> bool:
        if self.client is None or group in self.jobs:
            return False
        # (top_f only when asked for: a client that predates lookahead, such as a test's, takes two arguments.)
        ticket = self.client.submit(items, want_logprobs, top_f=top_f) if top_f else \
            self.client.submit(items, want_logprobs)
        if ticket is None:
            return False
        if not self.jobs:
            self._busy_since = self._clock()
        drafted = frozenset(item.request_id for item in items if item.num_draft_tokens > 0)
        self.jobs.add(JobInFlight(group, ticket.job_id, ticket.request_ids, drafted, ticket.sent_at,
                                  catch_up_tokens(items)))
        return True

    def abandon(self, group: int) -> None:
        """Go ahead without this job's drafts: the drafter skips it but keeps its requests' tokens and KV."""
        job = self.jobs.cancel(group)
        if not self.jobs:
            self._set_idle(self._clock())
        if job is not None and self.client is not None:
            self.client.cancel_jobs([job.job_id])

    def forget(self, request_ids: list[str]) -> None:
        if self.client is not None and request_ids:
            self.client.cancel(sorted(request_ids))

    def poll(self, timeout_seconds: float) -> list[DrafterEvent]:
        """The drafter's answers that arrived (waiting at most `timeout_seconds` for a message), as events."""
        events: list[DrafterEvent] = []
        if self.client is None:
            return events
        for message in self.client.receive(timeout_seconds):
            # Any message is progress: a reply, an error, or a report that a step of the current job finished.
            self._last_heard_at = self._clock()
            self._busy_before_seconds = 0.0
            if isinstance(message, protocol.Progress):
                self.num_progress_reports += 1
                continue
            job = None
            if isinstance(message, protocol.DraftReply | protocol.DrafterError | protocol.DrafterBusy):
                job = self._complete(message.job_id)
                if isinstance(message, protocol.DraftReply):
                    self.consecutive_failed_jobs = 0
            event = to_event(job, message)
            if event is not None:
                events.append(event)
        return events

    def wait_for(self, group: int, budget_seconds: float) -> WaitResult:
        """Wait at most `budget_seconds` for the job of `group`, collecting every answer meanwhile. Timed by the
        link's clock, so a simulated drafter (minedraft.twin) runs this very loop on simulated time."""
        events: list[DrafterEvent] = []
        started = self._clock()
        deadline = started + budget_seconds
        down = False
        while group in self.jobs:
            remaining = deadline - self._clock()
            if remaining <= 0:
                break
            events.extend(self.poll(min(remaining, 0.05)))
            if not self.check():
                down = True
                break
        return WaitResult(self._clock() - started, not down and group not in self.jobs, tuple(events))

    def _complete(self, job_id: int) -> JobInFlight | None:
        job = self.jobs.complete(job_id)
        if job is not None:
            self._busy_since = self._clock() if self.jobs else None
        return job

    def shutdown(self) -> None:
        if self.client is not None:
            self.client.shutdown()
