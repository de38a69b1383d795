"""Per-step statistics the engine produces as plain data; the server exports them, auto mode reads them.

Overlap fraction, defined once here: the share of drafting time hidden behind verification,
    overlap = 1 - (seconds the verifier waited for drafts) / (seconds the drafter spent drafting),
clamped to [0, 1]. 1.0 means drafting was fully hidden; 0 means draft-then-verify in sequence. It is derivable from
the two counters `draft_seconds` and `wait_seconds` (in PromQL: 1 - rate(wait) / rate(draft)).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class StepRecord:
    step: int
    started_at: float
    # The step mode: what this step ran in (psd, sd or ar; ar while the drafter is down, whatever was chosen).
    mode: str
    # The sub-batch verified in this step (None when no sub-batches are in use: ar mode, or prefill only).
    verified_group: int | None
    group_sizes: tuple[int, int]
    num_decode_requests: int
    num_prefill_requests: int
    num_requests_with_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    drafted_per_position: tuple[int, ...]
    accepted_per_position: tuple[int, ...]
    num_output_tokens: int
    num_scheduled_tokens: int
    verify_seconds: float
    wait_seconds: float
    # Drafting time of the job whose drafts this step verified (measured inside the drafter).
    draft_seconds: float
    drafter_idle_seconds: float
    schedule_seconds: float
    step_seconds: float
    drafter_up: bool
    k: int
    # Extra drafts: the most draft tokens this step could verify (C); 0 when every request keeps k.
    draft_token_budget: int = 0
    # True when `auto` mode chose this step's mode and k.
    auto: bool = False
    # True when the target verified on the drafter's cores too (placement.py): nothing was drafting meanwhile.
    widened: bool = False
    # Of draft_seconds, the drafter's time up to the first drafted token (catching up on committed tokens, a whole
    # prompt for a new request, and position 1); 0 when the drafter did not say.
    draft_first_token_seconds: float = 0.0
    # Draft jobs in flight while this step verified (psd: the other side's, when its drafter had not finished it by
    # the time this step started). None in flight is what lets the target widen onto the drafter's cores.
    draft_jobs_in_flight: int = 0
    # Decoding requests of the other sub-batch kept out of this step because their drafts were coming.
    num_held_out: int = 0
    # Decoding requests of the verified sub-batch that this step actually verified (balance is measured from these).
    num_verified_members: int = 0
    # Proposal tokens that only padded drafts to k (one decode shape per step); not counted as drafted.
    num_pad_tokens: int = 0
    # How long this step would wait for late drafts (from measured step times) before verifying without them.
    wait_budget_seconds: float = 0.0
    # The engine's own work after the forward pass: committing tokens, sub-batch bookkeeping, sending draft jobs.
    update_seconds: float = 0.0
    # The draft job whose drafts this step verified: its requests and draft length (0: none answered in the step).
    # The cost model prices drafting by these, not by the requests verified with drafts, which differ around switches.
    draft_job_requests: int = 0
    draft_job_length: int = 0
    # Of that job, the committed tokens its drafter had to take in before drafting (per request, what it carried
    # beyond the last token: the tokens accepted since the drafter last saw it, a newcomer's whole prompt), as the job
    # really carried them. The cost model and the calibration price them per token.
    draft_job_catch_up_tokens: int = 0
    # Async PSD steps: scheduled while the previous step was still in flight (before its output was processed).
    # Its step_seconds then count from the previous step's end and verify_seconds is the model runner's own time.
    scheduled_ahead: bool = False
    # Lookahead. Branches (outcomes pre-drafted beyond each request's root) the job sent at this step's launch.
    num_branches_drafted: int = 0
    # Decoding requests of this step verified with a branch matching their committed tokens, and those without one
    # (newcomers, misses, the drafter late or down): hit rate = hits / (hits + misses).
    num_branch_hits: int = 0
    num_branch_misses: int = 0
    # Of the misses, those verified with a draft from their real context the step waited for (a refresh), and that
    # wait's seconds (part of wait_seconds).
    num_refreshed: int = 0
    refresh_seconds: float = 0.0
    # Of this step's verifications with candidates: the bonus token was among the drafter's top-F after a full
    # acceptance (covered / all), and after a rejection (the rejected draft token excluded): what pricing needs
    # beside per-position acceptance to derive a hit rate.
    num_bonus_after_full: int = 0
    num_bonus_covered_after_full: int = 0
    num_bonus_after_reject: int = 0
    num_bonus_covered_after_reject: int = 0
    # The fan-out and branch depth (drafted tokens per branch) the branch job sent at this step's launch used (0: no
    # job).
    lookahead_fanout: int = 0
    lookahead_depth: int = 0


@dataclass
class EngineTotals:
    steps: int = 0
    steps_with_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    output_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    verify_seconds: float = 0.0
    wait_seconds: float = 0.0
    draft_seconds: float = 0.0
    drafter_idle_seconds: float = 0.0
    step_seconds: float = 0.0
    # Filled from the drafter client by Engine.totals(): restarts after crashes, hangs and failed jobs.
    drafter_restarts: int = 0
    deadline_misses: int = 0
    drafter_errors: int = 0
    # Draft jobs a shared drafter service answered "busy" (backpressure): verified without drafts.
    drafter_busy: int = 0
    # Requests pushed back to waiting when the KV cache ran out (vLLM recomputes them on resume).
    preemptions: int = 0
    # Switches of mode or k made by auto mode.
    mode_switches: int = 0
    # Lookahead (StepRecord's fields of the same names, summed).
    branches_drafted: int = 0
    branch_hits: int = 0
    branch_misses: int = 0
    bonus_after_full: int = 0
    bonus_covered_after_full: int = 0
    bonus_after_reject: int = 0
    bonus_covered_after_reject: int = 0

    def __add__(self, other: EngineTotals) -> EngineTotals:
        return self._combine(other, 1)

    def __sub__(self, other: EngineTotals) -> EngineTotals:
        """What happened between two snapshots (later - earlier): pooled counts, not averaged ratios."""
        return self._combine(other, -1)

    def _combine(self, other: EngineTotals, sign: int) -> EngineTotals:
        values: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            mine, theirs = getattr(self, name), getattr(other, name)
            if isinstance(mine, list):
                width = max(len(mine), len(theirs))
                mine, theirs = mine + [0] * (width - len(mine)), theirs + [0] * (width - len(theirs))
                values[name] = [a + sign * b for a, b in zip(mine, theirs, strict=True)]
            else:
                values[name] = mine + sign * theirs
        return EngineTotals(**values)

    def summary(self) -> dict[str, Any]:
        steps = self.steps
        return {
            "steps": steps,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "overlap_fraction": self.overlap_fraction,
            "verify_seconds_per_step": self.verify_seconds / steps if steps else 0.0,
            "draft_seconds_per_step": self.draft_seconds / steps if steps else 0.0,
            "wait_seconds_per_step": self.wait_seconds / steps if steps else 0.0,
            "branch_hit_rate": self.branch_hit_rate,
            "acceptance_per_position": [
                a / d if d else 0.0
                for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=False)
            ],
        }

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens produced per request per verification that carried drafts (accepted drafts + 1)."""
        requests = self.drafted_per_position[0] if self.drafted_per_position else 0
        return 1.0 + self.accepted_tokens / requests if requests else 1.0

    @property
    def branch_hit_rate(self) -> float:
        """Lookahead: decoding requests verified with a branch matching their real outcome, of all verified."""
        total = self.branch_hits + self.branch_misses
        return self.branch_hits / total if total else 0.0

    @property
    def overlap_fraction(self) -> float:
        if self.draft_seconds <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.wait_seconds / self.draft_seconds))


def _add_positions(target: list[int], values: tuple[int, ...]) -> None:
    if len(target) < len(values):
        target.extend([0] * (len(values) - len(target)))
    for i, value in enumerate(values):
        target[i] += value


def _accumulate(totals: EngineTotals, record: StepRecord) -> None:
    totals.steps += 1
    totals.steps_with_drafts += record.num_requests_with_drafts > 0
    totals.draft_tokens += record.num_draft_tokens
    totals.accepted_tokens += record.num_accepted_tokens
    totals.output_tokens += record.num_output_tokens
    _add_positions(totals.drafted_per_position, record.drafted_per_position)
    _add_positions(totals.accepted_per_position, record.accepted_per_position)
    totals.verify_seconds += record.verify_seconds
    totals.wait_seconds += record.wait_seconds
    totals.draft_seconds += record.draft_seconds
    totals.drafter_idle_seconds += record.drafter_idle_seconds
    totals.step_seconds += record.step_seconds
    totals.branches_drafted += record.num_branches_drafted
    totals.branch_hits += record.num_branch_hits
    totals.branch_misses += record.num_branch_misses
    totals.bonus_after_full += record.num_bonus_after_full
    totals.bonus_covered_after_full += record.num_bonus_covered_after_full
    totals.bonus_after_reject += record.num_bonus_after_reject
    totals.bonus_covered_after_reject += record.num_bonus_covered_after_reject


class StatsRecorder:
    """Written by the engine's step thread, read from others: appends and reads happen under one lock."""

    def __init__(self, history: int, decision_history: int = 256) -> None:
        self._lock = threading.Lock()
        self._records: deque[StepRecord] = deque(maxlen=history)
        self._decisions: deque[Any] = deque(maxlen=decision_history)
        self._totals = EngineTotals()

    def record(self, record: StepRecord) -> None:
        with self._lock:
            self._records.append(record)
            _accumulate(self._totals, record)

    def record_decision(self, decision: Any) -> None:
        """Auto mode's switches (minedraft.engine.control.auto.Decision), newest last."""
        with self._lock:
            self._decisions.append(decision)

    def decisions(self) -> list[Any]:
        with self._lock:
            return list(self._decisions)

    def count(self, **increments: int) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self._totals, name, getattr(self._totals, name) + value)

    def totals(self) -> EngineTotals:
        with self._lock:
            return replace(self._totals, drafted_per_position=list(self._totals.drafted_per_position),
                           accepted_per_position=list(self._totals.accepted_per_position))

    def records(self, since_step: int = -1) -> list[StepRecord]:
        with self._lock:
            return [r for r in self._records if r.step > since_step]


def summarize(records: list[StepRecord]) -> dict[str, Any]:
    """Aggregate a window of steps into the headline figures."""
    totals = EngineTotals()
    for r in records:
        _accumulate(totals, r)
    return totals.summary()
