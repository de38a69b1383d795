"""The PSD policy of one engine step, over plain dataclasses: no vLLM, no I/O, no clocks.

Each step the vLLM adapter (vllm_adapter/scheduler.py) describes the running requests as `RequestState`s and asks
the planner:
  - which sub-batch is verified (`pick_group`), and how long it may wait for that sub-batch's drafts
    (`WaitPolicy`, from measured step times);
  - which requests run in this step and with which proposals (`plan`): the verified sub-batch with the drafts made
    from exactly its committed context, padded to k in fixed modes so decode steps have one shape; the other
    sub-batch is held out only where a draft is coming for it (a request with nothing coming decodes now);
  - after the step, where newcomers go and how balance is restored (`after_step`), and what the next draft job
    sends (`draft_job`): per request, the number of tokens the drafter already holds and only the new ones.
Padding and CUDA graphs: vLLM 0.32 captures full decode graphs only for batches where every request has exactly
1 + num_speculative_tokens query tokens, num_speculative_tokens being the engine's maximum (max_num_speculative_tokens;
equal to k for an engine built for one fixed k). Padding to k therefore gives fixed-mode steps that shape. Auto mode
and engines built with a larger maximum run k below it: such steps fall back to vLLM's piecewise graphs (attention
outside the graph) whatever the padding, so auto's switches to a smaller k cost that fallback on every step at that
k, and a switch itself costs nothing more (no capture at run time). Not measured here: there is no GPU.

State, and who owns it: the planner keeps one `RequestRecord` per request it knows (its held draft, the tokens the
drafter holds of it, its failed jobs and hangs, whether it is quarantined) in one dict, `records`, and drops a
request's record in one place (`forget`: finished and aborted requests; a preempted one only leaves its sub-batch,
its tokens kept on both sides). Sub-batch membership is `SubBatches`' (its order is the rebalancing policy: the
newest move first); every member has a record. Which draft jobs are in flight is `InFlight`'s (psd/inflight.py),
written by the drafter link alone and read here by reference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from minedraft.engine.psd.inflight import InFlight, JobInFlight
from minedraft.engine.psd.lookahead import match
from minedraft.engine.psd.subbatch import SubBatches, select_draft_lengths
from minedraft.engine.psd.verify_budget import AcceptanceBelief, DraftLengthPolicy
from minedraft.engine.settings import Mode

# Jobs that carried a request and failed (the drafter naming no culprit) before that request is drafted no more.
QUARANTINE_AFTER_FAILED_JOBS = 3
# Drafter hangs in which a request was the suspect (the longest context of the job the drafter was stuck on) before
# that request is drafted no more: otherwise hang, restart, resend, hang again, for as long as it runs.
QUARANTINE_AFTER_HANGS = 2
# Committed tokens a draft job makes the drafter take in beyond the usual few per request (a newcomer's prompt, whole
# contexts after a restart): the rest follows in later jobs, in chunks, while the request decodes without drafts.
# 2048: on a GPU about one verification step of prefill for a 1-2B drafter (arithmetic, not measured here); whole
# prompts of the CPU benchmarks' 512-token contexts go in one job.
DEFAULT_CATCH_UP_TOKENS_PER_JOB = 2048


def should_widen(plain_decoding: bool, drafts_outstanding: bool, drafter_loading: bool) -> bool:
    """Whether the target may compute on the drafter's cores this step.

    Only while nothing is drafted there: the step decodes without drafts (ar, or the drafter down) and no draft job is
    outstanding. Not while a drafter process is loading its model on those cores either (a first start or a
    replacement after a hang): its load is CPU-bound, and a widened target sharing the core with it was measured
    several times slower than the same steps kept on the target's own cores (`minedraft bench stall`, scenario
    hang)."""
    return (plain_decoding or not drafts_outstanding) and not drafter_loading


@dataclass(frozen=True, slots=True)
class RequestState:
    """What the planner needs of one running request."""

    request_id: str
    # Committed tokens: prompt and verified output, nothing speculative.
    num_tokens: int
    # Past its prompt with exactly one uncomputed (just sampled) token: it can decode, and be drafted.
    decoding: bool
    # Most proposal tokens a verification of it can use: the output budget and the context limit, less the bonus
    # token. Drafting beyond it is wasted.
    draft_room: int
    # Most proposal tokens vLLM can schedule for it (the context limit only); padding may go up to it, since
    # vLLM drops whatever is verified past the output budget.
    pad_room: int
    last_token_id: int


@dataclass(frozen=True, slots=True)
class Draft:
    # The context the draft follows: committed tokens, plus `tail` for a lookahead branch (which assumed them).
    context_num_tokens: int
    token_ids: list[int]
    logprobs: list[float] | None
    # Lookahead: the speculative tokens at the end of the context this branch assumed (an outcome of the step in
    # flight when it was drafted); it is usable only if the request's committed tokens end with exactly these.
    tail: tuple[int, ...] = ()
    # Lookahead: the drafter's top-F token ids at positions 1..len(token_ids)+1 (empty: not asked for).
    candidates: tuple[tuple[int, ...], ...] = ()


@dataclass
class RequestRecord:
    """What the planner remembers of one request between steps (its sub-batch is SubBatches')."""

    # The latest draft made for it (used only while its committed context is still exactly draft.context_num_tokens).
    draft: Draft | None = None
    # Committed tokens the drafter holds of it (sent in earlier jobs): the base of the next delta. None: nothing known
    # to be held (never sent, or lost by the drafter); the next job sends the whole context.
    drafter_holds: int | None = None
    # Jobs that carried it and failed without a culprit named, since its last draft arrived.
    failed_jobs: int = 0
    # Drafter hangs in which it was the suspect.
    hangs: int = 0
    # Drafted no more (every job that carried it failed, or the drafter kept hanging on it): decodes without drafts.
    quarantined: bool = False
    # Lookahead: the branch drafts of the latest round (one per outcome pre-drafted); dropped once the request's
    # context moved past them, replaced by the next round's, and dropped with the record in forget().
    branches: list[Draft] = field(default_factory=list)
    # --draft-length adaptive: its own acceptance (psd/verify_budget.py), dropped with the record.
    acceptance: AcceptanceBelief = field(default_factory=AcceptanceBelief)


@dataclass(frozen=True)
class PlannedStep:
    """The planner's decision for one step, made before it runs and never changed (vLLM's SchedulerOutput is the
    model): the step's mode, the sub-batch it verifies, each request's proposal, and who is held out."""

    # The mode this step runs in (psd, sd or ar): the chosen mode, or ar while the drafter is down.
    step_mode: Mode
    verified_group: int | None
    # The proposal each request carries into this step (drafted tokens first, then padding).
    proposals: dict[str, list[int]]
    # Of each proposal, the drafted tokens at its front (the rest is padding that only fixes the batch's shape).
    drafted_lengths: dict[str, int]
    # Decoding requests kept out of this step: their drafts are coming (or waiting) for their own turn.
    held_out: frozenset[str]
    draft_token_budget: int | None = None
    # Lookahead: the branch each proposal was taken from and how many of its drafted tokens the request had already
    # committed (1 for a root draft whose first token the target sampled too); and the decoding requests of the step
    # that had no branch matching their committed tokens (they decode without drafts: misses).
    branches: dict[str, tuple[Draft, int]] = field(default_factory=dict)
    branch_misses: frozenset[str] = frozenset()
    # Of the misses, those verified with a backup: a branch of the same context length whose tail differs from
    # their committed tokens (also in `branches`).
    backups: frozenset[str] = frozenset()
    # Of the misses, those drafted from their real context while the step waited (core._refresh_misses): verified
    # with that draft (also in `branches`), not a backup.
    refreshed: frozenset[str] = frozenset()

    @property
    def num_drafted_tokens(self) -> int:
        return sum(self.drafted_lengths.values())


@dataclass(frozen=True, slots=True)
class JobItemPlan:
    request_id: str
    # Committed tokens the drafter already holds of this request: the job sends only tokens[base:num_tokens].
    base_num_tokens: int
    # The request's committed tokens, or fewer: a chunk of a long catch-up (then num_draft_tokens is 0).
    num_tokens: int
    # 0: take the tokens in, draft nothing (a chunk of a long catch-up).
    num_draft_tokens: int
    # Lookahead: speculative tokens after the committed ones this branch drafts from (never held by the drafter as
    # committed), and the branch's number within its request.
    tail: tuple[int, ...] = ()
    branch: int = 0


@dataclass
class WaitPolicy:
    """How long a step may wait for late drafts: a fraction of the step, from measured times.

    The drafter had the whole previous step to draft this sub-batch; once it is later than the step is expected to
    take (the larger of measured verify and draft times, times `slack`) the sub-batch is verified without drafts
    (plain decoding for one step) rather than holding every request of the replica. Until anything is measured the
    configured `cap_seconds` applies (first jobs carry whole prompts).
    """

    cap_seconds: float
    slack: float = 1.5
    floor_seconds: float = 0.002
    # Exponential moving average weight of the newest sample.
    alpha: float = 0.2
    verify_seconds: float | None = None
    draft_seconds: float | None = None

    def observe_verify(self, seconds: float) -> None:
        self.verify_seconds = _ema(self.verify_seconds, seconds, self.alpha)

    def observe_draft(self, seconds: float) -> None:
        self.draft_seconds = _ema(self.draft_seconds, seconds, self.alpha)

    def budget_seconds(self) -> float:
        if self.verify_seconds is None:
            return self.cap_seconds
        expected = max(self.verify_seconds, self.draft_seconds or 0.0)
        return min(self.cap_seconds, max(self.floor_seconds, self.slack * expected))


def _ema(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else (1 - alpha) * old + alpha * sample


def _backup(held: Sequence[Draft], num_tokens: int) -> tuple[Draft, int] | None:
    """Lookahead's backup for a request at `num_tokens` committed tokens that no branch matched: the likeliest
    branch drafted for its accepted length (held in order of likelihood), else the draft whose context ends nearest
    before it, read from the position it reached (a root whose first drafted token the target did not sample). Its
    drafts followed a context that differs from the request's in a token or so: often still partly accepted."""
    same = next((b for b in held if b.context_num_tokens == num_tokens and b.token_ids), None)
    if same is not None:
        return same, 0
    behind = [b for b in held if b.context_num_tokens < num_tokens < b.context_num_tokens + len(b.token_ids)]
    if not behind:
        return None
    nearest = max(behind, key=lambda b: b.context_num_tokens)
    return nearest, num_tokens - nearest.context_num_tokens


@dataclass
class PSDPlanner:
    k: int
    num_extra_draft_tokens: int = 0
    draft_token_budget: int | None = None
    # Pad every verified decoding request's proposal to exactly k in fixed modes (one decode shape per step).
    pad_to_k: bool = True
    # Jobs carry only the tokens committed since the drafter last saw a request (off: whole contexts every job, the
    # old protocol, kept for side-by-side benchmarks).
    send_deltas: bool = True
    subbatches: SubBatches = field(default_factory=SubBatches)
    turn: int = 0
    # The draft jobs in flight: the drafter link's (it is their only writer); read here, never copied.
    in_flight: InFlight = field(default_factory=InFlight)
    # One record per request the planner knows, dropped only by forget().
    records: dict[str, RequestRecord] = field(default_factory=dict)
    # The longest context the drafter holds (its Ready; 0: no known limit). Requests at or past it are never sent: they
    # decode in every step without drafts instead of sitting out every other step for drafts that never come.
    drafter_max_tokens: int = 0
    # Bound on one job's catch-up (see DEFAULT_CATCH_UP_TOKENS_PER_JOB).
    catch_up_tokens_per_job: int = DEFAULT_CATCH_UP_TOKENS_PER_JOB
    # Lookahead: a miss is verified with a backup branch where there is one (see _plan_lookahead).
    lookahead_backups: bool = True
    # sd and psd with --draft-length adaptive: each request's draft length and the step's verify budget (None: k).
    draft_lengths: DraftLengthPolicy | None = None

    # -- the records ---------------------------------------------------------------------------------------------

    def record(self, request_id: str) -> RequestRecord:
        """The request's record, made on first sight."""
        record = self.records.get(request_id)
        if record is None:
            record = self.records[request_id] = RequestRecord()
        return record

    def known(self) -> set[str]:
        """Every request the planner holds anything of (a record or a sub-batch slot)."""
        return set(self.records) | self.subbatches.all_members()

    def _draft_of(self, request_id: str) -> Draft | None:
        record = self.records.get(request_id)
        return record.draft if record is not None else None

    def _holds(self, request_id: str) -> int:
        record = self.records.get(request_id)
        return (record.drafter_holds or 0) if record is not None else 0

    def _is_quarantined(self, request_id: str) -> bool:
        record = self.records.get(request_id)
        return record is not None and record.quarantined

    # Read-only snapshots for tests and the engine's views (built from the records; writing to them changes nothing).
    @property
    def drafts(self) -> dict[str, Draft]:
        return {rid: r.draft for rid, r in self.records.items() if r.draft is not None}

    @property
    def drafter_holds(self) -> dict[str, int]:
        return {rid: r.drafter_holds for rid, r in self.records.items() if r.drafter_holds is not None}

    @property
    def quarantined(self) -> set[str]:
        return {rid for rid, r in self.records.items() if r.quarantined}

    # -- the step ------------------------------------------------------------------------------------------------

    def pick_group(self, requests: Sequence[RequestState], step_mode: Mode) -> int | None:
        if step_mode in (Mode.SD, Mode.LOOKAHEAD):
            return 0
        if step_mode is not Mode.PSD:
            return None
        decoding_members = [0, 0]
        for request in requests:
            group = self.subbatches.group_of(request.request_id)
            if group is not None and request.decoding:
                decoding_members[group] += 1
        if decoding_members[self.turn] == 0 and decoding_members[1 - self.turn] > 0:
            # One side empty: sequential SD on the other instead of stalling.
            self.turn = 1 - self.turn
        return self.turn

    def usable_draft(self, request: RequestState) -> list[int]:
        """The held draft for exactly this request's committed context, cut to what the step can use."""
        record = self.records.get(request.request_id)
        draft = record.draft if record is not None else None
        if draft is None or draft.context_num_tokens != request.num_tokens or record is None or record.quarantined:
            return []
        return draft.token_ids[: max(0, min(request.draft_room, self.k + self.num_extra_draft_tokens))]

    def plan(self, requests: Sequence[RequestState], step_mode: Mode, verified_group: int | None,
             pad: bool = True, reader: Callable[[str, int, int], Sequence[int]] | None = None,
             busy: frozenset[str] = frozenset()) -> PlannedStep:
        """Who runs in this step and with which proposals. `pad`: the mode is fixed (auto varies k anyway);
        `reader`: reads committed tokens (lookahead compares branches' tails with them); `busy`: requests of steps in
        flight (not decoding in `requests`, yet no prompt of this step)."""
        if step_mode is Mode.LOOKAHEAD and verified_group is not None and reader is not None:
            return self._plan_lookahead(requests, pad, reader)
        if step_mode not in (Mode.PSD, Mode.SD) or verified_group is None:
            return PlannedStep(step_mode, None, {}, {}, frozenset())
        coming = self.in_flight.coming(1 - verified_group) if step_mode is Mode.PSD else frozenset()
        held_out: set[str] = set()
        drafted: dict[str, list[int]] = {}
        running: list[RequestState] = []
        for request in requests:
            if not request.decoding:
                continue
            group = self.subbatches.group_of(request.request_id)
            other_side = step_mode is Mode.PSD and group is not None and group != verified_group
            if other_side and (request.request_id in coming or self.usable_draft(request)):
                held_out.add(request.request_id)
                continue
            # (Another side's request with nothing coming, its last token or a context the drafter skipped, decodes
            # now rather than sit out a step for nothing.)
            running.append(request)
            tokens = self.usable_draft(request) if group == verified_group else []
            if tokens:
                drafted[request.request_id] = tokens
        budget = self.budget(requests, verified_group)
        lengths = select_draft_lengths(
            {rid: self._logprobs(rid, len(tokens)) for rid, tokens in drafted.items()}, self.k, budget
        )
        policy = self.draft_lengths
        if policy is not None and drafted:
            # The step's verify budget: the positions worth their verify tokens (any subset of a draft is lossless).
            lengths = policy.budget({rid: (lengths[rid], self.records[rid].acceptance) for rid in drafted},
                                    len(running), may_probe=all(r.decoding or r.request_id in busy for r in requests))
        proposals = {rid: tokens[: lengths[rid]] for rid, tokens in drafted.items() if lengths[rid]}
        drafted_lengths = {rid: len(tokens) for rid, tokens in proposals.items()}
        if pad and self.pad_to_k and not self.num_extra_draft_tokens and proposals and policy is None:
            # Any proposal is lossless, so padding costs only the verification of the pad tokens; in return every
            # decoding request in the step has 1 + k query tokens: the one shape vLLM captures full graphs for.
            # (Not with adaptive draft lengths: padding would verify again the tokens the budget took out.)
            self._pad_to_k(running, proposals, drafted_lengths)
        return PlannedStep(step_mode, verified_group, proposals, drafted_lengths, frozenset(held_out), budget)

    def _plan_lookahead(self, requests: Sequence[RequestState], pad: bool,
                        tokens: Callable[[str, int, int], Sequence[int]]) -> PlannedStep:
        """Every decoding request runs: with the branch that matches its committed tokens exactly, or, a miss, with
        a backup (with `lookahead_backups`: the likeliest branch drafted for the same accepted length, whose bonus
        token was not the target's) or without drafts (its root item is then drafted at this step's launch).
        Padded to k as sd is, for one decode shape.

        Why a backup rather than waiting for a short draft: waiting stalls the whole batch for one request, while a
        backup is already drafted and costs nothing in a padded step (its k positions would carry filler tokens).
        Any proposal is lossless (the target verifies it; it depends on committed tokens only, never on the target's
        draws at the positions it proposes), and one drafted after a near-miss context is often partly accepted.
        Without one (no branch of that length) the request decodes without drafts for one step."""
        proposals: dict[str, list[int]] = {}
        taken: dict[str, tuple[Draft, int]] = {}
        misses: set[str] = set()
        backups: set[str] = set()
        running: list[RequestState] = []
        for request in requests:
            if not request.decoding:
                continue
            running.append(request)
            rid = request.request_id
            record = self.records.get(rid)
            found = None
            backup = None
            if record is not None and not record.quarantined:
                held = [*record.branches, *([record.draft] if record.draft is not None else [])]
                found = match(held, request.num_tokens, rid, tokens)
                if found is None and self.lookahead_backups:
                    backup = _backup(held, request.num_tokens)
                # Branches at or before this context that did not match never will (the committed tokens they
                # assumed differ, and committed tokens stay); those past it are a later round's.
                record.branches = [b for b in record.branches if b.context_num_tokens > request.num_tokens]
            room = max(0, min(request.draft_room, self.k))
            if found is None or not room:
                misses.add(rid)
                if backup is None or not room:
                    continue
                backups.add(rid)
                found = backup
            draft, already = found
            proposal = draft.token_ids[already:already + room]
            proposals[rid] = proposal
            taken[rid] = found
        drafted_lengths = {rid: len(p) for rid, p in proposals.items()}
        if pad and self.pad_to_k and proposals:
            self._pad_to_k(running, proposals, drafted_lengths)
        return PlannedStep(Mode.LOOKAHEAD, 0, proposals, drafted_lengths, frozenset(), None, taken,
                           frozenset(misses), frozenset(backups))

    def _pad_to_k(self, running: Sequence[RequestState], proposals: dict[str, list[int]],
                  drafted_lengths: dict[str, int]) -> None:
        """Pad each running request's proposal to k (within its pad room) with filler tokens, in place."""
        for request in running:
            proposal = proposals.get(request.request_id, [])
            want = min(self.k, request.pad_room)
            if len(proposal) < want:
                filler = proposal[-1] if proposal else request.last_token_id
                proposals[request.request_id] = proposal + [filler] * (want - len(proposal))
                drafted_lengths.setdefault(request.request_id, 0)

    def lookahead_job(self, requests: Sequence[RequestState], scheduled: Callable[[str], bool],
                      tails: Mapping[str, Sequence[tuple[int, ...]]],
                      finishing_prompts: frozenset[str] = frozenset(), depth: int | None = None,
                      fresh: bool = False) -> list[JobItemPlan]:
        """The branch job sent at a lookahead step's launch: per request that runs in it, its committed delta (as
        draft_job sends it, catch-up bounded the same way) and one item per tail in `tails` (the root, (), for a
        request verified without drafts). Each item drafts up to `depth` (default k) tokens after its tail (a root one
        more: its first drafted token is the guess for the token this step samples), within what the next
        verification can use. `fresh`: roots for the step about to be launched (a refresh of its misses), drafted
        for exactly the committed context: k tokens, none guessing a token still to be sampled."""
        if 0 in self.in_flight:
            return []
        items: list[JobItemPlan] = []
        usual_delta = self.k + 1
        catch_up_left = self.catch_up_tokens_per_job
        for request in requests:
            rid = request.request_id
            if (not (request.decoding or rid in finishing_prompts) or not (scheduled(rid) or rid in finishing_prompts)
                    or self._is_quarantined(rid) or rid not in tails):
                continue
            base = self._holds(rid) if self.send_deltas else 0
            if base > request.num_tokens:
                base = 0
            new = request.num_tokens - base
            if new > usual_delta:
                if new > catch_up_left:
                    if catch_up_left > 0:
                        items.append(JobItemPlan(rid, base, base + catch_up_left, 0))
                    catch_up_left = 0
                    continue
                catch_up_left -= new
            first = True
            for branch, tail in enumerate(tails[rid]):
                # The next verification's room: what is left of the output budget after this step's tokens.
                sampled = 0 if fresh else max(1, len(tail))
                room = min(self.k if depth is None else min(depth, self.k), request.draft_room - sampled)
                if self.drafter_max_tokens:
                    room = min(room, self.drafter_max_tokens - request.num_tokens - len(tail) - 1)
                if room <= 0:
                    continue
                item_depth = room + 1 if not tail and not fresh else room
                items.append(JobItemPlan(rid, base if first else request.num_tokens, request.num_tokens, item_depth,
                                         tuple(tail), branch))
                first = False
        return items

    def refresh(self, plan: PlannedStep, requests: Sequence[RequestState], pad: bool,
                tokens: Callable[[str, int, int], Sequence[int]]) -> PlannedStep:
        """`plan` with its misses matched again, after drafts from their real context arrived (core._refresh_misses):
        each that matches now is verified with that draft; the rest keep what the plan gave them."""
        missed = [r for r in requests if r.request_id in plan.branch_misses]
        again = self._plan_lookahead(missed, pad, tokens)
        refreshed = {rid for rid in again.branches if rid not in again.branch_misses}
        if not refreshed:
            return plan
        proposals = {**plan.proposals, **{rid: again.proposals[rid] for rid in refreshed}}
        drafted_lengths = {**plan.drafted_lengths, **{rid: again.drafted_lengths[rid] for rid in refreshed}}
        branches = {**plan.branches, **{rid: again.branches[rid] for rid in refreshed}}
        return replace(plan, proposals=proposals, drafted_lengths=drafted_lengths, branches=branches,
                       backups=plan.backups - refreshed, refreshed=frozenset(refreshed))

    def store_branches(self, drafts: Iterable[tuple[str, Draft]], is_live: Callable[[str], bool]) -> None:
        """A lookahead job's drafts: each request's replace the branches it held."""
        by_request: dict[str, list[Draft]] = {}
        for request_id, draft in drafts:
            if is_live(request_id):
                by_request.setdefault(request_id, []).append(draft)
        for request_id, branches in by_request.items():
            record = self.record(request_id)
            record.branches = branches
            record.failed_jobs = 0

    def budget(self, requests: Sequence[RequestState], group: int) -> int | None:
        """Extra drafts: the C positions kept in a sub-batch (k per member unless configured)."""
        if not self.num_extra_draft_tokens:
            return None
        if self.draft_token_budget is not None:
            return self.draft_token_budget
        members = sum(1 for r in requests if self.subbatches.group_of(r.request_id) == group)
        return self.k * max(1, members)

    def _logprobs(self, request_id: str, length: int) -> list[float]:
        draft = self.records[request_id].draft
        assert draft is not None
        return [0.0] * length if draft.logprobs is None else draft.logprobs[:length]

    def after_step(self, requests: Sequence[RequestState], step_mode: Mode, verified_group: int | None,
                   chosen_mode: Mode) -> None:
        """Admit new decoders (to the side drafted next), restore balance, pass the turn."""
        preferred = verified_group if verified_group is not None else self.turn
        for request in requests:
            if request.decoding and request.request_id not in self.subbatches:
                self.record(request.request_id)
                if chosen_mode in (Mode.SD, Mode.LOOKAHEAD):
                    self.subbatches.admit(request.request_id, 0, balance=False)
                else:
                    self.subbatches.admit(request.request_id, preferred)
        if chosen_mode is Mode.PSD:
            self.subbatches.rebalance()
        if step_mode is Mode.PSD and verified_group is not None:
            self.turn = 1 - verified_group

    def switch_mode(self, previous: Mode, mode: Mode, k: int, num_extra_draft_tokens: int) -> None:
        """A switch at a step boundary (auto's decisions, or the operator's): only sub-batch membership and draft
        lengths change, never a request's tokens (drafts held for the old setting stay valid: they are keyed by
        context length and trimmed to k + e)."""
        self.k, self.num_extra_draft_tokens = k, num_extra_draft_tokens
        if self.draft_lengths is not None:
            self.draft_lengths.k_max = k
        if mode in (Mode.SD, Mode.LOOKAHEAD):
            self.subbatches.merge_into(0)
            self.turn = 0
        elif mode is Mode.PSD and previous is not Mode.PSD:
            self.subbatches.rebalance()

    # -- draft jobs ----------------------------------------------------------------------------------------------

    def draft_job(self, requests: Sequence[RequestState], group: int) -> list[JobItemPlan]:
        """The next job for `group`: its decoding members without a valid draft, each as a delta.

        Usual deltas (the tokens committed by the last verification) always go whole. Longer catch-ups are bounded
        by `catch_up_tokens_per_job`: each one to that many tokens (no single prefill grows with a prompt), and, when
        the job also drafts requests that are caught up, all of them together (those requests' drafts must not wait
        for a newcomer's prompt). A catch-up that does not fit sends the chunk that does, drafting nothing, and its
        request decodes without drafts (nothing coming for it) until the drafter has caught up. A job of newcomers
        only (a burst of arrivals, a restarted drafter) delays no one's drafts and takes each of them whole."""
        if group in self.in_flight:
            return []
        items: list[JobItemPlan] = []
        num_draft_tokens = self.k + self.num_extra_draft_tokens
        usual_delta = num_draft_tokens + 1
        others_drafting = any(
            self.subbatches.group_of(r.request_id) == group and r.decoding and not self._is_quarantined(r.request_id)
            and 0 < r.num_tokens - self._holds(r.request_id) <= usual_delta for r in requests)
        catch_up_left = self.catch_up_tokens_per_job
        for request in requests:
            rid = request.request_id
            if self.subbatches.group_of(rid) != group or not request.decoding or self._is_quarantined(rid):
                continue
            existing = self._draft_of(rid)
            if existing is not None and existing.context_num_tokens == request.num_tokens:
                continue  # still holds valid drafts (it was not verified this step)
            room = min(num_draft_tokens, request.draft_room)
            if self.drafter_max_tokens:
                room = min(room, self.drafter_max_tokens - request.num_tokens)
            if self.draft_lengths is not None and room > 0:
                # Its own draft length: none for a request whose drafts are not worth their verify tokens (it decodes
                # without drafts, one token a step, its tokens caught up with the next job that drafts it).
                room = self.draft_lengths.draft_length(self.record(rid).acceptance, room)
            if room <= 0:
                continue
            base = self._holds(rid) if self.send_deltas else 0
            if base > request.num_tokens:
                base = 0  # cannot happen without a bug elsewhere (committed tokens never shrink): resend all
            new = request.num_tokens - base
            if new <= usual_delta:
                items.append(JobItemPlan(rid, base, request.num_tokens, room))
                continue
            allowed = catch_up_left if others_drafting else self.catch_up_tokens_per_job
            if new <= allowed:
                items.append(JobItemPlan(rid, base, request.num_tokens, room))
            elif allowed > 0:
                items.append(JobItemPlan(rid, base, base + allowed, 0))
            if others_drafting:
                catch_up_left = max(0, catch_up_left - new)
        if self.draft_lengths is not None and items:
            items = self._within_draft_depth(items)
        return items

    def _within_draft_depth(self, items: list[JobItemPlan]) -> list[JobItemPlan]:
        """Adaptive lengths: the job's items cut to the depth worth drafting (sd: the job delays the step)."""
        assert self.draft_lengths is not None
        lengths = {item.request_id: item.num_draft_tokens for item in items}
        depth = self.draft_lengths.draft_depth(
            lengths, {rid: self.record(rid).acceptance for rid in lengths})
        return [item if item.num_draft_tokens <= depth else replace(item, num_draft_tokens=depth) for item in items]

    def observe_acceptance(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verification's outcome for a request (drafted 0: it decoded without drafts), for adaptive lengths."""
        record = self.records.get(request_id)
        if self.draft_lengths is not None and record is not None:
            self.draft_lengths.observe(record.acceptance, drafted, accepted)

    def job_sent(self, items: Sequence[JobItemPlan]) -> None:
        """The drafter took a job (the link recorded it in flight): it holds the job's tokens from now on."""
        for item in items:
            # The drafter takes in a job's tokens on receipt, even if it is later told to drop the job's work.
            self.record(item.request_id).drafter_holds = item.num_tokens

    def store_drafts(self, drafts: Iterable[tuple[str, Draft]], is_live: Callable[[str], bool]) -> None:
        """Keep drafts of requests that have not finished."""
        for request_id, draft in drafts:
            if is_live(request_id):
                record = self.record(request_id)
                record.draft = draft
                record.failed_jobs = 0

    def need_full_context(self, request_ids: Iterable[str]) -> None:
        """The drafter lost these requests (evicted, or an unexpected base): the next job sends everything."""
        for request_id in request_ids:
            record = self.records.get(request_id)
            if record is not None:
                record.drafter_holds = None

    def drafter_restarted(self) -> None:
        """A new drafter process holds nothing (the link dropped what was in flight to the old one)."""
        for record in self.records.values():
            record.drafter_holds = None

    @staticmethod
    def blames_the_drafter(job: JobInFlight | None, culprits: Sequence[str]) -> bool:
        """A failed job that names every request it drafted (two or more) as a culprit: each failed alone, which
        says more about the drafter (a device error that fails everything) than about the requests."""
        drafted = job.drafted if job is not None else frozenset()
        return len(drafted) >= 2 and drafted <= set(culprits)

    def drafter_failed(self, job: JobInFlight | None) -> None:
        """A job failed for the drafter's sake, not its requests': nobody is blamed; the next drafter gets whole
        contexts."""
        self.need_full_context(job.drafted if job is not None else frozenset())

    def job_hung(self, carried: Iterable[str], num_tokens: dict[str, int]) -> list[str]:
        """The drafter hung on a job carrying `carried`. The suspect is its longest context (hangs come with long
        prefills); a suspect of QUARANTINE_AFTER_HANGS hangs is drafted no more. Returns the newly quarantined."""
        known = [rid for rid in carried if rid in num_tokens]
        if not known:
            return []
        longest = max(num_tokens[rid] for rid in known)
        newly: list[str] = []
        for request_id in sorted(rid for rid in known if num_tokens[rid] == longest):
            record = self.record(request_id)
            record.hangs += 1
            if record.hangs >= QUARANTINE_AFTER_HANGS and not record.quarantined:
                record.quarantined = True
                record.draft = None
                record.branches = []
                newly.append(request_id)
        return newly

    def job_failed(self, job: JobInFlight | None, culprits: Sequence[str]) -> list[str]:
        """A job failed (`job`: it, answered; None for one no longer tracked). Named culprits are quarantined at once;
        without names every request it drafted is suspect, and one carried by QUARANTINE_AFTER_FAILED_JOBS failed
        jobs in a row is quarantined. Returns the newly quarantined ids. Quarantined requests decode without drafts;
        the drafter keeps serving the rest."""
        drafted = job.drafted if job is not None else frozenset()
        newly: list[str] = []
        suspects = list(culprits) if culprits else sorted(drafted)
        for request_id in suspects:
            record = self.records.get(request_id)
            if record is None:
                continue  # forgotten already (it finished while its job ran): nothing to quarantine
            record.failed_jobs += 1
            if culprits or record.failed_jobs >= QUARANTINE_AFTER_FAILED_JOBS:
                if not record.quarantined:
                    record.quarantined = True
                    newly.append(request_id)
                record.draft = None
                record.branches = []
        # The drafter may have half taken in a failed job's tokens: resend whole contexts next time.
        self.need_full_context(drafted)
        return newly

    # -- leaving -------------------------------------------------------------------------------------------------

    def forget(self, request_ids: Iterable[str]) -> list[str]:
        """Requests that finished or were aborted: the one place a request's state is dropped (its record and its
        sub-batch slot). Returns those the drafter holds tokens of (to be forgotten there too)."""
        drop_in_drafter: list[str] = []
        for request_id in request_ids:
            self.subbatches.remove(request_id)
            record = self.records.pop(request_id, None)
            if record is not None and record.drafter_holds is not None:
                drop_in_drafter.append(request_id)
        return drop_in_drafter

    def leave_sub_batches(self, request_ids: Iterable[str]) -> None:
        """Preempted (back to waiting) but alive: out of the sub-batches, tokens kept on both sides."""
        for request_id in request_ids:
            self.subbatches.remove(request_id)

    # -- invariants ----------------------------------------------------------------------------------------------

    def check_step(self, plan: PlannedStep, requests: Sequence[RequestState],
                   scheduled: Mapping[str, list[int]]) -> None:
        """What vLLM scheduled matches the plan: drafted positions are exactly the held draft for the request's
        current context, and no held-out request ran."""
        by_id = {r.request_id: r for r in requests}
        for request_id, tokens in scheduled.items():
            if request_id in plan.held_out:
                raise AssertionError(f"{request_id}: held out of the step but scheduled")
            if request_id not in plan.proposals and all(t == -1 for t in tokens):
                continue  # vLLM's own placeholder padding of a request resumed from its waiting queue
            proposal = plan.proposals.get(request_id)
            if proposal is None or tokens != proposal[: len(tokens)]:
                raise AssertionError(f"{request_id}: verified {tokens}, planned {proposal}")
            drafted = plan.drafted_lengths.get(request_id, 0)
            request = by_id.get(request_id)
            if plan.step_mode is Mode.LOOKAHEAD:
                # (A backup's tail differs from the committed tokens by design; its context length does not.)
                branch = plan.branches.get(request_id)
                if drafted and (branch is None or request is None
                                or branch[0].context_num_tokens + branch[1] != request.num_tokens
                                or branch[0].token_ids[branch[1]:branch[1] + drafted] != proposal[:drafted]):
                    raise AssertionError(f"{request_id}: verified a branch not drafted for its committed context")
                continue
            draft = self._draft_of(request_id)
            if drafted and (draft is None or request is None or draft.context_num_tokens != request.num_tokens
                            or draft.token_ids[:drafted] != proposal[:drafted]):
                raise AssertionError(f"{request_id}: verified a draft not made from its committed context")

    def check_invariants(self, requests: Sequence[RequestState], alive: set[str], chosen_mode: Mode) -> None:
        """`requests`: the running ones; `alive`: every unfinished request (running, waiting, preempted)."""
        running = {r.request_id for r in requests}
        decoding = {r.request_id for r in requests if r.decoding}
        members = self.subbatches.all_members()
        if decoding - members:
            raise AssertionError(f"decoding requests outside both sub-batches: {sorted(decoding - members)}")
        if members - running:
            raise AssertionError(f"sub-batch members that are not running: {sorted(members - running)}")
        if chosen_mode is Mode.PSD:
            self.subbatches.check_balanced()
        elif chosen_mode in (Mode.SD, Mode.LOOKAHEAD) and self.subbatches.sizes()[1]:
            raise AssertionError(f"{chosen_mode.value} mode keeps every request in sub-batch 0")
        leaked = sorted(set(self.records) - alive)
        if leaked:
            raise AssertionError(f"state kept for requests that finished: {leaked}")
        unrecorded = sorted(members - set(self.records))
        if unrecorded:
            raise AssertionError(f"sub-batch members without a record: {unrecorded}")

