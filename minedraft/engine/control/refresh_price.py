"""What lookahead's refresh of its misses (core._refresh_misses) adds to a step, as the cost model prices it.

Where misses are most of the batch (one request: every miss) the engine drafts them from their real context before
launching the step and waits for that draft (psd/lookahead.refresh_pays): a refreshed miss is verified with k
drafted tokens like a hit, gaining an accepted length of tokens instead of one, and the step waits a drafter round
trip first. Without knowing this the cost model credited a refreshed miss one token while pricing its k verified
tokens (the measured proposed share counts them), and left the wait out: at one request on this CPU it priced
lookahead below sd, where lookahead runs 1.2-1.4x sd.

Both are measured per number of running requests, since the engine refreshes by load (at 16 requests misses are a
small share and are verified at once): a load never measured near one that refreshed is priced without refreshes,
as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A load within this factor of one measured is priced from it (the auto controller's extrapolation slack).
LOAD_SLACK = 1.5


@dataclass
class RefreshCounts:
    """Per running requests: [refreshed misses, misses, refresh seconds, lookahead steps, steps that refreshed],
    decayed per step."""

    decay: float = 0.98
    # Steps measured at a load before its figures price it.
    min_steps: float = 4.0
    counts: dict[int, list[float]] = field(default_factory=dict)

    def observe(self, num_running: int, misses: int, refreshed: int, refresh_seconds: float) -> None:
        if num_running <= 0:
            return
        row = self.counts.setdefault(num_running, [0.0] * 5)
        row[:] = [value * self.decay for value in row]
        row[0] += min(refreshed, misses)
        row[1] += misses
        row[2] += max(0.0, refresh_seconds)
        row[3] += 1.0
        row[4] += 1.0 if refreshed > 0 else 0.0

    def _row(self, num_running: int) -> list[float] | None:
        near = [load for load, row in self.counts.items()
                if row[3] >= self.min_steps and num_running / LOAD_SLACK <= load <= num_running * LOAD_SLACK]
        if not near:
            return None
        return self.counts[min(near, key=lambda load: abs(load - num_running))]

    def refreshed_share_of_misses(self, num_running: int) -> float:
        """Of a lookahead step's misses at this load, the share verified with a refresh's draft (0 unmeasured)."""
        row = self._row(num_running)
        return row[0] / row[1] if row is not None and row[1] > 0 else 0.0

    def wait_seconds_per_step(self, num_running: int, miss_rate: float) -> float:
        """Seconds a lookahead step at this load waits for a refresh, on average over its steps, at a share
        `miss_rate` of its requests missing (0 unmeasured): one wait per step that refreshes (it drafts all of that
        step's refreshed misses), in a share of steps taken as min(1, requests x miss rate x refreshed share), exact
        at one request, where refreshes pay most. The share of steps that refreshed where it was measured belongs
        to the draft length run there; other draft lengths miss at other rates."""
        row = self._row(num_running)
        if row is None or row[4] <= 0:
            return 0.0
        wait_per_refresh = row[2] / row[4]
        share = row[0] / row[1] if row[1] > 0 else 0.0
        return wait_per_refresh * min(1.0, num_running * miss_rate * share)
