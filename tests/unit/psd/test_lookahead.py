"""Lookahead through the speculation core: a fake drafter that answers branch jobs from a known target, hand-made
outcomes (greedy verification against that target), no vLLM, no process, no clock but the test's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from minedraft.engine.psd.core import SpeculationCore, StepDecision, StepOutcome
from minedraft.engine.psd.events import DraftsArrived, TokenReader
from minedraft.engine.psd.lookahead import (
    STALE_JOBS,
    LookaheadStats,
    Verified,
    allot,
    bonus_rank,
    choose_shape,
    match,
    outcomes,
    refresh_pays,
)
from minedraft.engine.psd.planner import Draft, JobItemPlan, RequestState
from minedraft.engine.settings import DEFAULT_LOOKAHEAD_FANOUT, Mode, SchedulerSettings
from tests.unit.psd.test_core import FakeSource

K = 3


def target(rid: str, position: int) -> int:
    """The target's greedy token at `position` of request `rid`."""
    return 100 + (position * 7 + len(rid) * 13) % 50


@dataclass
class World:
    """Requests' committed tokens, and a drafter that agrees with the target except at chosen positions."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    # (request, position) where the drafter's top-1 is wrong; `covered`: the target's token is then its rank-1
    # candidate (else it is not among the candidates at all).
    wrong: set[tuple[str, int]] = field(default_factory=set)
    covered: bool = True
    # A drafter that proposes nothing right after a rejection (every outcome enumerated is missed).
    blind: bool = False

    def read(self, rid: str, start: int, end: int) -> list[int]:
        assert end <= len(self.tokens[rid]), "only committed tokens are read"
        return self.tokens[rid][start:end]

    def view(self, rid: str) -> RequestState:
        return RequestState(rid, len(self.tokens[rid]), True, draft_room=100, pad_room=1000,
                            last_token_id=self.tokens[rid][-1])

    def guess(self, rid: str, position: int) -> tuple[int, tuple[int, ...]]:
        """The drafter's token at `position` and its top-4 candidates there."""
        right = target(rid, position)
        if (rid, position) in self.wrong:
            others = (right,) if self.covered and not self.blind else (7,)
            return right + 1000, (right + 1000, *others, 8, 9)
        return right, (right, 5, 6, 7)

    def draft(self, item: JobItemPlan) -> Draft:
        start = item.num_tokens + len(item.tail)
        drafted = [self.guess(item.request_id, start + i)[0] for i in range(item.num_draft_tokens)]
        candidates = tuple(self.guess(item.request_id, start + i)[1] for i in range(item.num_draft_tokens + 1))
        return Draft(start, drafted, None, item.tail, candidates)


@dataclass
class LookaheadSource(FakeSource):
    top_fs: list[int] = field(default_factory=list)

    def submit(self, group: int, items: Sequence[JobItemPlan], tokens: TokenReader, want_logprobs: bool,
               top_f: int = 0) -> bool:
        self.top_fs.append(top_f)
        return super().submit(group, items, tokens, want_logprobs)

    def answer_branches(self, world: World, draft_seconds: float = 0.01) -> None:
        job = self.jobs.get(0)
        assert job is not None
        items = self.sent[-1][1]
        self.jobs.complete(job.job_id)
        drafts = tuple((i.request_id, world.draft(i)) for i in items if i.num_draft_tokens)
        self.inbox.append(DraftsArrived(job, job.job_id, drafts, draft_seconds, 0.0, 0.0))


def make(world: World, measured: bool = True, **changes: object) -> tuple[SpeculationCore, LookaheadSource]:
    """`measured`: the core has already seen high acceptance (full acceptances rank first, as in a warm engine)."""
    source = LookaheadSource()
    settings = SchedulerSettings(mode=Mode.LOOKAHEAD, num_speculative_tokens=K, max_num_speculative_tokens=K,
                                 check_invariants=True, **changes)  # type: ignore[arg-type]
    clock = iter(float(i) for i in range(10_000))
    core = SpeculationCore(settings, source, world.read, clock=lambda: next(clock))
    for _ in range(20 if measured else 0):
        core.lookahead_stats.observe_acceptance(K, K)
    return core, source


def step(core: SpeculationCore, world: World, rids: list[str], gone: Sequence[str] = ()) -> StepDecision:
    """One step, verified greedily against the target: accepted while the proposal matches, then its token."""
    views = [world.view(rid) for rid in rids]
    decision = core.schedule(views)
    assert not decision.held, "lookahead verifies the whole batch"
    core.commit(decision, rids, {rid: list(p) for rid, p in decision.proposals.items()})
    verify(core, world, decision, rids, gone)
    return decision


def verify(core: SpeculationCore, world: World, decision: StepDecision, rids: list[str],
           gone: Sequence[str] = ()) -> None:
    """A committed step's greedy verification against the target, and the core's update (`gone`: finished in it)."""
    sampled: dict[str, int] = {}
    for rid in rids:
        tokens = world.tokens[rid]
        before = len(tokens)
        for proposed in [*decision.proposals.get(rid, []), None]:
            right = target(rid, len(tokens))
            tokens.append(right)
            if proposed != right:
                break
        sampled[rid] = len(tokens) - before
    for rid in gone:
        del world.tokens[rid]
    after = [world.view(rid) for rid in rids if rid not in gone]
    outcome = StepOutcome(views=after, verified={rid: list(p) for rid, p in decision.proposals.items()},
                          num_sampled=sampled, decoded=rids, num_prefill_requests=0,
                          num_scheduled_tokens=sum(sampled.values()), verify_done_at=0.0, worker_seconds=0.05,
                          gone=gone, alive={v.request_id for v in after}, update_seconds=0.001)
    core.update(decision, outcome)


def start(world: World, *rids: str) -> None:
    for rid in rids:
        world.tokens[rid] = [target(rid, i) for i in range(10)]


def test_a_request_takes_the_branch_of_its_real_outcome_and_output_is_the_targets():
    world = World()
    start(world, "a", "b")
    core, source = make(world, measured=False)
    first = step(core, world, ["a", "b"])
    # Newcomers: no branch, so no drafts; their roots (real context, no tail) are drafted k + 1 deep at launch.
    assert first.plan.branch_misses == {"a", "b"} and not first.plan.branches
    items = source.sent[-1][1]
    assert [(i.request_id, i.tail, i.num_draft_tokens) for i in items] == [("a", (), K + 1), ("b", (), K + 1)]
    assert source.top_fs[-1] == DEFAULT_LOOKAHEAD_FANOUT
    hits = []
    for _ in range(8):
        source.answer_branches(world)
        decision = step(core, world, ["a", "b"])
        hits.append(set(decision.plan.branches))
        assert all(len(p) == K for p in decision.proposals.values())
    # Unmeasured, acceptance is taken for a coin toss per position and early rejections rank first; once full
    # acceptances are measured their branch ranks first and every step hits.
    assert hits[0] == {"a", "b"} and hits[-4:] == [{"a", "b"}] * 4
    for rid in ("a", "b"):
        assert world.tokens[rid] == [target(rid, i) for i in range(len(world.tokens[rid]))]
    record = core.stats.records()[-1]
    assert (record.num_branch_hits, record.num_branch_misses) == (2, 0)
    assert record.num_accepted_tokens == 2 * K and record.num_bonus_covered_after_full == 2
    # A full acceptance is the likeliest outcome once measured, and each branch item's tail is accepted drafts plus a
    # bonus candidate.
    items = source.sent[-1][1]
    assert all(i.tail for i in items) and len(items) <= 2 * DEFAULT_LOOKAHEAD_FANOUT


def test_a_branch_job_sent_as_the_step_is_planned_is_the_one_commit_would_send():
    jobs: dict[bool, list[list[tuple[str, tuple[int, ...], int]]]] = {}
    records = {}
    for early in (False, True):
        world = World()
        start(world, "a", "b")
        core, source = make(world)
        sent: list[list[tuple[str, tuple[int, ...], int]]] = []
        for number in range(6):
            if number:
                source.answer_branches(world)
            before = len(source.sent)
            decision = core.schedule([world.view(rid) for rid in ("a", "b")])
            if early:
                assert core.send_branches_early(decision) and len(source.sent) == before + 1, "sent at planning"
            core.commit(decision, ["a", "b"], {rid: list(p) for rid, p in decision.proposals.items()})
            assert len(source.sent) == before + 1, "one job a step: commit sends none after an early one"
            sent.append([(i.request_id, i.tail, i.num_draft_tokens) for i in source.sent[-1][1]])
            verify(core, world, decision, ["a", "b"])
        jobs[early] = sent
        records[early] = [(r.num_branches_drafted, r.lookahead_fanout, r.lookahead_depth, r.num_branch_hits)
                          for r in core.stats.records()]
        for rid in ("a", "b"):
            assert world.tokens[rid] == [target(rid, i) for i in range(len(world.tokens[rid]))]
    assert jobs[True] == jobs[False] and records[True] == records[False]
    assert records[True][-1][3] == 2, "both requests hit their branch"
    # Not for other modes: their jobs are the host's to send after the step.
    world = World()
    start(world, "a")
    core, _ = make(world)
    core.set_mode(Mode.SD)
    assert not core.send_branches_early(core.schedule([world.view("a")]))


def test_drafter_holds_count_committed_tokens_only():
    world = World()
    start(world, "a")
    core, source = make(world)
    step(core, world, ["a"])
    source.answer_branches(world)
    before = len(world.tokens["a"])
    step(core, world, ["a"])
    # The job sent at this step's launch carried the committed context as of the launch, never a tail.
    assert core.planner.drafter_holds["a"] == before
    items = source.sent[-1][1]
    assert items[0].base_num_tokens < items[0].num_tokens == before
    assert all(i.base_num_tokens == i.num_tokens == before for i in items[1:]), "later branches resend nothing"


def _miss(backups: bool):
    world = World(covered=False)
    start(world, "a", "b")
    # Unmeasured acceptance and a fan-out of 8: the branches hold both the full acceptance and early rejections.
    core, source = make(world, measured=False, lookahead_fanout=8, lookahead_backup_drafts=backups)
    step(core, world, ["a", "b"])
    source.answer_branches(world)
    step(core, world, ["a", "b"])  # both hit (root drafts), proposals verified
    # The drafter is wrong at a's next drafted position and the target's token is not among its candidates.
    position = len(world.tokens["a"])
    world.wrong |= {("a", position + i) for i in range(8)}
    source.answer_branches(world)
    missed = step(core, world, ["a", "b"])
    assert missed.plan.branches, "the step before verified branches"
    source.answer_branches(world)
    decision = step(core, world, ["a", "b"])
    assert "a" in decision.plan.branch_misses and "b" in decision.plan.branches, "b is not held back by a's miss"
    assert len(decision.proposals["a"]) == K, "padded to k"
    record = core.stats.records()[-1]
    assert record.num_branch_misses == 1 and record.num_branch_hits == 1
    return decision, source


def test_a_miss_without_backups_decodes_without_drafts_and_its_root_is_drafted_without_stalling_the_batch():
    decision, source = _miss(backups=False)
    assert decision.plan.drafted_lengths.get("a", 0) == 0 and "a" not in decision.plan.branches
    assert any(i.request_id == "a" and i.tail == () for i in source.sent[-1][1]), "a's root is drafted"


def test_a_miss_is_verified_with_the_likeliest_branch_of_its_accepted_length():
    decision, source = _miss(backups=True)
    assert decision.plan.backups == {"a"} and decision.plan.drafted_lengths["a"] == K
    backup, already = decision.plan.branches["a"]
    assert already == 0 and decision.proposals["a"] == backup.token_ids[:K]
    # Its next round is its root (drafted from its real context), not outcomes ranked by the backup's candidates.
    assert [i.tail for i in source.sent[-1][1] if i.request_id == "a"] == [()]


def test_a_rejection_is_a_hit_when_the_target_token_is_a_candidate():
    world = World(covered=True)
    start(world, "a")
    # Unmeasured (a coin toss per position), a fan-out of 8 holds both the full acceptance and early rejections.
    core, source = make(world, measured=False, lookahead_fanout=8)
    step(core, world, ["a"])
    source.answer_branches(world)
    step(core, world, ["a"])
    # The drafter is wrong at the second drafted position of the next branch; the target's token is its rank-1
    # candidate there, so the branch (d[:1], target token) exists and the step after takes it.
    position = len(world.tokens["a"]) + 1
    world.wrong.add(("a", position))
    source.answer_branches(world)
    rejected = step(core, world, ["a"])
    assert core.stats.records()[-1].num_accepted_tokens == 1
    tails = [i.tail for i in source.sent[-1][1]]
    committed = world.tokens["a"]
    assert tuple(committed[-2:]) in tails, "the real outcome was among the branches sent"
    source.answer_branches(world)
    after = step(core, world, ["a"])
    assert "a" in after.plan.branches and rejected.plan.branches
    assert core.stats.records()[-2].num_bonus_covered_after_reject == 1


def test_fanout_is_bounded_by_the_setting_and_by_measured_drafter_time():
    world = World()
    start(world, *"abcd")
    core, source = make(world, lookahead_fanout=2)
    rids = list("abcd")
    step(core, world, rids)
    source.answer_branches(world)
    step(core, world, rids)
    per_request: dict[str, int] = {}
    for item in source.sent[-1][1]:
        per_request[item.request_id] = per_request.get(item.request_id, 0) + 1
    assert max(per_request.values()) <= 2 and source.top_fs[-1] == 2
    assert core.stats.records()[-1].lookahead_fanout == 2
    # Jobs that cost 0.1 s per branch item against 0.05 s verifications: fewer branches pay (one per request).
    for _ in range(4):
        source.answer_branches(world, draft_seconds=0.1 * len(source.sent[-1][1]))
        step(core, world, rids)
    assert core.stats.records()[-1].lookahead_fanout == 1
    assert len(source.sent[-1][1]) == len(rids)


def test_the_shape_is_the_one_with_the_most_tokens_per_second_expected():
    stats = LookaheadStats()
    drafted = (11, 12, 13)
    candidates = ((11, 21, 31, 41), (12, 22, 32, 42), (13, 23, 33, 43), (14, 24, 34, 44))
    ranked = {rid: outcomes(rid, drafted, candidates, stats, 4) for rid in "ab"}
    assert choose_shape(ranked, stats, 4, K, 0.05) == (4, K), "nothing measured: the setting"
    stats.observe_job(0.01, (4, K))  # a job of fixed time, well inside a verification: every branch is free
    assert choose_shape(ranked, stats, 4, K, 0.05) == (4, K)
    stats = LookaheadStats()
    for fanout in range(1, 5):  # each branch costs a verification, whatever its depth
        for depth in range(1, K + 1):
            stats.observe_job(0.05 * fanout, (fanout, depth))
    assert choose_shape(ranked, stats, 4, K, 0.05) == (1, K)
    # Untried shapes are priced optimistically from the nearest measured one, so they get tried.
    stats = LookaheadStats()
    stats.observe_job(0.2, (4, K))
    assert choose_shape(ranked, stats, 4, K, 0.05) == (1, K), "one branch priced at a quarter of four"
    stats.observe_job(0.2, (1, K))  # measured: as dear as four (a fixed cost): wider or shallower ones look cheaper
    assert choose_shape(ranked, stats, 4, K, 0.05) != (1, K)
    for fanout in range(1, 5):
        for depth in range(1, K + 1):
            stats.observe_job(0.2, (fanout, depth))
    assert choose_shape(ranked, stats, 4, K, 0.05) == (4, K), "every shape costs the same: the widest, deepest"
    # Jobs that cost in proportion to their forwards (depth + 2) and outlast verifications: short branches pay.
    stats = LookaheadStats()
    for _ in range(30):
        stats.observe_acceptance(K, 1)  # the first draft is accepted, the rest rarely
    for fanout in range(1, 5):
        for depth in range(1, K + 1):
            stats.observe_job(0.05 * (depth + 2), (fanout, depth))
    assert choose_shape(ranked, stats, 4, K, 0.05)[1] < K


def test_branches_the_context_moved_past_are_dropped_and_forget_drops_the_rest():
    world = World()
    start(world, "a", "b")
    core, source = make(world)
    step(core, world, ["a", "b"])
    source.answer_branches(world)
    step(core, world, ["a", "b"])
    source.answer_branches(world)
    core.poll_drafter()
    round_before = list(core.planner.records["a"].branches)
    assert len(round_before) > 1
    # The step takes one branch; the others assumed outcomes that did not happen, and are dropped as it is planned.
    step(core, world, ["a", "b"])
    n = len(world.tokens["a"])
    assert all(b.context_num_tokens > n - K - 1 for b in core.planner.records["a"].branches)
    assert not any(b in round_before for b in core.planner.records["a"].branches)
    source.answer_branches(world)
    step(core, world, ["a", "b"], gone=["b"])
    assert "b" not in core.planner.records and "b" in source.forgotten
    # The job sent while b was still running answers for it too: nothing is stored for a request that finished.
    world.tokens["b"] = [0] * 100
    source.answer_branches(world)
    core.poll_drafter()
    assert "b" not in core.planner.records and core.planner.records["a"].branches


def test_unmeasured_shapes_are_priced_by_the_line_through_the_fresh_prices():
    stats = LookaheadStats()

    def cost(fanout: int, depth: int) -> float:  # a fixed part per forward and a part per branch row
        return (depth + 2) * (0.01 + 0.002 * fanout)

    stats.observe_job(cost(4, 3), (4, 3))
    assert stats.job_price_line() is None, "one fan-out: the split between the parts is unknown"
    stats.observe_job(cost(8, 3), (8, 3))
    per_forward, per_row = stats.job_price_line() or (0.0, 0.0)
    assert per_forward == pytest.approx(0.01) and per_row == pytest.approx(0.002)
    assert stats.job_seconds_at((6, 2)) == pytest.approx(cost(6, 2))
    # A price measured long ago (here: while the drafter was slow) gives way to the line through the fresh ones, so a
    # shape once dear is tried again.
    stats.observe_job(1.0, (2, 3))
    for _ in range(STALE_JOBS + 1):
        stats.observe_job(cost(4, 3), (4, 3))
        stats.observe_job(cost(8, 3), (8, 3))
    assert stats.job_seconds_at((2, 3)) == pytest.approx(cost(2, 3))


def test_a_branch_job_may_run_through_the_steps_host_work():
    stats = LookaheadStats()
    drafted = (11, 12, 13)
    candidates = ((11, 21, 31, 41), (12, 22, 32, 42), (13, 23, 33, 43), (14, 24, 34, 44))
    ranked = {rid: outcomes(rid, drafted, candidates, stats, 4) for rid in "ab"}
    for fanout in range(1, 5):
        stats.observe_job(0.05 + 0.004 * fanout, (fanout, K))  # wider jobs outlast a 0.05 s verification
    assert choose_shape(ranked, stats, 4, K, 0.05)[0] < 4
    stats.observe_step(0.065, host_seconds=0.015)  # ... not the verification plus the host work after it
    assert choose_shape(ranked, stats, 4, K, 0.05) == (4, K)


def test_a_prompt_finished_in_a_step_has_its_root_drafted_beside_it():
    world = World()
    start(world, "a", "p")
    core, source = make(world)
    step(core, world, ["a"])
    source.answer_branches(world)
    decision = core.schedule([world.view("a")])
    # p was admitted and prefilled whole by this step (the host says so: it was not among the planned views).
    finishing = [RequestState("p", 10, False, draft_room=100, pad_room=1000, last_token_id=0)]
    core.commit(decision, ["a", "p"], {rid: list(p) for rid, p in decision.proposals.items()}, finishing=finishing)
    roots = [(i.request_id, i.base_num_tokens, i.num_tokens, i.tail, i.num_draft_tokens) for i in source.sent[-1][1]
             if i.request_id != "a"]
    assert roots == [("p", 0, 10, (), K + 1)]


def test_a_job_shorter_than_k_keeps_its_depth_for_every_request_after_a_root():
    world = World()
    start(world, "a", "b", "c")
    core, _ = make(world)
    views = [world.view(rid) for rid in "abc"]
    tails = {"a": [()], "b": [(5,)], "c": [(6, 7)]}
    items = core.planner.lookahead_job(views, lambda rid: True, tails, depth=1)
    depths = {(i.request_id, i.tail): i.num_draft_tokens for i in items}
    # A root drafts one more (its first token guesses the token this step samples); the root before them must not
    # widen the branches after it to its own depth.
    assert depths == {("a", ()): 2, ("b", (5,)): 1, ("c", (6, 7)): 1}


def test_a_late_branch_job_is_abandoned_and_every_request_decodes_without_drafts():
    world = World()
    start(world, "a")
    core, source = make(world)
    step(core, world, ["a"])
    decision = step(core, world, ["a"])  # the root job never answered
    assert source.abandoned == [0] and decision.plan.branch_misses == {"a"} and not decision.proposals
    assert source.sent[-1][1][0].tail == (), "its root is drafted again"


def test_enumeration_ranks_outcomes_by_measured_acceptance_and_candidate_rank():
    stats = LookaheadStats()
    drafted = (11, 12, 13)
    candidates = ((11, 21, 31), (12, 22, 32), (13, 23, 33), (14, 24, 34))
    found = outcomes("r", drafted, candidates, stats, 4)
    # Unmeasured: acceptance 1/2 per position; the rejected draft token is never a bonus after a rejection.
    assert found[0].tail == (21,) and all(o.tail[-1] != drafted[len(o.tail) - 1] for o in found if
                                          len(o.tail) <= len(drafted))
    for _ in range(50):
        stats.observe_acceptance(3, 3)
    found = outcomes("x", drafted, candidates, stats, 4)
    assert found[0].tail == (11, 12, 13, 14), "full acceptance, then the drafter's top candidate"
    chosen = allot({"x": found, "y": outcomes("y", drafted, candidates, LookaheadStats(), 4)}, 5)
    assert len(chosen["x"]) >= 1 and len(chosen["y"]) >= 1 and sum(len(v) for v in chosen.values()) == 5
    assert bonus_rank(Verified(10, drafted, candidates), 2, [11, 22]) == (False, 0)
    assert bonus_rank(Verified(10, drafted, candidates), 4, [11, 12, 13, 24]) == (True, 1)


def test_match_is_exact_on_the_committed_tokens():
    committed = {"r": [1, 2, 3, 4, 5]}

    def read(rid: str, s: int, e: int) -> list[int]:
        return committed[rid][s:e]

    right = Draft(5, [6, 7], None, (4, 5))
    wrong = Draft(5, [6, 7], None, (9, 5))
    assert match([wrong, right], 5, "r", read) == (right, 0)
    assert match([wrong], 5, "r", read) is None
    root = Draft(4, [5, 6, 7], None, ())
    assert match([root], 5, "r", read) == (root, 1), "a root draft whose first token the target sampled too"
    assert match([Draft(4, [9, 6], None, ())], 5, "r", read) is None


def test_a_backup_is_a_branch_of_the_same_length_else_the_draft_that_reaches_furthest():
    from minedraft.engine.psd.planner import _backup

    root = Draft(10, [5, 6, 7, 8], None, ())
    same = Draft(12, [1, 2, 3], None, (4, 9))
    assert _backup([root, same], 12) == (same, 0)
    assert _backup([root], 12) == (root, 2), "read from the position the request reached"
    assert _backup([root], 14) is None, "nothing drafted past where it is"


def test_auto_turned_on_from_lookahead_starts_from_psd_and_lookahead_can_be_chosen_again():
    world = World()
    start(world, "a")
    core, _ = make(world)
    step(core, world, ["a"])
    core.set_mode(Mode.AUTO)
    assert core.chosen_mode is Mode.PSD and core.auto is not None
    core.set_mode(Mode.LOOKAHEAD, 3)
    assert core.chosen_mode is Mode.LOOKAHEAD and core.auto is None and core.subbatches.sizes()[1] == 0


@dataclass
class RefreshingSource(LookaheadSource):
    """Answers a job the moment the core waits for it (a refresh is sent and waited for inside schedule())."""

    world: World = field(default_factory=World)

    def wait_for(self, group: int, budget_seconds: float):  # type: ignore[no-untyped-def]
        if group in self.jobs:
            self.answer_branches(self.world)
        return super().wait_for(group, budget_seconds)


def test_a_lone_request_that_missed_is_drafted_from_its_real_context_and_verified_with_that_draft():
    world = World(covered=False)
    start(world, "a")
    source = RefreshingSource(world=world)
    settings = SchedulerSettings(mode=Mode.LOOKAHEAD, num_speculative_tokens=K, max_num_speculative_tokens=K,
                                 check_invariants=True, lookahead_refresh_misses=True)
    clock = iter(float(i) for i in range(10_000))
    core = SpeculationCore(settings, source, world.read, clock=lambda: next(clock))
    for _ in range(20):
        core.lookahead_stats.observe_acceptance(K, K)
    for _ in range(3):
        step(core, world, ["a"])
    assert core.lookahead_stats.step_seconds is not None
    # The drafter is wrong at a's next drafted positions and the target's token is never a candidate: a miss.
    position = len(world.tokens["a"])
    world.wrong |= {("a", position + i) for i in range(2)}
    step(core, world, ["a"])
    sent, before = len(source.sent), len(world.tokens["a"])
    decision = step(core, world, ["a"])
    assert decision.plan.branch_misses == {"a"} and decision.plan.refreshed == {"a"}
    assert "a" not in decision.plan.backups and decision.plan.drafted_lengths["a"] == K
    fresh = source.sent[sent][1]
    assert [(i.tail, i.num_draft_tokens) for i in fresh] == [((), K)], "a root of exactly k for the real context"
    assert decision.proposals["a"] == [world.guess("a", before + i)[0] for i in range(K)], "the fresh draft"
    record = core.stats.records()[-1]
    assert (record.num_branch_hits, record.num_branch_misses) == (0, 1)
    assert core.lookahead_stats.refresh_seconds is not None
    # Its next round is ranked from the refreshed draft's candidates, like a hit's.
    assert all(i.tail for i in source.sent[-1][1])
    assert world.tokens["a"] == [target("a", i) for i in range(len(world.tokens["a"]))]


def test_a_refresh_pays_where_misses_are_most_of_the_batch_and_drafting_is_short():
    stats = LookaheadStats()
    assert not refresh_pays(1, 1, stats, K), "no step measured yet"
    for _ in range(20):
        stats.observe_acceptance(K, K)
    stats.observe_step(0.004)
    assert refresh_pays(1, 1, stats, K), "unmeasured, a refresh is guessed at half a step: tried"
    stats.observe_refresh(0.003)
    assert refresh_pays(1, 1, stats, K)
    assert not refresh_pays(8, 1, stats, K), "one miss in eight does not hold up the other seven"
    assert refresh_pays(8, 8, stats, K)
    assert not refresh_pays(1, 0, stats, K)
    # Misses verified at once were measured to make 2.5 tokens (their backups mostly accepted): a refresh that paid
    # against one token does not against that.
    stats.observe_step(0.004)
    stats.refresh_seconds = 0.004
    assert refresh_pays(1, 1, stats, K)
    for _ in range(30):
        stats.observe_miss_tokens(5.0, 2)
    assert stats.miss_tokens == pytest.approx(2.5)
    assert not refresh_pays(1, 1, stats, K)
    stats.refresh_seconds = 0.05
    assert not refresh_pays(1, 1, stats, K), "a refresh dearer than the tokens it adds"
