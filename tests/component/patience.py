"""Timing taken out of what the component tests claim about drafts.

The shared engines run on a machine that is shared and loaded (two cores, TP ranks, the drafter, other processes).
In production a step waits for its sub-batch's drafts only a fraction of a measured step (planner.WaitPolicy) and a
drafter silent for drafter.hang_seconds with work outstanding is restarted; both are right for serving and both
make "drafts took part", "most verified requests carry drafts" or an acceptance rate depend on the drafter keeping up
with the target on a loaded machine. The test engines therefore wait for every job up to the configured cap (the
10 s drafter deadline) and take only a drafter silent for HANG_SECONDS for hung: what the tests check (lossless
output, the target's distribution, which requests get drafts) no longer depends on timing.

The tests about timing itself (a stopped drafter, a hung one, deadline misses) put the production policy back for
their duration with measured_waits().
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from minedraft.engine.psd.planner import WaitPolicy

# A working drafter reports progress every 0.25 s of work: this much silence on a loaded machine is a real hang (the
# test then fails, as it should, only later), never a slow step.
HANG_SECONDS = 300.0


def wait_for_drafts(engine: Any) -> Any:
    """Make a psd engine wait for its drafts (up to the deadline cap) and be slow to call its drafter hung."""
    scheduler = engine.psd_scheduler
    policy = scheduler.core.wait_policy
    # budget = min(cap, max(floor, slack * measured)): a floor at the cap makes it the cap whatever was measured.
    policy.floor_seconds = policy.cap_seconds
    scheduler.link.hang_seconds = max(scheduler.link.hang_seconds, HANG_SECONDS)
    return engine


@contextlib.contextmanager
def measured_waits(engine: Any) -> Iterator[Any]:
    """The production wait policy and the engine's configured hang threshold, for tests about lateness; restored
    afterwards."""
    scheduler = engine.psd_scheduler
    policy, link = scheduler.core.wait_policy, scheduler.link
    saved = (policy.floor_seconds, policy.slack, link.hang_seconds)
    defaults = WaitPolicy(cap_seconds=policy.cap_seconds)
    policy.floor_seconds, policy.slack = defaults.floor_seconds, defaults.slack
    link.hang_seconds = engine.settings.drafter.hang_seconds
    try:
        yield engine
    finally:
        policy.floor_seconds, policy.slack, link.hang_seconds = saved


def drafts_missing(engine: Any, before: Any, after: Any) -> str:
    """The assertion message when drafts took no part: what the drafter did meanwhile, so a failure says why."""
    scheduler = engine.psd_scheduler
    return (f"drafts took no part: {after.draft_tokens - before.draft_tokens} draft tokens verified, "
            f"{after.deadline_misses - before.deadline_misses} deadline misses, "
            f"{after.drafter_restarts - before.drafter_restarts} drafter restarts, hangs detected "
            f"{scheduler.link.num_hangs}, drafter state {scheduler.drafter.state.value}, last error "
            f"{scheduler.drafter.last_error!r}")
