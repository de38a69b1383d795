"""What each way of decoding would yield right now, predicted from the engine's own per-step measurements.

Pure: fed `StepRecord`s, asked for predictions; no clocks, no I/O. Three measured ingredients (design.md §7):

- V(tokens): seconds the target takes to verify a step of that many tokens (decode steps only). Steps with
  nothing drafting beside them (ar, sd, psd with one side empty) have their own curve: on a CPU machine they
  compute on the drafter's cores too (placement.py), so the same number of tokens costs less than in a psd step
  whose other side is being drafted; one shared curve would price each at the other's cost. Each curve stands in
  for the other until it has observations of its own;
- f(requests): seconds of one drafter forward over that many requests; a draft of length k costs t = k * f(n)
  (the catch-up pass that also proposes the first token, then k - 1 more);
- s_i: of the drafts that reached position i, the share accepted up to and including i. The expected tokens per
  request per verification with draft length k is L(k) = 1 + sum_{i<k} s_i (not 1 + k * rate: acceptance falls
  along the draft);
- o(requests): the rest of a step (scheduling, sampling bookkeeping, detokenization), per step.

For R decoding requests the predicted output tokens per second are
    ar:      R / (V(R) + o(R))
    sd(k):   R * L(k) / (k f(R) + V(R (k+1)) + o(R))
    psd(k):  R * L(k) / (max(V'(A (k+1)) + o(A), k f(B)) + max(V'(B (k+1)) + o(B), k f(A)))   A = ceil(R/2), B = R - A
with V' the verification beside a draft. psd with one side empty is sd.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from minedraft.engine.stats import StepRecord

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

    @staticmethod
    def _bucket(size: float) -> int:
        return round(4 * math.log2(max(size, 1.0)))

    def observe(self, size: float, seconds: float) -> None:
        if size <= 0 or seconds < 0 or not math.isfinite(seconds):
            return
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

    def predict(self, size: float) -> float | None:
        if not self.buckets:
            return None
        points = sorted((b[0], b[1]) for b in self.buckets.values())
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


@dataclass(frozen=True)
class Prediction:
    mode: str
    k: int
    output_tokens_per_second: float
    cycle_seconds: float
    tokens_per_cycle: float


@dataclass
class CostModel:
    verify: CostCurve = field(default_factory=CostCurve)
    verify_widened: CostCurve = field(default_factory=CostCurve)
    draft_forward: CostCurve = field(default_factory=CostCurve)
    overhead: CostCurve = field(default_factory=CostCurve)
    acceptance: AcceptanceProfile = field(default_factory=AcceptanceProfile)
    # Step numbers of the last observation of each ingredient (for staleness).
    last_verify_step: int = -1
    last_draft_step: int = -1
    _previous: StepRecord | None = None

    def observe(self, record: StepRecord) -> None:
        previous, self._previous = self._previous, record
        decode_only = record.num_prefill_requests == 0 and record.num_decode_requests > 0
        if decode_only:
            curve = self.verify_widened if record.widened else self.verify
            curve.observe(record.num_scheduled_tokens, record.verify_seconds)
            self.last_verify_step = record.step
        if record.num_requests_with_drafts > 0:
            self.acceptance.observe(record.drafted_per_position, record.accepted_per_position)
            if record.draft_seconds > 0:
                length = max(1, len(record.drafted_per_position))
                self.draft_forward.observe(record.num_requests_with_drafts, record.draft_seconds / length)
                self.last_draft_step = record.step
        if previous is not None and decode_only:
            gap = record.started_at - previous.started_at
            if 0 < gap < MAX_STEP_GAP_SECONDS:
                other = gap - previous.verify_seconds - previous.wait_seconds
                self.overhead.observe(max(1, previous.num_decode_requests + previous.num_prefill_requests),
                                      max(0.0, other))

    def _verify_curve(self, alone: bool) -> CostCurve:
        """The curve for a verification with nothing drafting beside it (alone) or beside a draft (psd)."""
        own, other = (self.verify_widened, self.verify) if alone else (self.verify, self.verify_widened)
        return own if own.buckets else other

    def ready_for(self, mode: str) -> bool:
        if self._verify_curve(alone=mode != "psd").predict(1) is None:
            return False
        if mode == "ar":
            return True
        return self.acceptance.known and self.draft_forward.predict(1) is not None

    def _verify_seconds(self, requests: int, k: int, alone: bool = True) -> float:
        seconds = self._verify_curve(alone).predict(requests * (k + 1))
        overhead = self.overhead.predict(requests) or 0.0
        return (seconds or 0.0) + overhead

    def _draft_seconds(self, requests: int, k: int) -> float:
        return k * (self.draft_forward.predict(requests) or 0.0)

    def extrapolated(self, mode: str, k: int, num_running: int, slack: float = 1.5) -> bool:
        """Whether predicting this setting at this load reaches beyond what was measured (by more than `slack`
        either way): another curve standing in, or sizes far from the observed ones. Such a prediction can be wrong
        by a large factor in either direction (CostCurve extrapolates conservatively), so auto measures instead."""
        if num_running <= 0:
            return False
        a = math.ceil(num_running / 2)
        b = num_running - a
        alone = mode != "psd" or b == 0
        own = self.verify_widened if alone else self.verify
        if self.verify_widened.buckets and not own.buckets:
            # The other placement's curve stands in (they differ only where steps have really been widened).
            return True
        curve = self._verify_curve(alone)
        if mode == "ar":
            return not curve.covers(num_running, slack)
        if alone:
            return not (curve.covers(num_running * (k + 1), slack) and self.draft_forward.covers(num_running, slack))
        return not (curve.covers(a * (k + 1), slack) and self.draft_forward.covers(a, slack)
                    and self.draft_forward.covers(b, slack))

    def predict(self, mode: str, k: int, num_running: int) -> Prediction | None:
        """Output tokens per second for `num_running` decoding requests; None until the inputs are measured."""
        if num_running <= 0 or not self.ready_for(mode):
            return None
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

    def predict_all(self, num_running: int, modes: tuple[str, ...], ks: tuple[int, ...]) -> list[Prediction]:
        predictions: list[Prediction] = []
        for mode in modes:
            for k in (0,) if mode == "ar" else ks:
                prediction = self.predict(mode, k, num_running)
                if prediction is not None:
                    predictions.append(prediction)
        return predictions
