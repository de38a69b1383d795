"""Adaptive draft lengths: each request's own draft length, and a per-step verify budget from the verify curve.

Pure: plain dataclasses and numbers, no clocks, no I/O. The planner (psd/planner.py) asks it two things in sd and psd
with `--draft-length adaptive`:

- `draft_length`: how many tokens the next draft job drafts for a request. Each request's acceptance is a Beta
  posterior over its per-position acceptance rate a_i (accepted positions are successes, the first rejected one a
  failure), whose prior is the batch's pooled rate at `prior_strength` pseudo-observations, its counts decayed by
  `decay` per verification so it follows a request whose text changes. Position j of its draft is accepted with
  probability a_i^j (geometric along the draft). It drafts the positions with a_i^j at or above the step's
  threshold (below): a request whose drafts keep being rejected drafts few or none and decodes one token per step,
  as plain decoding would; its counts decay while it is not drafted, so its posterior drifts back to the batch's
  rate, and after `explore_after_steps` steps without drafts it is drafted one token to be measured again.
- `budget`: how many of the drafted tokens each request of a step verifies. Every request verifies its one token;
  draft positions are added across the batch in order of their acceptance probability for as long as the step's
  expected tokens per second grow: (R + sum of the kept positions' probabilities) / (other + V(R + kept)), V the
  verify seconds at that many scheduled tokens (measured: the cost model's tokens curve), `other` the rest of the
  step (host work, the wait for drafts). That is the knee of the verify curve: a position is kept while its
  acceptance probability is worth the marginal verify seconds at the step's tokens per second (p >= G * dV/dtoken),
  so the budget is all positions where verification is nearly free (a memory-bound target at small batches) and
  only the likely ones where it is not (large batches). Zero drafts (plain decoding) is one of the choices, so the
  expected rate is never below plain decoding's. The threshold found (G * dV/dtoken at the chosen total) is kept
  for the next round's draft lengths.

Drafts are only proposals: any subset of them verifies losslessly, so nothing here can change the output.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

# verify_seconds(requests, scheduled tokens) -> seconds, or None while nothing is measured.
VerifyCost = Callable[[int, float], float | None]
# draft_seconds(requests, depth) -> seconds of a draft job, or None while nothing is measured.
DraftCost = Callable[[int, int], float | None]


@dataclass(slots=True)
class AcceptanceBelief:
    """One request's decayed counts: draft positions accepted, and verifications that rejected one."""

    accepted: float = 0.0
    rejected: float = 0.0
    # Steps in a row it decoded without drafts.
    undrafted_steps: int = 0

    def observe(self, drafted: int, accepted: int, decay: float) -> None:
        """One verification of `drafted` draft tokens of which the first `accepted` were accepted (0, 0: a step
        without drafts, which only decays the counts towards the prior)."""
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + (1.0 if accepted < drafted else 0.0)
        self.undrafted_steps = 0 if drafted else self.undrafted_steps + 1


@dataclass
class DraftLengthPolicy:
    """Per-request draft lengths and the per-step verify budget (see the module's doc)."""

    # The longest draft a request gets (the engine's k).
    k_max: int
    # Seconds to verify a step of that many scheduled tokens (None: not measured yet: no budget, drafts as fixed).
    verify_seconds: VerifyCost = field(default=lambda requests, tokens: None)
    # Seconds of a draft job of (requests, depth) (None: not measured). Priced where drafts are made in series with
    # the verification (`drafts_in_series`: sd): a deeper job delays every request's step.
    draft_seconds: DraftCost = field(default=lambda requests, depth: None)
    drafts_in_series: bool = False
    # Weight of the batch's rate in each request's posterior, in verifications' worth of positions.
    prior_strength: float = 4.0
    # Per verification of a request (and per step it decodes without drafts): how fast its own evidence fades.
    decay: float = 0.9
    # The batch's pooled counts fade more slowly (it is the prior of newcomers).
    pooled_decay: float = 0.995
    # The batch's rate before anything is measured (its prior, at prior_strength).
    default_rate: float = 0.7
    # A request drafted nothing for this many steps in a row gets one draft token (so it, and the batch's rate, are
    # measured again: otherwise a batch whose rate fell, or a step threshold set high, would never draft again).
    explore_after_steps: int = 8
    # Cut-offs tried per step: this many + 1 evenly spaced, then as many between the best one's neighbours (the
    # work per step is bounded: each is a cost-model lookup, ~20 us on this CPU).
    coarse_cutoffs: int = 8
    # Exponential smoothing of the step's other seconds (step minus verification).
    smoothing: float = 0.2
    # Every this many budgeted steps (the first `early_probes` times every `early_probe_every`) the next step without
    # prompts verifies fewer positions (`probe_share` of the chosen ones, the likeliest): the verify curve is
    # measured only at the token counts steps run at (the cost model learns decode-only steps), and without steps
    # below the usual count its slope there is unknown (it assumes fewer tokens save nothing until it sees them).
    # 0: never.
    probe_every: int = 64
    early_probe_every: int = 3
    early_probes: int = 6
    probe_share: float = 0.7
    pooled: AcceptanceBelief = field(default_factory=AcceptanceBelief)
    # The acceptance probability a draft position needed to be verified in the latest budgeted step (0: every one).
    threshold: float = 0.0
    # The expected tokens per second of the latest budgeted step (0: none yet).
    tokens_per_second: float = 0.0
    # The verify seconds per scheduled token there.
    seconds_per_token: float = 0.0
    other_seconds: float = 0.0
    since_probe: int = 0
    num_probes: int = 0

    # -- acceptance ------------------------------------------------------------------------------------------------

    def batch_rate(self) -> float:
        pooled, strength = self.pooled, self.prior_strength
        return (strength * self.default_rate + pooled.accepted) / (strength + pooled.accepted + pooled.rejected)

    def rate(self, belief: AcceptanceBelief | None) -> float:
        """A request's posterior mean per-position acceptance rate (the batch's rate for one never verified)."""
        prior = self.batch_rate()
        if belief is None:
            return prior
        strength = self.prior_strength
        return (strength * prior + belief.accepted) / (strength + belief.accepted + belief.rejected)

    def observe(self, belief: AcceptanceBelief, drafted: int, accepted: int) -> None:
        """A request's verification (drafted 0: it decoded without drafts, its evidence fades)."""
        accepted = max(0, min(accepted, drafted))
        belief.observe(drafted, accepted, self.decay)
        if drafted:
            self.pooled.observe(drafted, accepted, self.pooled_decay)

    def observe_step(self, step_seconds: float, verify_seconds: float, wait_seconds: float = 0.0) -> None:
        """A step's seconds: the rest besides verification (and, where drafts are priced in series, the wait for
        them) is `other_seconds`."""
        other = max(0.0, step_seconds - verify_seconds - (wait_seconds if self.drafts_in_series else 0.0))
        self.other_seconds += self.smoothing * (other - self.other_seconds)

    # -- lengths ---------------------------------------------------------------------------------------------------

    def draft_length(self, belief: AcceptanceBelief | None, room: int) -> int:
        """Tokens to draft for a request next round: the positions likely enough to be verified (0: none)."""
        most = min(self.k_max, room)
        if most <= 0:
            return 0
        rate = self.rate(belief)
        length, probability = 0, 1.0
        while length < most:
            probability *= rate
            if probability < self.threshold:
                break
            length += 1
        if not length and belief is not None and belief.undrafted_steps >= self.explore_after_steps:
            return 1
        return length

    def budget(self, drafted: Mapping[str, tuple[int, AcceptanceBelief | None]], num_requests: int,
               may_probe: bool = True) -> dict[str, int]:
        """How many of its drafted tokens each request verifies this step. `drafted`: request -> (drafted tokens
        available, its belief); `num_requests`: requests in the step (each verifies one token besides its drafts);
        `may_probe`: the step takes in no prompt (its verify time is measured). Updates `threshold` for the next
        round's draft lengths."""
        rates = {rid: self.rate(belief) for rid, (_, belief) in drafted.items()}
        positions = sorted(
            ((rates[rid] ** (j + 1), j, rid) for rid, (available, _) in drafted.items()
             for j in range(min(available, self.k_max))),
            key=lambda p: (-p[0], p[1]))
        total = len(positions)
        keep_all = {rid: min(available, self.k_max) for rid, (available, _) in drafted.items()}
        if not total or self.verify_seconds(num_requests, num_requests + total) is None:
            self.threshold = 0.0
            return keep_all
        prefix = [0.0]
        for probability, _, _ in positions:
            prefix.append(prefix[-1] + probability)
        # The rest of the step: drafted in series (sd), the job that made these drafts is part of it.
        fixed = self.other_seconds
        if self.drafts_in_series:
            fixed += self.draft_seconds(len(drafted), max(keep_all.values())) or 0.0
        def tokens_per_second(cut: int) -> float:
            seconds = self.verify_seconds(num_requests, num_requests + cut)
            return -1.0 if seconds is None else (num_requests + prefix[cut]) / max(1e-9, fixed + seconds)

        def best_of(cuts: list[int]) -> tuple[int, float]:
            best_cut, best_rate = total, -1.0
            for cut in cuts:  # ascending: a tie goes to more drafts
                rate = tokens_per_second(cut)
                if rate >= best_rate:
                    best_cut, best_rate = cut, rate
            return best_cut, best_rate

        coarse = sorted({round(total * i / self.coarse_cutoffs) for i in range(self.coarse_cutoffs + 1)})
        best, best_rate = best_of(coarse)
        at = coarse.index(best)
        low, high = coarse[max(0, at - 1)], coarse[min(len(coarse) - 1, at + 1)]
        fine = sorted({best, *range(low, high + 1, max(1, (high - low) // self.coarse_cutoffs))})
        if len(fine) > 1:
            best, best_rate = best_of(fine)
        self.seconds_per_token = self._slope(num_requests, num_requests + best)
        self.tokens_per_second = best_rate
        self.threshold = best_rate * self.seconds_per_token
        self.since_probe += 1
        every = self.early_probe_every if self.num_probes < self.early_probes else self.probe_every
        if self.probe_every and may_probe and self.since_probe >= every:
            self.since_probe, self.num_probes = 0, self.num_probes + 1
            best = int(best * self.probe_share)
        lengths = dict.fromkeys(drafted, 0)
        for _, j, rid in positions[:best]:
            lengths[rid] = max(lengths[rid], j + 1)
        for rid, (available, belief) in drafted.items():
            # A token drafted to measure the request again (draft_length's exploration) is verified whatever the
            # budget says: cut, it brings no evidence, and a batch whose rate fell would never draft again.
            if available and belief is not None and belief.undrafted_steps >= self.explore_after_steps:
                lengths[rid] = max(lengths[rid], 1)
        return lengths

    def draft_depth(self, lengths: Mapping[str, int], beliefs: Mapping[str, AcceptanceBelief | None]) -> int:
        """The deepest position a draft job drafts, given each request's own length (`lengths`): where drafts are
        made in series with the verification, position d is drafted only if the tokens it is expected to add,
        sum_i a_i^d over the requests drafting that deep, are worth the job's extra seconds for it plus their verify
        seconds at the latest step's tokens per second."""
        deepest = max(lengths.values(), default=0)
        if not self.drafts_in_series or not self.tokens_per_second or deepest <= 0:
            return deepest
        num_requests = sum(1 for length in lengths.values() if length > 0)
        rates = {rid: self.rate(beliefs.get(rid)) for rid, length in lengths.items() if length > 0}
        # A request drafted one token to be measured again (draft_length's exploration) gets it, whatever it costs.
        explored = any(length > 0 and (belief := beliefs.get(rid)) is not None
                       and belief.undrafted_steps >= self.explore_after_steps for rid, length in lengths.items())
        floor = 1 if explored else 0
        depth = deepest
        while depth > floor:
            deeper, shallower = self.draft_seconds(num_requests, depth), self.draft_seconds(num_requests, depth - 1)
            if deeper is None or shallower is None:
                return depth
            gain = sum(rates[rid] ** depth for rid, length in lengths.items() if length >= depth)
            drafting = sum(1 for length in lengths.values() if length >= depth)
            cost = max(0.0, deeper - shallower) + drafting * self.seconds_per_token
            if gain >= self.tokens_per_second * cost:
                return depth
            depth -= 1
        return floor

    def _slope(self, num_requests: int, tokens: int) -> float:
        """Verify seconds per scheduled token around `tokens` (a secant a quarter of it either side, never below one
        token per request)."""
        step = max(1, tokens // 4)
        low, high = max(num_requests, tokens - step), tokens + step
        at_low, at_high = self.verify_seconds(num_requests, low), self.verify_seconds(num_requests, high)
        if at_low is None or at_high is None or high <= low:
            return 0.0
        return max(0.0, (at_high - at_low) / (high - low))
