"""Lookahead's policy: which outcomes of the step in flight are pre-drafted, and which branch a request takes.

Every lookahead step verifies the whole decoding batch. As soon as it is launched (the target has its proposals, the
forward has not run) the core sends one branch job for the next round: per request, the outcomes the verification is
likely to have, each as a branch item (its committed context plus a speculative tail: the accepted drafts d[:a] and a
bonus token b). When the step's outcome is in, each request takes the branch whose context and tail its committed
tokens match exactly (`match`); drafts are proposals, so a branch is verified by the target like any draft and the
output stays lossless whatever was pre-drafted.

Ranking. An outcome is (a, b): a accepted drafts, then the target's token b at position a+1. Its probability is
P(a) * q(rank of b): P(a) from the acceptance per position measured here (position i+1 accepted given i were, Laplace
smoothed), q from how often the target's token was the drafter's rank-r candidate, measured apart after a full
acceptance and after a rejection (after a rejection the rejected draft token is excluded: under greedy and keyed
sampling the target's token then differs from it). The job keeps the likeliest outcomes across the batch within the
fan-out: each request's top one, then the rest by probability, at most `max_fanout` per request and as many in all
as pays for itself in measured time (`choose_fanout`), so fan-out goes where acceptance is low (a request whose
drafts are usually accepted needs one branch; one at a coin toss needs several).

A request without a branch (a newcomer, a miss, the drafter late or restarted, the job abandoned) is verified with a
backup where one exists (planner._plan_lookahead: a branch drafted for its accepted length with another bonus token),
else without drafts in that step, while its root item (its real context, no tail) is drafted k + 1 deep. Chosen over
waiting for a short draft because waiting stalls the whole batch for one request, while a step without drafts costs
that request only the tokens its drafts would have added; and the root draft becomes a branch for free: its first
drafted token is
the drafter's guess for the token this step samples, so if the target agrees (`match` reads drafted tokens the
request has since committed as part of the tail), the remaining k tokens are a draft for the next round. Waiting does
pay where the misses are most of the batch (one request: every miss) and drafting is short next to a step: there the
engine drafts the misses from their real context first and waits (`refresh_pays`, core._refresh_misses), so a miss
costs a short wait instead of a step that makes about one token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minedraft.engine.psd.planner import Draft

# (request id, start, end) -> committed token ids (psd/events.TokenReader; here without importing events).
Tokens = Callable[[str, int, int], Sequence[int]]

# Outcomes less likely than this are not drafted: a branch costs the drafter a row of every forward.
MIN_BRANCH_PROBABILITY = 0.02
# A refresh must promise this much more than verifying the misses at once: its price is a drafter round trip, which
# on a machine shared with other processes swings several-fold from step to step (a coin toss not worth a wait).
REFRESH_MARGIN = 1.1
# A shape's measured price is trusted for this many jobs after it was measured; then the shape is priced by the line
# fitted to the fresh prices (and tried again where that says it pays).
STALE_JOBS = 64
# Before anything is measured: the target's token is the drafter's rank-r candidate with these odds.
RANK_PRIOR = (0.5, 0.2, 0.1, 0.05)
PRIOR_WEIGHT = 4.0


def match(branches: Sequence[Draft], num_tokens: int, request_id: str, tokens: Tokens) -> tuple[Draft, int] | None:
    """The branch a request at `num_tokens` committed tokens takes, and how many of its drafted tokens the request has
    already committed (0 for an exact branch; 1 for a root draft whose first token the target sampled too); None
    when none matches exactly. A branch matches if the request's committed tokens end with its tail followed by those
    drafted tokens, at the branch's context length: the proposal is then the draft made from exactly this context."""
    for draft in branches:
        already = num_tokens - draft.context_num_tokens
        if already < 0 or already >= len(draft.token_ids):
            continue
        expected = [*draft.tail, *draft.token_ids[:already]]
        if not expected:
            return draft, 0  # a draft for exactly this committed context, nothing assumed
        if list(tokens(request_id, num_tokens - len(expected), num_tokens)) == expected:
            return draft, already
    return None


@dataclass(frozen=True, slots=True)
class Outcome:
    request_id: str
    probability: float
    # The branch's tail: the accepted drafts and the bonus token.
    tail: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Verified:
    """What a request's step verified with candidates, kept until its outcome is in (to learn acceptance and ranks)."""

    num_tokens: int
    drafted: tuple[int, ...]
    candidates: tuple[tuple[int, ...], ...]


@dataclass
class BonusCounts:
    """How often the target's bonus token was the drafter's rank-r candidate (`covered`: within the top-F)."""

    by_rank: list[float] = field(default_factory=list)
    total: float = 0.0
    covered: float = 0.0

    def observe(self, rank: int | None) -> None:
        self.total += 1
        if rank is not None:
            self.covered += 1
            if len(self.by_rank) <= rank:
                self.by_rank.extend([0.0] * (rank + 1 - len(self.by_rank)))
            self.by_rank[rank] += 1

    def probability(self, rank: int) -> float:
        prior = RANK_PRIOR[rank] if rank < len(RANK_PRIOR) else RANK_PRIOR[-1] / 2 ** (rank - len(RANK_PRIOR) + 1)
        seen = self.by_rank[rank] if rank < len(self.by_rank) else 0.0
        return (seen + PRIOR_WEIGHT * prior) / (self.total + PRIOR_WEIGHT)


@dataclass
class LookaheadStats:
    """Acceptance per position and bonus-token ranks, measured from lookahead's own verifications."""

    # reached[i]: verifications whose drafts got to position i+1 (i accepted, a token drafted there); accepted[i]: of
    # those, position i+1 accepted too.
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    after_full: BonusCounts = field(default_factory=BonusCounts)
    after_reject: BonusCounts = field(default_factory=BonusCounts)
    # Drafter seconds of branch jobs by the shape they were sent with, (fan-out, branch depth) (EMA): what prices a
    # shape.
    job_seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    # The job count when each shape was last measured: a price older than STALE_JOBS jobs is not trusted as it stands
    # (it may date from a busy machine) and the shape is priced by the fit of the fresh ones instead.
    job_measured_at: dict[tuple[int, int], int] = field(default_factory=dict)
    num_jobs: int = 0
    # The fresh prices and their line as of job `_priced_at` (a shape choice prices every shape: derived once per job,
    # not once per shape).
    _priced_at: int = field(default=-1, repr=False, compare=False)
    _fresh: dict[tuple[int, int], float] = field(default_factory=dict, repr=False, compare=False)
    _line: tuple[float, float] | None = field(default=None, repr=False, compare=False)
    alpha: float = 0.3
    # A lookahead step's seconds without a refresh's wait, and a refresh's wait (a draft of the misses from their
    # real context, sent and waited for before the step is launched), as EMAs: what refresh_pays weighs.
    step_seconds: float | None = None
    refresh_seconds: float | None = None
    # A lookahead step's host work (committing its tokens, planning and scheduling the next), EMA: the drafter works
    # on through it, so a branch job has the verification plus this before the next step waits for it.
    host_seconds: float = 0.0
    # Tokens a miss verified at once (with a backup branch, or without drafts) made, EMA over such misses: what a
    # refresh is weighed against. Before any: one (the backup rejected at once).
    miss_tokens: float = 1.0

    def observe_step(self, seconds: float, host_seconds: float = 0.0) -> None:
        if seconds > 0:
            self.step_seconds = seconds if self.step_seconds is None else (
                (1 - self.alpha) * self.step_seconds + self.alpha * seconds)
        if host_seconds > 0:
            self.host_seconds = (host_seconds if not self.host_seconds
                                 else (1 - self.alpha) * self.host_seconds + self.alpha * host_seconds)

    def observe_miss_tokens(self, tokens: float, misses: int) -> None:
        """`misses` requests verified at once without their branch made `tokens` tokens in all."""
        if misses > 0:
            weight = 1 - (1 - self.alpha) ** misses
            self.miss_tokens += weight * (tokens / misses - self.miss_tokens)

    def observe_refresh(self, seconds: float) -> None:
        if seconds > 0:
            self.refresh_seconds = seconds if self.refresh_seconds is None else (
                (1 - self.alpha) * self.refresh_seconds + self.alpha * seconds)

    def acceptance(self, position: int) -> float:
        """P(position+1 accepted | the first `position` were)."""
        reached = self.reached[position] if position < len(self.reached) else 0.0
        accepted = self.accepted[position] if position < len(self.accepted) else 0.0
        return (accepted + 1.0) / (reached + 2.0)

    def observe_acceptance(self, num_drafted: int, num_accepted: int) -> None:
        for position in range(min(num_drafted, num_accepted + 1)):
            if len(self.reached) <= position:
                self.reached.append(0.0)
                self.accepted.append(0.0)
            self.reached[position] += 1
            self.accepted[position] += position < num_accepted

    def observe_job(self, draft_seconds: float, shape: tuple[int, int]) -> None:
        """A branch job sent with `shape` (fan-out, depth) took `draft_seconds` in the drafter."""
        if draft_seconds <= 0 or min(shape) <= 0:
            return
        old = self.job_seconds.get(shape)
        fresh = old is not None and self.num_jobs - self.job_measured_at.get(shape, 0) <= STALE_JOBS
        self.num_jobs += 1
        self.job_seconds[shape] = (1 - self.alpha) * old + self.alpha * draft_seconds if fresh and old is not None \
            else draft_seconds
        self.job_measured_at[shape] = self.num_jobs

    def expected_accepted(self, length: int) -> float:
        """Drafts a verification of `length` drafted tokens is expected to accept (the acceptance measured here)."""
        total, reach = 0.0, 1.0
        for position in range(length):
            reach *= self.acceptance(position)
            total += reach
        return total

    def _fresh_prices(self) -> dict[tuple[int, int], float]:
        self._price()
        return self._fresh

    def _price(self) -> None:
        if self._priced_at == self.num_jobs:
            return
        self._fresh = {shape: seconds for shape, seconds in self.job_seconds.items()
                       if self.num_jobs - self.job_measured_at.get(shape, 0) <= STALE_JOBS}
        self._line = _price_line(self._fresh)
        self._priced_at = self.num_jobs

    def job_price_line(self) -> tuple[float, float] | None:
        """(seconds per forward, seconds per branch per forward) fitted by least squares to the fresh prices, a job
        taken to cost (depth + 2) forwards (the catch-up with the tails, the drafted positions, the candidates after
        the last), each a fixed part plus a part per branch row; None until two fan-outs were measured (the split
        between the parts is unknown before)."""
        self._price()
        return self._line

    def job_seconds_at(self, shape: tuple[int, int]) -> float | None:
        """A job's price at this shape: measured lately, what it cost; else the line fitted to the fresh prices;
        before two fan-outs were measured, an optimistic guess from the nearest measured shape (no dearer where wider
        or deeper, cheaper in proportion to its rows and forwards where narrower or shallower), so an untried shape
        is tried once it looks worth it and from then on priced by what it cost."""
        fresh = self._fresh_prices()
        if shape in fresh:
            return fresh[shape]
        line = self.job_price_line()
        fanout, depth = shape
        if line is not None:
            return (depth + 2) * (line[0] + line[1] * fanout)
        known = fresh or self.job_seconds
        if not known:
            return None
        near = min(known, key=lambda s: (abs(s[0] - fanout) + abs(s[1] - depth), s))
        return known[near] * min(1.0, fanout / near[0]) * min(1.0, (depth + 2) / (near[1] + 2))


def _price_line(prices: Mapping[tuple[int, int], float]) -> tuple[float, float] | None:
    """LookaheadStats.job_price_line's fit: y = a * x1 + b * x2 by its normal equations, x1 = forwards (depth + 2),
    x2 = forwards * fan-out."""
    if len({fanout for fanout, _ in prices}) < 2:
        return None
    s11 = s12 = s22 = t1 = t2 = 0.0
    for (fanout, depth), seconds in prices.items():
        x1 = depth + 2.0
        x2 = x1 * fanout
        s11, s12, s22 = s11 + x1 * x1, s12 + x1 * x2, s22 + x2 * x2
        t1, t2 = t1 + x1 * seconds, t2 + x2 * seconds
    det = s11 * s22 - s12 * s12
    a = (t1 * s22 - t2 * s12) / det
    b = (s11 * t2 - s12 * t1) / det
    if b < 0:  # wider never cheaper: all of it per forward
        return t1 / s11, 0.0
    if a < 0:  # no fixed part: all of it per branch
        return 0.0, t2 / s22
    return a, b


def choose_shape(ranked: Mapping[str, list[Outcome]], stats: LookaheadStats, max_fanout: int, k: int,
                 verify_seconds: float | None) -> tuple[int, int]:
    """The branch job's (fan-out, depth) with the most tokens per second expected: a request hits with the
    probability its likeliest `fan-out` outcomes cover, a hit adds the drafts a `depth`-token branch is expected to
    have accepted, and a step lasts as long as the longer of its verification and its branch job (measured per
    shape: a job's time is mostly a fixed number of batched forwards, so its price per branch changes with the shape
    and is not extrapolated). Short branches are the lever where jobs outlast verifications: one forward fewer per
    token not drafted, at the price of the drafts a hit would have had."""
    if not ranked or verify_seconds is None or not stats.job_seconds:
        return max_fanout, k
    # The job runs from the step's launch until the next step is planned: through the verification and the host work.
    window = verify_seconds + stats.host_seconds
    best, best_rate = (max_fanout, k), -1.0
    covered = [min(1.0, sum(sum(o.probability for o in found[:fanout]) for found in ranked.values()) / len(ranked))
               for fanout in range(max_fanout + 1)]
    for depth in range(k, 0, -1):
        gain = stats.expected_accepted(depth)
        for fanout in range(1, max_fanout + 1):
            job = stats.job_seconds_at((fanout, depth))
            if job is None:
                continue
            rate = (1.0 + covered[fanout] * gain) / max(window, job)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = (fanout, depth), rate
    return best


def refresh_pays(num_running: int, num_misses: int, stats: LookaheadStats, k: int) -> bool:
    """Whether a step's misses should be drafted from their real context first, the whole step waiting for that
    draft, rather than verified at once with a backup (or without drafts). A miss verified at once makes what such
    misses were measured to make (`miss_tokens`: one, plus what its backup got accepted; priced at one token, a
    refresh was chosen at one request on this CPU where verifying at once made 1.22x sd's tokens per second and
    refreshing 1.11x); drafted afresh it is an sd step's worth, 1 + the drafts it is expected to have accepted, like
    a hit. The step makes the running requests' tokens in its time, so the wait pays when the batch's tokens per
    second with it, (running * (1 + gain)) / (step + refresh), beat those without,
    (hits * (1 + gain) + misses * miss_tokens) / step: where misses are most of the batch (one request: every miss)
    and drafting is short next to a step. Before a refresh was
    measured its wait is guessed at half a step, so one is tried and from then on priced by what it cost; before a
    step was measured, no."""
    if num_misses <= 0 or stats.step_seconds is None:
        return False
    step = stats.step_seconds
    refresh = stats.refresh_seconds if stats.refresh_seconds is not None else step / 2
    gain = stats.expected_accepted(k)
    now = ((num_running - num_misses) * (1 + gain) + num_misses * stats.miss_tokens) / step
    refreshed = num_running * (1 + gain) / (step + refresh)
    return refreshed > REFRESH_MARGIN * now


def outcomes(request_id: str, drafted: Sequence[int], candidates: Sequence[Sequence[int]], stats: LookaheadStats,
             max_fanout: int) -> list[Outcome]:
    """The request's likeliest outcomes of a verification of `drafted`, best first (at most `max_fanout`)."""
    found: list[Outcome] = []
    reach = 1.0  # P(the first a drafts accepted)
    for a in range(len(drafted) + 1):
        full = a == len(drafted)
        p_stop = reach if full else reach * (1.0 - stats.acceptance(a))
        bonus = stats.after_full if full else stats.after_reject
        ranked = [c for c in (candidates[a] if a < len(candidates) else ()) if full or c != drafted[a]]
        for rank, token in enumerate(ranked[:max_fanout]):
            probability = p_stop * bonus.probability(rank)
            if probability >= MIN_BRANCH_PROBABILITY:
                found.append(Outcome(request_id, probability, (*drafted[:a], token)))
        if not full:
            reach *= stats.acceptance(a)
    found.sort(key=lambda outcome: -outcome.probability)
    return found[:max_fanout]


def allot(ranked: Mapping[str, list[Outcome]], budget: int) -> dict[str, list[Outcome]]:
    """The outcomes drafted within `budget` branches: each request's likeliest first, then the likeliest of the rest
    across the batch (fan-out goes where the outcome is least certain)."""
    chosen = {rid: found[:1] for rid, found in ranked.items() if found}
    left = budget - len(chosen)
    rest = sorted((o for found in ranked.values() for o in found[1:]), key=lambda outcome: -outcome.probability)
    for outcome in rest[:max(0, left)]:
        chosen[outcome.request_id].append(outcome)
    return chosen


def bonus_rank(verified: Verified, num_sampled: int, committed: Sequence[int]) -> tuple[bool, int | None] | None:
    """After a verification: (was every draft accepted, the bonus token's rank among the candidates or None), from
    the request's committed tokens from verified.num_tokens on; None when there is nothing to learn (no candidates,
    or padding accepted past the drafts)."""
    drafted, candidates = verified.drafted, verified.candidates
    accepted = num_sampled - 1
    if accepted > len(drafted) or accepted < 0 or len(committed) <= accepted or len(candidates) <= accepted:
        return None
    full = accepted == len(drafted)
    token = committed[accepted]
    ranked = [c for c in candidates[accepted] if full or c != drafted[accepted]]
    return full, ranked.index(token) if token in ranked else None
