"""What each way of decoding would yield right now, predicted from the engine's own per-step measurements.

Pure: fed `StepRecord`s, asked for predictions; no clocks, no I/O. The measured ingredients (docs/architecture.md), each
kept per kind of decode step where the kinds cost differently:

- V(tokens): seconds the target takes to verify a step of that many tokens (decode steps only), for three kinds
  of step: without drafts (ar: one token per request), with drafts and nothing drafting beside them (sd, psd with
  one side empty) and beside a draft (psd). On a CPU machine the first two compute on the drafter's cores too
  (placement.py), so the same number of tokens costs less than in a psd step whose other side is being drafted;
  and a step of R requests with one token each costs more than one of R / (k + 1) requests with k + 1 tokens each
  (per-request work: sampling, rejection, bookkeeping). One shared curve would price each at another's cost. A
  kind's curve stands in for another's until that one has observations of its own;
- t(requests, k) = f1(requests) + (k - 1) * fn(requests): a draft job's seconds, from the drafter's own split:
  f1 up to the first drafted token (catching up on the tokens committed since the last job, a whole prompt for a
  new request) and fn for each further position. The first token costs more (measured on this CPU with the trained
  pair, 8 requests, k=3: 3.8 ms to the first token, then 2.8 ms per position with the torch drafter; with the vLLM
  drafter backend a one-token draft took 14 ms and a three-token one 17 ms), so pricing a draft as k equal
  forwards would misprice every k but the one measured;
- s_i: of the drafts that reached position i, the share accepted up to and including i. The expected tokens per
  request per verification with draft length k is L(k) = 1 + sum_{i<k} s_i (not 1 + k * rate: acceptance falls
  along the draft);
- o(requests): the rest of a step (scheduling, draft bookkeeping, detokenization), per kind of step. Steps
  scheduled ahead (async PSD steps: scheduled while the previous step computes) overlap their neighbours, so their
  start-to-start gaps say nothing of host work: they teach o_ahead(requests) instead, the part of such a step's wall
  time the forward pass and the wait for drafts did not cover, which prices psd while the engine runs it that way;
- c: seconds per catch-up token, the tokens a draft job makes the drafter take in before it drafts (per request,
  those carried beyond the last one: the tokens accepted since its last job, a newcomer's whole prompt), fitted by
  least squares within jobs of one size and draft length (`CatchUpPrice`); f1 is then learned net of it, and a job
  is priced f1 + (k - 1) fn + c * (catch-up tokens): R (L(k) - 1) in steady decoding, plus the newcomers' tokens per
  request per job seen lately (churn). Until the records show tokens varying within one job size, c is unknown and
  f1 keeps the average catch-up in it, as before.

For R decoding requests the predicted output tokens per second are
    ar:      R / (V(R) + o(R))
    sd(k):   R * L(k) / (t(R, k) + V(R (k+1)) + o(R))
    psd(k):  R * L(k) / (max(V'(A (k+1)) + o'(A), t(B, k)) + max(V'(B (k+1)) + o'(B), t(A, k)))
with A = ceil(R/2), B = R - A, and V', o' those of steps beside a draft (o_ahead where psd's steps are scheduled
ahead and such steps were measured). psd with one side empty is sd.

Lookahead (every step verifies the whole batch; at its launch a branch job drafts the next round beside the
verification: F branches of k tokens for the F likely outcomes of each request verified with its branch, a miss's
root k + 1 deep; a request whose outcome matches a branch takes its draft, a miss decodes the next step without one):
    lookahead(k, F):  R (h L(k) + 1 - h) / (h^R max(S, t(R F, k)) + (1 - h^R) max(S, t(R F - m (F - 1), k + 1)))
with S = V'(R (1 + h k)) + o'(R), m = R (1 - h) / (1 - h^R) the misses of a job holding any (their roots k + 1
deep), and h the hit share (measured, or derived from the per-position acceptance and the drafter's rank of the
target's token, `branch_hit_rate`); where misses are verified with a backup branch or padded, the verification holds
that measured share of k-token proposals instead of h (their tokens are priced, their gains are not). Where the
engine drafts a step's misses afresh and waits for that draft (a refresh, measured per k and load: a share r of the
misses, w seconds per step with a miss), a refreshed miss makes L(k) rather than 1: R (h L(k) + (1 - h)(r L(k) + 1
- r)) tokens, and steps with a miss last w longer.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from minedraft.engine.control.stats import StepRecord

# Steps further apart than this belong to different bursts of work: their gap is idle time, not overhead.
MAX_STEP_GAP_SECONDS = 1.0


@dataclass
class CostCurve:
    """Seconds as a function of a size, learned from observations: smoothed means in quarter-octave buckets,
    joined piecewise-linearly. Flat or sublinear (overhead-bound) and linear (compute-bound) costs both fit."""

    smoothing: float = 0.1
    # bucket -> [mean size, mean seconds, observations]
    buckets: dict[int, list[float]] = field(default_factory=dict)
    # Above the largest observed size, assume cost grows at least like this power of size (0.5: neither free nor
    # proportional), so untried larger settings are not predicted as free.
    extrapolation_exponent: float = 0.5
    # The pooled points of `points()`, until the next observation: a decision prices every mode and k through
    # several curves, and pooling on each call cost ~30 us a call (~2 ms a decision) on the engine's step path.
    _points: list[tuple[float, float]] | None = field(default=None, repr=False, compare=False)

    @staticmethod
    def _bucket(size: float) -> int:
        return round(4 * math.log2(max(size, 1.0)))

    def observe(self, size: float, seconds: float) -> None:
        if size <= 0 or seconds < 0 or not math.isfinite(seconds):
            return
        self._points = None
        key = self._bucket(size)
        bucket = self.buckets.get(key)
        if bucket is None:
            self.buckets[key] = [float(size), float(seconds), 1.0]
            return
        # Plain mean while the bucket is young, exponential smoothing after: tracks drift without early noise.
        weight = max(self.smoothing, 1.0 / (bucket[2] + 1))
        bucket[0] += weight * (size - bucket[0])
        bucket[1] += weight * (seconds - bucket[1])
        bucket[2] += 1

    def covers(self, size: float, slack: float) -> bool:
        """Whether `size` lies within the observed sizes widened by a factor of `slack` each way (a prediction there
        interpolates or barely extrapolates)."""
        if not self.buckets:
            return False
        sizes = [b[0] for b in self.buckets.values()]
        return min(sizes) / slack <= size <= max(sizes) * slack

    @property
    def num_observations(self) -> int:
        return int(sum(b[2] for b in self.buckets.values()))

    def points(self) -> list[tuple[float, float]]:
        """(size, seconds) per bucket, sorted by size, made nondecreasing (weighted pool-adjacent-violators).

        More work never costs less; where a bucket's mean says it does, it is noise, such as a young bucket with a
        handful of observations (the last steps of requests, whose drafts are cut short, land on sizes the steady
        load never has) beside mature ones. Left as it is, one such point bends the curve between its neighbours,
        and the draft lengths priced across it come out in a nonsensical order (k=2 below both k=1 and k=3).
        Pooling it with its neighbour, weighted by observations (capped at the smoothing's memory, so a mature
        bucket does not outvote a newer one forever), keeps the measured shape and drops the impossible part.
        """
        if self._points is not None:
            return self._points
        cap = 1.0 / self.smoothing
        blocks: list[list[float]] = []  # [weighted seconds, weight, number of buckets]
        ordered = sorted(self.buckets.values())
        for _size, seconds, count in ordered:
            blocks.append([seconds * min(count, cap), min(count, cap), 1])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                last = blocks.pop()
                blocks[-1] = [blocks[-1][0] + last[0], blocks[-1][1] + last[1], blocks[-1][2] + last[2]]
        values = [block[0] / block[1] for block in blocks for _ in range(int(block[2]))]
        self._points = [(bucket[0], value) for bucket, value in zip(ordered, values, strict=True)]
        return self._points

    def predict(self, size: float) -> float | None:
        if not self.buckets:
            return None
        points = self.points()
        if len(points) == 1:
            (x0, y0), = points
            # Smaller work is not assumed cheaper until seen (a setting that only looks good because it was never
            # measured would win every decision); larger work is assumed dearer.
            return y0 * max(1.0, size / x0) ** self.extrapolation_exponent
        if size <= points[0][0]:
            (x0, y0), (x1, y1) = points[0], points[1]
            slope = max(0.0, (y1 - y0) / (x1 - x0)) if x1 > x0 else 0.0
            return max(y0 * 0.25, y0 - slope * (x0 - size))
        if size >= points[-1][0]:
            (x0, y0), (x1, y1) = points[-2], points[-1]
            slope = (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0
            floor_growth = y1 * ((size / x1) ** self.extrapolation_exponent - 1)
            return y1 + max(slope * (size - x1), floor_growth, 0.0)
        for (x0, y0), (x1, y1) in itertools.pairwise(points):
            if x0 <= size <= x1:
                return y0 + (y1 - y0) * (size - x0) / (x1 - x0) if x1 > x0 else y0
        return points[-1][1]  # unreachable: the ranges above cover every size


@dataclass
class AcceptanceProfile:
    """Per-position acceptance, exponentially forgetting old steps (decay per observed step)."""

    decay: float = 0.995
    drafted: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    # Below this many (decayed) drafts at a position its estimate is not trusted: extrapolate instead.
    min_samples: float = 8.0

    def observe(self, drafted_per_position: tuple[int, ...], accepted_per_position: tuple[int, ...]) -> None:
        if not drafted_per_position:
            return
        width = max(len(self.drafted), len(drafted_per_position))
        self.drafted += [0.0] * (width - len(self.drafted))
        self.accepted += [0.0] * (width - len(self.accepted))
        for i in range(width):
            self.drafted[i] *= self.decay
            self.accepted[i] *= self.decay
        for i, count in enumerate(drafted_per_position):
            self.drafted[i] += count
        for i, count in enumerate(accepted_per_position):
            self.accepted[i] += count

    @property
    def known(self) -> bool:
        return bool(self.drafted) and self.drafted[0] >= self.min_samples

    def survival(self, num_positions: int) -> list[float]:
        """s_i for i < num_positions: P(accepted through position i | drafted through i)."""
        trusted = [self.accepted[i] / self.drafted[i] for i in range(len(self.drafted))
                   if self.drafted[i] >= self.min_samples]
        # Only a prefix is usable: positions are trusted in order (drafts are truncated, never gapped).
        values: list[float] = []
        for i in range(min(num_positions, len(trusted))):
            values.append(min(1.0, max(0.0, trusted[i])))
        if len(values) < num_positions:
            if not values:
                return [0.0] * num_positions
            # Beyond the measured positions, keep the last measured conditional rate.
            conditional = values[-1] / values[-2] if len(values) >= 2 and values[-2] > 0 else values[0]
            conditional = min(1.0, max(0.0, conditional))
            while len(values) < num_positions:
                values.append(values[-1] * conditional)
        return values

    def expected_accepted_length(self, k: int) -> float:
        """Tokens a request gains per verification with a draft of length k (accepted drafts + the bonus)."""
        return 1.0 + sum(self.survival(k))

    def conditionals(self, num_positions: int) -> list[float]:
        """P(position i accepted | every earlier one accepted) for i < num_positions."""
        survival = self.survival(num_positions)
        out: list[float] = []
        before = 1.0
        for value in survival:
            out.append(min(1.0, value / before) if before > 0 else 0.0)
            before = value
        return out


@dataclass
class CatchUpPrice:
    """Seconds per catch-up token of a draft job, from jobs' (requests, draft length, catch-up tokens, seconds).

    Least squares within groups of jobs of one size (quarter-octave buckets of requests) and one draft length: what
    a job costs besides its catch-up depends on those arbitrarily (the draft loop), so only the tokens' variation
    within a group tells their price, pooled over groups (slope = sum of within-group covariances / sum of
    within-group variances). Sums decay by `decay` per observation of their group: the price tracks drift."""

    decay: float = 0.99
    # The price is unknown until the groups' tokens have varied this much (pooled within-group standard deviation,
    # in tokens) over at least `min_jobs` jobs: steady deltas of a few tokens leave the slope to timing noise.
    min_spread_tokens: float = 2.0
    min_jobs: float = 8.0
    # (requests bucket, draft length) -> [weight, sum x, sum y, sum xx, sum xy]
    sums: dict[tuple[int, int], list[float]] = field(default_factory=dict)

    def observe(self, requests: int, length: int, tokens: int, seconds: float) -> None:
        if requests <= 0 or tokens < 0 or seconds < 0 or not math.isfinite(seconds):
            return
        key = (CostCurve._bucket(requests), length)
        sums = self.sums.setdefault(key, [0.0] * 5)
        for i in range(5):
            sums[i] *= self.decay
        x, y = float(tokens), float(seconds)
        sums[0] += 1.0
        sums[1] += x
        sums[2] += y
        sums[3] += x * x
        sums[4] += x * y

    def seconds_per_token(self) -> float | None:
        """The fitted price (never negative), or None while the tokens have not varied enough to tell it."""
        weight = sxx = sxy = 0.0
        for n, sx, sy, sxx_raw, sxy_raw in self.sums.values():
            if n < 2:
                continue
            weight += n
            sxx += sxx_raw - sx * sx / n
            sxy += sxy_raw - sx * sy / n
        if weight < self.min_jobs or sxx <= 0 or sxx / weight < self.min_spread_tokens ** 2:
            return None
        return max(0.0, sxy / sxx)


# The drafter's rank of the target's token where the drafter's top choice was wrong, P(rank = r | rank >= 2) for
# r = 2, 3, ...: measured on the local pair, greedy, teacher-forced on 32 held-out prompts x 64 tokens
# (benchmarks/lookahead_coverage.py, benchmarks/results/gpu-twin/lookahead-coverage.json); the rest of the mass
# (0.073) lies beyond rank 8. With P(rank 1), the per-position acceptance, it prices a branch's chance to hit
# before lookahead has run (and other fan-outs than the one that ran).
LOCAL_PAIR_RANK_GIVEN_REJECTION = (0.5459, 0.2118, 0.0721, 0.0393, 0.0197, 0.0284, 0.0087)


def outcome_probabilities(conditionals: Sequence[float], k: int,
                          rank_given_rejection: Sequence[float]) -> list[tuple[float, int, int]]:
    """(probability, accepted length a, rank of the bonus token among the drafter's candidates) of one verification
    of a k-token draft, most likely first. `conditionals[i]`: P(position i accepted | every earlier one accepted),
    for i <= k (position k is the bonus after a full acceptance; k = 0: a step without a draft). A rejection at
    position a < k leaves the bonus at rank >= 2 (rank 1 was the rejected draft token); after a full acceptance the
    bonus is the drafter's top choice with the next position's acceptance."""
    outcomes: list[tuple[float, int, int]] = []
    reached = 1.0
    for a in range(k + 1):
        rate = conditionals[a] if a < len(conditionals) else (conditionals[-1] if conditionals else 0.0)
        if a == k:
            outcomes.append((reached * rate, a, 1))
        outcomes += [(reached * (1.0 - rate) * q, a, r) for r, q in enumerate(rank_given_rejection, start=2)]
        reached *= rate
    return sorted(outcomes, key=lambda o: (-o[0], -o[1], o[2]))


def branch_hit_rate(conditionals: Sequence[float], k: int, fanout: int,
                    rank_given_rejection: Sequence[float] = LOCAL_PAIR_RANK_GIVEN_REJECTION) -> float:
    """The share of requests verified with a branch's draft, steady state, as the engine's lookahead drafts
    (psd/lookahead.py): each request verified with a draft gets branches for its F most likely outcomes
    (`outcome_probabilities`); one verified without (a miss) gets its root drafted one deeper, whose first token is
    the drafter's guess for the token that step samples.

    A request verified with a k-token draft hits with h_k (its F likeliest (a, bonus) outcomes); one verified
    without hits with h_0 (its token the drafter's top choice). The drafted share p holds still when
    p = p h_k + (1 - p) h_0: p = h_0 / (1 - h_k + h_0)."""
    if fanout <= 0 or k <= 0:
        return 0.0
    drafted = sum(o[0] for o in outcome_probabilities(conditionals, k, rank_given_rejection)[:fanout])
    plain = sum(o[0] for o in outcome_probabilities(conditionals, 0, rank_given_rejection)[:1])
    denominator = 1.0 - drafted + plain
    return min(1.0, plain / denominator) if denominator > 0 else 1.0


@dataclass
class LookaheadHits:
    """Lookahead's hit share per (k, F) as run: requests verified with a branch's draft over requests decoded in
    lookahead steps, exponentially forgetting (decay per observed step). Where a (k, F) has not run, the derived
    rate (`branch_hit_rate` from the measured acceptance) is scaled by what the nearest setting that ran measured
    against its own derived rate: the drafter's real coverage of the target's token shows in every setting."""

    # Forgetting per decoded request observed (a window of ~1000 requests), not per step: per step, one request's
    # steps kept a window of ~100 requests, whose hit share moves by +-0.05 by chance, and auto flipped between
    # lookahead k=3 and k=4 on that noise (0.955 of the best fixed mode at one request, drafter x2 curves).
    decay: float = 0.999
    min_requests: float = 32.0
    # Misses seen at a (k, load) before its refresh share counts (a 12-step probe at one request sees ~5).
    min_misses: float = 4.0
    # The weight, in decoded requests, of the prior a measured hit share is shrunk towards (`hit_rate`).
    prior_requests: float = 64.0
    # (k, F) -> [hits, decoded requests], decayed
    counts: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    rank_given_rejection: tuple[float, ...] = LOCAL_PAIR_RANK_GIVEN_REJECTION
    # k -> [decoded requests verified with k proposed tokens (hits, and misses with a backup branch or padding),
    # decoded requests], decayed: what a lookahead step verifies, beyond the hits
    proposed: dict[int, list[float]] = field(default_factory=dict)
    # (k, F) -> [items the branch job drafted, decoded requests], decayed: a job drafts F branches for a request
    # verified with its branch and only the root of one that missed (psd/lookahead.py), and fewer where outcomes
    # are unlikely (under MIN_BRANCH_PROBABILITY) or the core narrowed the fan-out.
    job_items: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    # decoding requests -> k -> [misses refreshed, misses, refresh seconds, steps with a miss], decayed (keyed by load
    # first: a price reads one load's few k's, and predict_all prices dozens of settings a decision): how often the
    # engine drafts a step's misses from their real context and waits for that draft (core._refresh_misses: where
    # misses are most of the batch, so at one request nearly every miss) and how long it waits. A refreshed miss is
    # verified with a draft like an sd step's; priced at one token as if verified at once, lookahead at one request
    # on a CPU was predicted at 250-320 tok/s where it ran 349 (1.31x sd), and auto held it at k=2 (0.78x).
    refreshes: dict[int, dict[int, list[float]]] = field(default_factory=dict)

    def observe_refresh(self, k: int, requests: int, misses: int, refreshed: int, seconds: float) -> None:
        if requests <= 0 or misses <= 0 or k <= 0:
            return
        counts = self.refreshes.setdefault(requests, {}).setdefault(k, [0.0, 0.0, 0.0, 0.0])
        keep = self.decay ** requests
        counts[0] = counts[0] * keep + min(refreshed, misses)
        counts[1] = counts[1] * keep + misses
        counts[2] = counts[2] * keep + max(0.0, seconds)
        counts[3] = counts[3] * keep + 1.0

    def refresh_at(self, k: int, requests: int) -> tuple[float, float]:
        """(share of misses refreshed, refresh seconds per step with a miss) at this k and load: measured; at a k
        not measured at this load, the nearest measured k's share, its wait scaled by the forwards a k-token draft
        takes (k + 1 with the candidates); (0, 0) where none was measured at this load (nothing refreshed: the twin
        verifies misses at once)."""
        measured = {kk: c for kk, c in self.refreshes.get(requests, {}).items() if c[1] >= self.min_misses}
        if not measured:
            return 0.0, 0.0
        near = k if k in measured else min(measured, key=lambda kk: (abs(kk - k), kk))
        refreshed, misses, seconds, steps = measured[near]
        return refreshed / misses, seconds / steps * (k + 1) / (near + 1)

    def observe_job_items(self, k: int, fanout: int, items: int, requests: int) -> None:
        if requests <= 0 or items <= 0 or k <= 0 or fanout <= 0:
            return
        counts = self.job_items.setdefault((k, fanout), [0.0, 0.0])
        keep = self.decay ** requests
        counts[0] = counts[0] * keep + items
        counts[1] = counts[1] * keep + requests

    def items_per_request(self, k: int, fanout: int, hit_rate: float) -> float:
        """Items a branch job drafts per decoded request at (k, F): measured where it ran, else F for a hit and the
        root alone for a miss (h F + 1 - h), not F for every request: pricing R F items overpriced the job by a
        third at a hit rate of 0.63 and F = 4, enough to rank lookahead k=4 above k=5 where k=5 runs 5% faster
        (H200 curves, 16 requests)."""
        counts = self.job_items.get((k, fanout))
        if counts is not None and counts[1] >= self.min_requests:
            return counts[0] / counts[1]
        return hit_rate * fanout + (1.0 - hit_rate)

    def observe_proposed(self, k: int, share: float, requests: int) -> None:
        counts = self.proposed.setdefault(k, [0.0, 0.0])
        keep = self.decay ** requests
        counts[0] = counts[0] * keep + share * requests
        counts[1] = counts[1] * keep + requests

    def proposed_share(self, k: int, hit_rate: float) -> float:
        """Of the decoded requests, the share a lookahead step verifies with k tokens: measured (misses with a
        backup or padded count), else the hits alone."""
        counts = self.proposed.get(k)
        if counts is None or counts[1] < self.min_requests:
            return hit_rate
        return max(hit_rate, min(1.0, counts[0] / counts[1]))

    def observe(self, k: int, fanout: int, hits: int, requests: int) -> None:
        if requests <= 0 or k <= 0 or fanout <= 0:
            return
        counts = self.counts.setdefault((k, fanout), [0.0, 0.0])
        keep = self.decay ** requests
        counts[0] = counts[0] * keep + min(hits, requests)
        counts[1] = counts[1] * keep + requests

    def measured(self, k: int, fanout: int) -> float | None:
        counts = self.counts.get((k, fanout))
        if counts is None or counts[1] < self.min_requests:
            return None
        return counts[0] / counts[1]

    def measured_any_fanout(self, k: int) -> bool:
        """Whether lookahead ran at draft length k long enough to tell its hit rate, at any fan-out (the engine's
        core moves the fan-out from step to step with measured times)."""
        return sum(c[1] for (kk, _), c in self.counts.items() if kk == k) >= self.min_requests

    def hit_rate(self, conditionals: Sequence[float], k: int, fanout: int) -> float:
        """The share measured at draft length k, shrunk towards the prior (the derived rate, scaled by what the
        nearest other draft length that ran measured against its own derived rate) with the weight of
        `prior_requests` decoded requests: a probe of 12 steps at 4 requests sees ~40, whose hit share is +-0.08 by
        chance alone, which priced lookahead k=5 at 0.53 where it runs at 0.63 and kept auto on k=4 (0.95 of the best
        fixed mode at 4 requests on the H200 curves).

        At k, every fan-out that ran counts, each request's hit scaled to F by the derived rates: the engine's core
        picks the fan-out per job from measured times, so lookahead at k runs at several, and keyed by (k, F) alone a
        k was priced from another k's share wherever the core's latest fan-out differed from the ones it ran most
        (k=5 at 0.63 where it ran at 0.70, and auto held k=4, 3.5% slower: H200 curves, 16 requests)."""
        ranks = self.rank_given_rejection
        derived = branch_hit_rate(conditionals, k, fanout, ranks)
        ran: list[tuple[tuple[int, int], float]] = []
        for key in self.counts:
            value = self.measured(*key)
            if value is not None and key[0] != k:
                ran.append((key, value))
        prior = derived
        if ran:
            (k0, f0), value = min(ran, key=lambda item: (abs(item[0][0] - k), abs(item[0][1] - fanout)))
            base = branch_hit_rate(conditionals, k0, f0, ranks)
            prior = min(1.0, derived * value / base) if base > 0 else derived
        hits = requests = 0.0
        for (k1, f1), (h1, r1) in self.counts.items():
            if k1 != k or r1 <= 0:
                continue
            base = branch_hit_rate(conditionals, k1, f1, ranks)
            hits += min(r1, h1 * derived / base) if base > 0 else h1
            requests += r1
        if requests < self.min_requests:
            return prior
        return min(1.0, (hits + self.prior_requests * prior) / (requests + self.prior_requests))


@dataclass(frozen=True)
class Prediction:
    mode: str
    k: int
    output_tokens_per_second: float
    cycle_seconds: float
    tokens_per_cycle: float
    # Lookahead's fan-out F (branches drafted per request) and hit share; 0 for the other modes.
    fanout: int = 0
    hit_rate: float = 0.0


# Kinds of decode step, by what their verification costs: without drafts (ar: one token per request), with drafts
# and nothing drafting beside them (sd, psd with one side empty; widened onto the drafter's cores on CPUs) and
# beside a draft (steady psd).
PLAIN, ALONE, BESIDE = "plain", "alone", "beside"
KINDS = (PLAIN, ALONE, BESIDE)
# The mode whose steps verify the whole batch beside a branch job drafting the next round (engine/settings.py).
LOOKAHEAD = "lookahead"
# Lookahead: the most branches (outcomes pre-drafted) per request per round, and the default. 6: in the twin on the
# H200 curves 6 was the best ceiling of 4, 6 and 8 across 8-64 requests (benchmarks/twin_lookahead.py; docs/gpu.md):
# the core lowers it per round from measured branch and verify times, so a higher ceiling only costs where its
# pricing errs, and 4 left hits (0.62-0.70) on the table where the drafter had time to spare.
DEFAULT_LOOKAHEAD_FANOUT = 6
# Lookahead steps after a switch to it whose hits and misses are the switch's: the first verifies without branches,
# the second with those drafted from roots only.
LOOKAHEAD_WARMUP_STEPS = 2


def _curves() -> dict[str, CostCurve]:
    return {kind: CostCurve() for kind in KINDS}


def _q_curves() -> dict[str, dict[int, CostCurve]]:
    return {kind: {} for kind in KINDS}


# A step's tokens per request within this of a whole number is filed under that number (a step of mixed draft
# lengths, such as requests near their end, only teaches the tokens curve).
Q_TOLERANCE = 0.25
# A shape's curve prices a batch within this factor of the batches it was measured at before other shapes do.
SHAPE_COVER_SLACK = 1.5


@dataclass
class CostModel:
    # Per kind of step: verification seconds against scheduled tokens, and the rest of the step (scheduling,
    # draft bookkeeping, detokenization) against running requests.
    verify: dict[str, CostCurve] = field(default_factory=_curves)
    # The same seconds per kind and per tokens per request q (k + 1), against running requests: verification costs
    # differ at equal tokens (on the H200 curves 32 requests x 3 tokens take 27.8 ms, 16 x 6 take 23.8: each request
    # reads its own KV cache), so psd at half the batch with a longer draft is priced from what steps of that shape
    # cost, not from steps of another shape with as many tokens. Shapes never run are priced from the tokens curve,
    # scaled to the nearest shape that ran (or from the two shapes either side).
    verify_q: dict[str, dict[int, CostCurve]] = field(default_factory=_q_curves)
    overhead: dict[str, CostCurve] = field(default_factory=_curves)
    # Drafting against requests in the job: seconds up to the first drafted token (catch-up included), and seconds
    # of each further position. Drafters that do not report the first token's time are modelled as k equal
    # forwards (both curves fed the average).
    draft_first: CostCurve = field(default_factory=CostCurve)
    draft_next: CostCurve = field(default_factory=CostCurve)
    # The drafter's price per catch-up token (draft_first is learned net of it once known), and the catch-up tokens
    # per request per job beyond steady decoding's (newcomers' prompts: churn), smoothed over jobs.
    catch_up: CatchUpPrice = field(default_factory=CatchUpPrice)
    churn_tokens_per_request: float = 0.0
    churn_smoothing: float = 0.05
    # Host work of steps scheduled ahead (async PSD steps), against running requests: see the module's doc.
    overhead_ahead: CostCurve = field(default_factory=CostCurve)
    # Whether the engine schedules psd's steps ahead (its async_psd_steps setting): psd is then priced with
    # o_ahead where measured.
    async_psd_steps: bool = False
    acceptance: AcceptanceProfile = field(default_factory=AcceptanceProfile)
    # Lookahead's hit share per (k, F) as run.
    lookahead_hits: LookaheadHits = field(default_factory=LookaheadHits)
    # Step numbers of the last observation of each ingredient (for staleness).
    last_verify_step: int = -1
    last_draft_step: int = -1
    # Whether any step verified on the drafter's cores too (then sd's steps and psd's differ in cost).
    widening_seen: bool = False
    # Lookahead steps in a row so far (the first LOOKAHEAD_WARMUP_STEPS after a switch teach no hit rate).
    _lookahead_streak: int = 0
    # The fan-out lookahead runs with (the latest lookahead step's; before any, the engine's default
    # --lookahead-fanout): what lookahead is priced at unless other fan-outs are asked for.
    lookahead_fanout: int = DEFAULT_LOOKAHEAD_FANOUT
    _previous: StepRecord | None = None

    @staticmethod
    def _kind_of(record: StepRecord) -> str:
        # A lookahead step without drafts (the first after a switch, or all misses) verifies beside the branch job it
        # launches, on the target's own cores: not ar's kind of step (widened onto the drafter's cores on CPUs).
        # Priced as ar's, it made ar look measured at 16 requests, at 900 tok/s where ar ran at 1300 (one bench run
        # on this CPU), below the stale-probe floor: auto never tried ar there (0.84x the best fixed mode, ar).
        if record.num_requests_with_drafts == 0:
            return BESIDE if record.mode == LOOKAHEAD else PLAIN
        return ALONE if record.widened else BESIDE

    def _chain(self, kind: str) -> tuple[str, ...]:
        """The kind of step whose costs price `kind`, then the kinds standing in for it, nearest first."""
        if kind == PLAIN:
            return PLAIN, ALONE, BESIDE
        if kind == ALONE and self.widening_seen:
            return ALONE, PLAIN, BESIDE
        # Where the target never widens (a GPU machine, or lending turned off), sd's steps are psd's kind of step.
        return BESIDE, ALONE, PLAIN

    def _curve(self, curves: dict[str, CostCurve], kind: str) -> CostCurve:
        chain = self._chain(kind)
        return next((curves[k] for k in chain if curves[k].buckets), curves[chain[0]])

    def observe(self, record: StepRecord, resuming: bool = False) -> None:
        """Learn from one step. `resuming`: drafting restarted after steps without it (ar, or the drafter down), so
        this step's draft includes the drafter catching up on every token committed meanwhile: a one-off cost of
        the switch (on this CPU, psd over 32 requests after 24 ar steps: 21-99 ms to the first drafted token in
        the first jobs, 5-12 ms steady), which would inflate the drafting curves (smoothed over about ten
        observations) and turn the next decisions away from the mode just chosen. Acceptance and verification are
        still learned from it."""
        previous, self._previous = self._previous, record
        decode_only = record.num_prefill_requests == 0 and record.num_decode_requests > 0
        if decode_only:
            self.widening_seen = self.widening_seen or record.widened
            kind = self._kind_of(record)
            self.verify[kind].observe(record.num_scheduled_tokens, record.verify_seconds)
            q = record.num_scheduled_tokens / record.num_decode_requests
            if abs(q - round(q)) <= Q_TOLERANCE:
                self.verify_q[kind].setdefault(round(q), CostCurve()).observe(
                    record.num_decode_requests, record.verify_seconds)
            self.last_verify_step = record.step
        # The first lookahead steps after another mode hold no branches yet (the first drafts each request's root
        # only): their misses are the switch's, not the mode's hit rate.
        # (A new k is a switch too: the first steps after it verify branches drafted for the old k's outcomes.)
        same_k = previous is not None and previous.mode == LOOKAHEAD and previous.k == record.k
        self._lookahead_streak = 0 if record.mode != LOOKAHEAD else self._lookahead_streak + 1 if same_k else 1
        # (Steps that also take in prompts count: hits and misses are counted over the decoding requests alone, and
        # at 256 requests a prompt arrives nearly every step, so decode-only steps left the hit share unmeasured.)
        if (record.mode == LOOKAHEAD and record.num_decode_requests > 0
                and self._lookahead_streak > LOOKAHEAD_WARMUP_STEPS):
            self._observe_branches(record)
        # (A lookahead step that verified misses with backup branches, drafts made for an outcome the request did not
        # have, says nothing of the drafter's acceptance: its acceptance is not learned.)
        backups = record.mode == LOOKAHEAD and record.num_requests_with_drafts > record.num_branch_hits
        if record.num_requests_with_drafts > 0 and not backups:
            self.acceptance.observe(record.drafted_per_position, record.accepted_per_position)
        # Its branch job's time is learned all the same: skipped with the acceptance, lookahead's jobs (hundreds of
        # items at 256 requests) were never measured wherever some request missed, so lookahead was priced from
        # sd's and psd's jobs (a quarter of the rows) and always counted as extrapolated there (auto then needed an
        # 8% margin to move between its k's: lookahead k=2 held where k=1 runs 5% faster, H200 curves).
        if ((record.num_requests_with_drafts > 0 or record.mode == LOOKAHEAD) and record.draft_seconds > 0
                and not resuming):
            self._observe_draft(record)
            self.last_draft_step = record.step
        if decode_only and record.scheduled_ahead:
            # Its wall time beyond the forward and the wait for drafts: host work async steps did not hide.
            self.overhead_ahead.observe(
                max(1, record.num_decode_requests + record.num_prefill_requests),
                max(0.0, record.step_seconds - record.verify_seconds - record.wait_seconds))
        if previous is not None and decode_only and not (record.scheduled_ahead or previous.scheduled_ahead):
            # (Around a step scheduled ahead, start-to-start gaps overlap a forward pass: not host work.)
            gap = record.started_at - previous.started_at
            if 0 < gap < MAX_STEP_GAP_SECONDS:
                other = gap - previous.verify_seconds - previous.wait_seconds
                self.overhead[self._kind_of(previous)].observe(
                    max(1, previous.num_decode_requests + previous.num_prefill_requests), max(0.0, other))

    def _observe_branches(self, record: StepRecord) -> None:
        """A lookahead step: of its decoding requests, those that took a branch's draft (hits) and those that did
        not (misses), at the fan-out its branch job used."""
        if record.lookahead_fanout > 0:
            self.lookahead_fanout = record.lookahead_fanout
        hits, misses = record.num_branch_hits, record.num_branch_misses
        if hits + misses <= 0 or record.k <= 0:
            return
        self.lookahead_hits.observe(record.k, record.lookahead_fanout or self.lookahead_fanout, hits, hits + misses)
        self.lookahead_hits.observe_refresh(record.k, record.num_decode_requests, misses, record.num_refreshed,
                                            record.refresh_seconds)
        requests = record.num_decode_requests
        if requests > 0:
            share = (record.num_scheduled_tokens / requests - 1.0) / record.k
            self.lookahead_hits.observe_proposed(record.k, min(1.0, max(0.0, share)), requests)
            self.lookahead_hits.observe_job_items(record.k, record.lookahead_fanout or self.lookahead_fanout,
                                                  record.draft_job_requests, requests)

    def _observe_draft(self, record: StepRecord) -> None:
        # The job's own size where the step reports it (around a switch the requests verified with drafts are not
        # the job's: the first psd step after sd verifies half of a job drafted for the whole batch).
        requests = record.draft_job_requests or record.num_requests_with_drafts
        length = max(1, record.draft_job_length or len(record.drafted_per_position))
        first = record.draft_first_token_seconds
        split = 0 < first <= record.draft_seconds
        # The catch-up is taken in before position 1: it is the first token's time that carries it.
        catch_up_seconds = 0.0
        if record.draft_job_requests > 0:
            tokens = record.draft_job_catch_up_tokens
            self.catch_up.observe(requests, length, tokens, first if split else record.draft_seconds)
            steady = requests * length  # at most every draft accepted: beyond it, newcomers' tokens
            churn = max(0, tokens - steady) / requests
            self.churn_tokens_per_request += self.churn_smoothing * (churn - self.churn_tokens_per_request)
            price = self.catch_up.seconds_per_token()
            if price is not None:
                catch_up_seconds = price * tokens
        if split:
            self.draft_first.observe(requests, max(0.0, first - catch_up_seconds))
            if length > 1:
                self.draft_next.observe(requests, (record.draft_seconds - first) / (length - 1))
        else:
            loop = max(0.0, record.draft_seconds - catch_up_seconds)
            self.draft_first.observe(requests, loop / length)
            self.draft_next.observe(requests, loop / length)

    def _verify_curve(self, alone: bool, drafted: bool = True) -> CostCurve:
        return self._curve(self.verify, PLAIN if not drafted else ALONE if alone else BESIDE)

    def verify_seconds_at(self, requests: int, tokens: float) -> float | None:
        """Seconds to verify a decode step with drafts of `requests` requests and `tokens` scheduled tokens, from the
        steps of the nearest shapes (tokens per request) at this many requests (None: nothing measured yet): the
        price of adaptive draft lengths' verify budget (psd/verify_budget.py)."""
        if requests <= 0 or not self._verify_curve(alone=False).buckets:
            return None
        return self._shaped_verify_seconds(BESIDE, requests, tokens / requests)

    def draft_seconds_at(self, requests: int, k: int) -> float | None:
        """Seconds of a draft job of `requests` requests and depth k (None: no job measured yet)."""
        if not self.draft_first.buckets:
            return None
        return self._draft_seconds(requests, k)

    def ready_for(self, mode: str) -> bool:
        if self._verify_curve(alone=mode not in ("psd", LOOKAHEAD), drafted=mode != "ar").predict(1) is None:
            return False
        if mode == "ar":
            return True
        return self.acceptance.known and self.draft_first.predict(1) is not None

    def _verify_seconds(self, requests: int, k: int, alone: bool = True) -> float:
        kind = PLAIN if k == 0 else ALONE if alone else BESIDE
        seconds = self._shaped_verify_seconds(kind, requests, k + 1)
        if kind == BESIDE and self.async_psd_steps and self.overhead_ahead.buckets:
            overhead = self.overhead_ahead.predict(requests) or 0.0
        else:
            overhead = self._curve(self.overhead, kind).predict(requests) or 0.0
        return (seconds or 0.0) + overhead

    def _shapes(self, kind: str) -> tuple[CostCurve, dict[int, CostCurve]]:
        """The tokens curve that prices `kind` and its curves per shape (tokens per request q)."""
        chain = self._chain(kind)
        tokens_kind = next((k for k in chain if self.verify[k].buckets), chain[0])
        shapes = dict(self.verify_q[tokens_kind])
        if not self.widening_seen and 1 not in shapes and tokens_kind != PLAIN and self.verify_q[PLAIN].get(1):
            shapes[1] = self.verify_q[PLAIN][1]
        return self.verify[tokens_kind], shapes

    def _shape_covered(self, kind: str, requests: int, q: int, slack: float) -> bool:
        """Whether verifying `requests` requests with q tokens each is priced from steps of a shape within one token
        per request of q, measured near this many requests (within `slack`). Beyond that the price is the tokens
        curve scaled, and the tokens curve mixes batches: on the H200 curves 16 requests x 6 tokens verify in
        23.8 ms, 32 x 3 in 27.8, so psd k=5 at 32 requests (16 x 6 per sub-batch), priced from psd k=3's shape and
        the tokens lookahead verified at 32, came out 20% slow (steeper-verify curves: auto held lookahead k=3 for
        1,000 steps where psd k=5 runs 7% faster). Where no step had a whole number of tokens per request, the
        tokens curve is all there is and counts as covering."""
        _, shapes = self._shapes(kind)
        return not shapes or any(abs(s - q) <= 1 and c.covers(requests, slack) for s, c in shapes.items())

    def _shaped_verify_seconds(self, kind: str, requests: int, q: float) -> float | None:
        """Verification of `requests` requests with q tokens each: from steps of that shape where any ran, else
        linearly in q from the two nearest shapes at this many requests (between them, or beyond them never below
        the nearer one), else the tokens curve scaled to the one shape that ran. Where verifying never lent the
        target the drafter's device (GPUs), steps without drafts are the q = 1 shape of every kind: a memory-bound
        target then shows at once that longer drafts verify almost free."""
        tokens_curve, shapes = self._shapes(kind)
        if not shapes:
            return tokens_curve.predict(requests * q)
        exact = shapes.get(round(q)) if q == round(q) else None
        # Shapes measured near this many requests first: a shape seen only at a far smaller batch extrapolates with
        # CostCurve's pessimistic growth, while two shapes measured here interpolate what this batch costs.
        near = {s: c for s, c in shapes.items() if c.covers(requests, SHAPE_COVER_SLACK)}
        if exact is not None and (q in near or not near):
            return exact.predict(requests)
        if len(near) == 1:
            shapes = near  # one shape measured here: the tokens curve scaled to it (below)
        elif len(near) >= 2:
            shapes = near
        if len(shapes) >= 2:
            below = sorted(s for s in shapes if s < q)
            above = sorted(s for s in shapes if s > q)
            # (q is not a shape, so with two or more shapes one side holds at least two when the other is empty)
            low, high = ((below[-1], above[0]) if below and above
                         else (below[-2], below[-1]) if below else (above[0], above[1]))
            y_low, y_high = shapes[low].predict(requests), shapes[high].predict(requests)
            if y_low is not None and y_high is not None and high != low:
                value = y_low + (y_high - y_low) * (q - low) / (high - low)
                if q > high:
                    value = max(value, y_high)
                elif q < low:
                    value = min(max(value, 0.5 * y_low), y_low)
                return value
        nearest = min(shapes, key=lambda s: (abs(s - q), s))
        at_nearest = shapes[nearest].predict(requests)
        tokens_nearest = tokens_curve.predict(requests * nearest)
        tokens_here = tokens_curve.predict(requests * q)
        if at_nearest is None or not tokens_nearest or tokens_here is None:
            return tokens_here
        return tokens_here * at_nearest / tokens_nearest

    def _draft_seconds(self, requests: float, k: int) -> float:
        if k <= 0:
            return 0.0
        first = self.draft_first.predict(requests) or 0.0
        following = self.draft_next if self.draft_next.buckets else self.draft_first
        return first + (k - 1) * (following.predict(requests) or 0.0) + self.catch_up_seconds(requests, k)

    def catch_up_seconds(self, requests: float, k: int) -> float:
        """A job's expected catch-up at its learned price (0 while the price is unknown: f1 then holds it):
        each request's accepted drafts since its last job (L(k) - 1 on average) plus the churn seen lately."""
        price = self.catch_up.seconds_per_token()
        if not price:
            return 0.0
        tokens = requests * (self.acceptance.expected_accepted_length(k) - 1.0 + self.churn_tokens_per_request)
        return price * tokens

    def _drafting_covers(self, requests: float, k: int, slack: float) -> bool:
        if not self.draft_first.covers(requests, slack):
            return False
        return k <= 1 or self.draft_next.covers(requests, slack)

    def extrapolated(self, mode: str, k: int, num_running: int, slack: float = 1.5, fanout: int = 0) -> bool:
        """Whether predicting this setting at this load reaches beyond what was measured (by more than `slack`
        either way): another kind of step's costs standing in, or sizes far from the observed ones. Such a
        prediction can be wrong by a large factor in either direction (CostCurve extrapolates conservatively), so
        auto measures instead."""
        if num_running <= 0:
            return False
        a = math.ceil(num_running / 2)
        b = num_running - a
        alone = mode not in ("psd", LOOKAHEAD) or (mode == "psd" and b == 0)
        kind = PLAIN if mode == "ar" else ALONE if alone else BESIDE
        chain = self._chain(kind)
        if not self.verify[chain[0]].buckets and any(self.verify[k_].buckets for k_ in chain[1:]):
            return True
        curve = self.verify[chain[0]]
        if mode == "ar":
            return not curve.covers(num_running, slack)
        if mode == LOOKAHEAD:
            # Its branch jobs hold the items priced (F per hit, a root per miss: not R F, which no job reaches and
            # so was never covered, probing lookahead again and again), and its hit share is known only where it ran.
            hit = self.lookahead_hit_rate(k, max(1, fanout))
            items = num_running * self.lookahead_hits.items_per_request(k, max(1, fanout), hit)
            return not (curve.covers(num_running * (k + 1), slack)
                        and self._drafting_covers(items, k, slack)
                        and self.lookahead_hits.measured_any_fanout(k))
        if alone:
            return not (curve.covers(num_running * (k + 1), slack) and self._drafting_covers(num_running, k, slack)
                        and self._shape_covered(kind, num_running, k + 1, slack))
        return not (curve.covers(a * (k + 1), slack) and self._drafting_covers(a, k, slack)
                    and self._drafting_covers(b, k, slack) and self._shape_covered(kind, a, k + 1, slack))

    def lookahead_hit_rate(self, k: int, fanout: int) -> float:
        """The share of requests a lookahead step verifies with a branch's draft at (k, F): measured, or derived."""
        return self.lookahead_hits.hit_rate(self.acceptance.conditionals(k + 1), k, fanout)

    def predict(self, mode: str, k: int, num_running: int, fanout: int = 0) -> Prediction | None:
        """Output tokens per second for `num_running` decoding requests; None until the inputs are measured.
        `fanout`: lookahead's branches per request (the others ignore it)."""
        if num_running <= 0 or not self.ready_for(mode):
            return None
        if mode == LOOKAHEAD:
            return self._predict_lookahead(k, num_running, max(1, fanout))
        if mode == "ar":
            cycle = self._verify_seconds(num_running, 0)
            tokens = float(num_running)
            k = 0
        else:
            accepted_length = self.acceptance.expected_accepted_length(k)
            tokens = num_running * accepted_length
            a = math.ceil(num_running / 2)
            b = num_running - a
            if mode == "sd" or b == 0:
                cycle = self._draft_seconds(num_running, k) + self._verify_seconds(num_running, k)
            elif mode == "psd":
                cycle = (max(self._verify_seconds(a, k, alone=False), self._draft_seconds(b, k))
                         + max(self._verify_seconds(b, k, alone=False), self._draft_seconds(a, k)))
            else:
                raise ValueError(f"mode: no cost model for {mode!r}")
        if cycle <= 0:
            return None
        return Prediction(mode, k, tokens / cycle, cycle, tokens)

    def _predict_lookahead(self, k: int, num_running: int, fanout: int) -> Prediction | None:
        """Every step verifies the whole batch (hits with their branch's k tokens, misses with none) while the
        drafter drafts the next round's branches beside it; the step lasts the longer of the two."""
        hit = self.lookahead_hit_rate(k, fanout)
        accepted_length = self.acceptance.expected_accepted_length(k)
        # A miss verified at once makes one token (what its backup gets accepted is not counted); one drafted afresh
        # while the step waits (a refresh, engine only) makes an sd step's worth, at that wait.
        refreshed, refresh_wait = self.lookahead_hits.refresh_at(k, num_running)
        tokens = num_running * (hit * accepted_length + (1.0 - hit) * (refreshed * accepted_length + 1.0 - refreshed))
        proposed = self.lookahead_hits.proposed_share(k, hit)
        verify = self._shaped_verify_seconds(BESIDE, num_running, 1.0 + proposed * k) or 0.0
        overhead = self._curve(self.overhead, BESIDE).predict(num_running) or 0.0
        # The branch job: F branches of k tokens per request that hit, and the roots of those that missed drafted
        # k + 1 deep (their first token guesses the one that step samples): the drafter's loop runs as deep as its
        # deepest item.
        # A job drafts k + 1 deep only where some request missed: at a small batch most jobs hold hits alone (at one
        # request and a hit rate of 0.85, 85% of them), priced k deep; pricing every job k + 1 deep put lookahead k=1
        # at 47 tok/s where it runs at 69 with a drafter 6x slower (eager, H200 curves, one request), below ar.
        per_hit = 1.0
        if hit > 0:
            per_request = self.lookahead_hits.items_per_request(k, fanout, hit)
            per_hit = min(float(fanout), max(1.0, (per_request - (1.0 - hit)) / hit))
        all_hit = hit ** num_running
        misses = num_running * (1.0 - hit) / (1.0 - all_hit) if all_hit < 1.0 else 0.0
        mixed = self._draft_seconds((num_running - misses) * per_hit + misses, k + 1) if all_hit < 1.0 else 0.0
        only_hits = self._draft_seconds(num_running * per_hit, k) if all_hit > 0.0 else 0.0
        step = verify + overhead
        cycle = all_hit * max(step, only_hits) + (1.0 - all_hit) * (max(step, mixed) + refresh_wait)
        if cycle <= 0:
            return None
        return Prediction(LOOKAHEAD, k, tokens / cycle, cycle, tokens, fanout, hit)

    def predict_all(self, num_running: int, modes: tuple[str, ...], ks: tuple[int, ...],
                    fanouts: tuple[int, ...] = (1,)) -> list[Prediction]:
        predictions: list[Prediction] = []
        for mode in modes:
            for k in (0,) if mode == "ar" else ks:
                for fanout in fanouts if mode == LOOKAHEAD else (0,):
                    prediction = self.predict(mode, k, num_running, fanout)
                    if prediction is not None:
                        predictions.append(prediction)
        return predictions
