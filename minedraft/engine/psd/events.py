"""What the speculation core hears from a drafter, and the one surface it drafts through (`DraftSource`).

A drafter link (the engine's local drafter process or a shared drafter service, engine/drafter/link.py; the twin's
simulated drafter behind the same link; a test's fake) turns its transport's messages into these typed events; the
core (psd/core.py) handles each in one place. A new kind of answer is one event here, one case in the link that
makes it and one in the core that consumes it. No transport, no vLLM, no clocks: plain frozen, slotted records.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from minedraft.engine.psd.inflight import InFlight, JobInFlight
from minedraft.engine.psd.planner import Draft, JobItemPlan


@dataclass(frozen=True, slots=True)
class DraftsArrived:
    """A job's drafts. `job`: the job it answers (no longer in flight), None for one abandoned or sent to a replaced
    process (its drafts are stale, its timing still tells how fast the drafter is)."""

    job: JobInFlight | None
    job_id: int
    drafts: tuple[tuple[str, Draft], ...]
    draft_seconds: float
    first_token_seconds: float
    idle_seconds: float
    # Requests of the job whose earlier tokens the drafter does not hold (restarted, evicted): resend them whole.
    need_context: tuple[str, ...] = ()

    @property
    def length(self) -> int:
        return max((len(draft.token_ids) for _, draft in self.drafts), default=0)


@dataclass(frozen=True, slots=True)
class JobFailed:
    """The drafter could not draft a job. `culprits`: requests that fail even alone (empty: it could not tell);
    `drafter_broken`: the drafter fails whatever it is given (a sticky device error)."""

    job: JobInFlight | None
    job_id: int
    message: str
    culprits: tuple[str, ...] = ()
    drafter_broken: bool = False


@dataclass(frozen=True, slots=True)
class DrafterBusy:
    """A shared drafter service refused a job (queue full, or past this engine's deadline): verify without drafts."""

    job: JobInFlight | None
    job_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class JobHung:
    """The drafter made no progress with work outstanding and is being restarted; `carried`: the requests of the job
    it was stuck on (the suspects)."""

    carried: frozenset[str]


@dataclass(frozen=True, slots=True)
class DrafterRestarted:
    """A new drafter process is up: it holds no request's tokens, and nothing sent to the old one will be answered."""


DrafterEvent = DraftsArrived | JobFailed | DrafterBusy | JobHung | DrafterRestarted

# (request id, first committed position, end position) -> those committed token ids: how a draft source gets the
# tokens a job sends (the core never holds token ids; the host does).
TokenReader = Callable[[str, int, int], Sequence[int]]


@dataclass(frozen=True, slots=True)
class JobTimes:
    """What the draft jobs of one sub-batch that answered during a step cost, and their size: the step records the
    verified sub-batch's, and the cost model prices drafting by the job's own requests and length (in a step after
    a switch the requests verified with drafts are not the job's: psd after sd verifies half the job's requests)."""

    draft_seconds: float = 0.0
    first_token_seconds: float = 0.0
    idle_seconds: float = 0.0
    requests: int = 0
    length: int = 0
    # Catch-up tokens the job carried: what its drafter took in before drafting position 1.
    catch_up_tokens: int = 0

    def add(self, drafts: DraftsArrived, catch_up_tokens: int = 0) -> JobTimes:
        return JobTimes(self.draft_seconds + drafts.draft_seconds,
                        self.first_token_seconds + drafts.first_token_seconds,
                        self.idle_seconds + drafts.idle_seconds, self.requests + len(drafts.drafts),
                        max(self.length, drafts.length), self.catch_up_tokens + catch_up_tokens)


@dataclass(frozen=True, slots=True)
class WaitResult:
    waited_seconds: float
    arrived: bool
    # Every event heard while waiting, in order.
    events: tuple[DrafterEvent, ...] = ()


class DraftSource(Protocol):
    """Where the core's draft jobs go and its events come from: the drafter link, or a fake in tests.

    The source owns the record of jobs in flight (`jobs`, read by the planner); it adds a job when the drafter takes
    it and completes it when its answer arrives, so an event's `job` is already out of flight."""

    jobs: InFlight

    @property
    def up(self) -> bool:
        """A drafter is attached and can take jobs now."""

    @property
    def attached(self) -> bool:
        """A drafter (up or not) is configured: without one every step is plain decoding."""

    @property
    def loading(self) -> bool:
        """A drafter is starting (loading its model)."""

    @property
    def max_context_tokens(self) -> int:
        """The longest context the drafter holds (0: no known limit)."""

    def poll(self, timeout_seconds: float) -> list[DrafterEvent]:
        """The drafter's answers that arrived (waiting at most `timeout_seconds` for one)."""

    def check(self) -> bool:
        """Whether the drafter can take jobs; restarts a dead or hung one. What it found (JobHung, DrafterRestarted)
        comes out of `take_events`."""

    def take_events(self) -> list[DrafterEvent]:
        """Health events noticed since the last call (a hang, a new process)."""

    def wait_for(self, group: int, budget_seconds: float) -> WaitResult:
        """Wait at most `budget_seconds` for the job of `group`, collecting every event meanwhile."""

    def submit(self, group: int, items: Sequence[JobItemPlan], tokens: TokenReader, want_logprobs: bool,
               top_f: int = 0) -> bool:
        """Send `group` a draft job; False if the drafter did not take it. `top_f` (lookahead; only passed when
        above 0): the drafts come with the drafter's top-F candidates per position."""

    def abandon(self, group: int) -> None:
        """Go ahead without this job's drafts (the drafter keeps its requests' tokens)."""

    def forget(self, request_ids: list[str]) -> None:
        """These requests finished: the drafter drops their tokens and KV."""

    def drafter_failed(self, reason: str) -> None:
        """The drafter, not a request, fails jobs: restart it."""

    def job_failed_unattributed(self) -> None:
        """A job failed naming no request: after enough in a row, restart the drafter."""
