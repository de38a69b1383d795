"""The verifier's link to the drafter: job tickets per sub-batch, bounded waits, hang detection and restarts.

No policy lives here (the planner decides what to draft and how long a step may wait); this module only knows
which job is in flight for which sub-batch, routes the drafter's messages to their sub-batch, and notices a drafter
that makes no progress with work outstanding, which it restarts in the background (the new process loads while the
engine keeps serving without drafts).

Slow is not hung: a working drafter reports progress after its steps (protocol.Progress), so a job may take any time
while steps keep finishing (a long prompt's prefill, a drafter sharing its cores); late drafts only cost the planner
a step without them. Only `hang_seconds` without any message while a job is outstanding means hung: a restart loses
every request's drafter-side tokens and KV, so it is kept for a drafter that has stopped.

Broken is not poisoned: a drafter that fails every job (a sticky device error) says so (protocol.DrafterError's
drafter_broken, after a probe job fails too), and is restarted instead of having every request quarantined; the
client backs its restarts off until a job succeeds again. After a hang the link keeps the stuck job's requests
(`take_hung_job`), so the planner can find the context that makes the drafter hang rather than resend it forever.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from minedraft.engine.drafter import protocol
from minedraft.engine.drafter.client import DrafterClient, DrafterState, JobTicket

log = logging.getLogger(__name__)

# (sub-batch of the job the message answers, or None for an abandoned job; the message)
MessageHandler = Callable[[int | None, protocol.FromDrafter], None]


@dataclass(frozen=True)
class JobTimes:
    """What the draft jobs of one sub-batch that answered during a step cost, and their size: the step records the
    verified sub-batch's, and the cost model prices drafting by the job's own requests and length (in a step after
    a switch the requests verified with drafts are not the job's: psd after sd verifies half the job's requests)."""

    draft_seconds: float = 0.0
    first_token_seconds: float = 0.0
    idle_seconds: float = 0.0
    requests: int = 0
    length: int = 0
    # Catch-up tokens the job carried (see catch_up_tokens): what its drafter took in before drafting position 1.
    catch_up_tokens: int = 0


def catch_up_tokens(items: list[protocol.DraftItem]) -> int:
    """The tokens a job makes the drafter take in before it can draft: per request, the committed tokens it carries
    beyond the last one (which the draft loop's first pass reads anyway): the tokens accepted since the drafter last
    saw the request, or a newcomer's whole prompt (a catch-up chunk's tokens all count)."""
    return sum(max(0, len(item.token_ids) - 1) if item.num_draft_tokens else len(item.token_ids) for item in items)


def add_reply(times: JobTimes | None, reply: protocol.DraftReply, catch_up: int = 0) -> JobTimes:
    """A sub-batch's job times in a step, with one more reply for it (`catch_up`: the tokens its job carried)."""
    times = times or JobTimes()
    length = max((len(result.token_ids) for result in reply.results), default=0)
    return JobTimes(times.draft_seconds + reply.draft_seconds, times.first_token_seconds + reply.first_token_seconds,
                    times.idle_seconds + reply.idle_seconds, times.requests + len(reply.results),
                    max(times.length, length), times.catch_up_tokens + catch_up)


@dataclass(frozen=True)
class WaitResult:
    waited_seconds: float
    arrived: bool


class DrafterLink:
    def __init__(self, client: DrafterClient | None, hang_seconds: float, max_failed_jobs: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.tickets: dict[int, JobTicket] = {}
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
        # Requests of the job the drafter was stuck on at its last hang (the oldest outstanding: jobs run in order).
        self._hung_job: frozenset[str] | None = None
        # The catch-up tokens of the job whose reply is being handled (set just before each DraftReply is handed to
        # the handler: what that job really carried, for the step record and the cost model).
        self.reply_catch_up_tokens = 0

    def attach(self, client: DrafterClient) -> None:
        self.client = client
        self._starts_seen = client.num_starts
        self.tickets.clear()

    @property
    def up(self) -> bool:
        return self.client is not None and self.client.state is DrafterState.UP

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
        if self.client.num_starts != self._starts_seen:
            # A new process (killed and replaced since the last look): jobs sent to the old one will never be
            # answered, and their age says nothing about the new one. take_restarted() still reports the restart.
            self._clear()
        silent_busy_seconds = self.silent_busy_seconds(now)
        if self.tickets and silent_busy_seconds > self.hang_seconds:
            self.num_hangs += 1
            self._hung_job = min(self.tickets.values(), key=lambda ticket: ticket.job_id).request_ids
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

    def take_restarted(self) -> bool:
        """True once after each new drafter process started (it holds no request's tokens)."""
        if self.client is None or self.client.num_starts == self._starts_seen:
            return False
        self._starts_seen = self.client.num_starts
        self._clear()
        return True

    def take_hung_job(self) -> frozenset[str] | None:
        """Once after a hang: the requests of the job the drafter was stuck on."""
        hung, self._hung_job = self._hung_job, None
        return hung

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
        self.tickets.clear()
        self._busy_since = None
        self._busy_before_seconds = 0.0

    # -- jobs ------------------------------------------------------------------------------------------------------

    def submit(self, group: int, items: list[protocol.DraftItem], want_logprobs: bool) -> bool:
        if self.client is None or group in self.tickets:
            return False
        ticket = self.client.submit(items, want_logprobs)
        if ticket is None:
            return False
        ticket.catch_up_tokens = catch_up_tokens(items)
        if not self.tickets:
            self._busy_since = self._clock()
        self.tickets[group] = ticket
        return True

    def abandon(self, group: int) -> None:
        """Go ahead without this job's drafts: the drafter skips it but keeps its requests' tokens and KV."""
        ticket = self.tickets.pop(group, None)
        if not self.tickets:
            self._set_idle(self._clock())
        if ticket is not None and self.client is not None:
            self.client.cancel_jobs([ticket.job_id])

    def forget(self, request_ids: list[str]) -> None:
        if self.client is not None and request_ids:
            self.client.cancel(sorted(request_ids))

    def poll(self, timeout_seconds: float, handle: MessageHandler) -> None:
        if self.client is None:
            return
        for message in self.client.receive(timeout_seconds):
            # Any message is progress: a reply, an error, or a report that a step of the current job finished.
            self._last_heard_at = self._clock()
            self._busy_before_seconds = 0.0
            if isinstance(message, protocol.Progress):
                self.num_progress_reports += 1
                continue
            group = None
            self.reply_catch_up_tokens = 0
            if isinstance(message, protocol.DraftReply | protocol.DrafterError | protocol.DrafterBusy):
                group, self.reply_catch_up_tokens = self._drop_ticket(message.job_id)
                if isinstance(message, protocol.DraftReply):
                    self.consecutive_failed_jobs = 0
            handle(group, message)

    def wait_for(self, group: int, budget_seconds: float, handle: MessageHandler) -> WaitResult:
        """Wait at most `budget_seconds` for the job of `group`, handling every message meanwhile. Timed by the link's
        clock, so a simulated drafter (minedraft.twin) runs this very loop on simulated time."""
        started = self._clock()
        deadline = started + budget_seconds
        down = False
        while group in self.tickets:
            remaining = deadline - self._clock()
            if remaining <= 0:
                break
            self.poll(min(remaining, 0.05), handle)
            if not self.check():
                down = True
                break
        return WaitResult(self._clock() - started, not down and group not in self.tickets)

    def _drop_ticket(self, job_id: int) -> tuple[int | None, int]:
        """The sub-batch of a tracked job (None: abandoned or unknown) and its catch-up tokens."""
        for group, ticket in list(self.tickets.items()):
            if ticket.job_id == job_id:
                del self.tickets[group]
                self._busy_since = self._clock() if self.tickets else None
                return group, ticket.catch_up_tokens
        return None, 0

    def shutdown(self) -> None:
        if self.client is not None:
            self.client.shutdown()
