"""The one record of draft work in flight: which draft job each sub-batch has outstanding, and what it covers.

Written only by the drafter link (minedraft/engine/drafter/link.py), the side that submits jobs and hears their
answers: a job is added when the drafter takes it, completed when its answer (drafts, an error, a busy refusal)
arrives, cancelled when a step goes ahead without it, and every job is dropped when the drafter process is replaced
or goes down. The planner holds the same object by reference and only reads it (which requests have drafts coming,
whether a sub-batch may be sent another job); nothing keeps a copy, so the two sides cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class JobInFlight:
    """One draft job the drafter holds and has not answered."""

    group: int
    job_id: int
    # Every request whose tokens the job sends (a hang's suspects are among them).
    carried: frozenset[str]
    # Of those, the requests it drafts: they have drafts coming and sit out the other sub-batch's steps. A catch-up
    # chunk only takes tokens in, so its request decodes meanwhile.
    drafted: frozenset[str]
    sent_at: float
    # The tokens the job makes the drafter take in before it can draft (newcomers' prompts, tokens accepted since the
    # drafter last saw a request): the step record and the cost model price drafting by them.
    catch_up_tokens: int = 0


class InFlight:
    """At most one draft job per sub-batch, by sub-batch."""

    def __init__(self) -> None:
        self._jobs: dict[int, JobInFlight] = {}

    def __contains__(self, group: object) -> bool:
        return group in self._jobs

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[JobInFlight]:
        return iter(list(self._jobs.values()))

    def get(self, group: int | None) -> JobInFlight | None:
        return self._jobs.get(group) if group is not None else None

    def coming(self, group: int) -> frozenset[str]:
        """Requests of `group` whose drafts are being made now."""
        job = self._jobs.get(group)
        return job.drafted if job is not None else frozenset()

    def oldest(self) -> JobInFlight | None:
        """The job sent first (the drafter runs jobs in order: the one it is working on, or stuck on)."""
        return min(self._jobs.values(), key=lambda job: job.job_id, default=None)

    # -- the only writes (by the drafter link) ----------------------------------------------------------------------

    def add(self, job: JobInFlight) -> None:
        if job.group in self._jobs:
            raise ValueError(f"sub-batch {job.group} already has draft job {self._jobs[job.group].job_id} in flight")
        if not job.drafted <= job.carried:
            raise ValueError(f"draft job {job.job_id} drafts requests it does not carry: "
                             f"{sorted(job.drafted - job.carried)}")
        self._jobs[job.group] = job

    def complete(self, job_id: int) -> JobInFlight | None:
        """The drafter answered `job_id`. Returns its job, or None for one no longer in flight (abandoned, or sent to
        a process since replaced)."""
        for group, job in self._jobs.items():
            if job.job_id == job_id:
                del self._jobs[group]
                return job
        return None

    def cancel(self, group: int) -> JobInFlight | None:
        """A step goes ahead without `group`'s job (its drafts are late): it is no longer awaited."""
        return self._jobs.pop(group, None)

    def drop_all(self) -> list[JobInFlight]:
        """The drafter process was replaced or went down: nothing sent to it will be answered."""
        dropped = list(self._jobs.values())
        self._jobs.clear()
        return dropped
