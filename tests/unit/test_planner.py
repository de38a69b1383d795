"""The PSD planner without vLLM: which requests run, with which proposals, what the drafter is sent."""

import itertools
from collections.abc import Sequence

import pytest

from minedraft.engine.psd.inflight import JobInFlight
from minedraft.engine.psd.planner import (
    QUARANTINE_AFTER_FAILED_JOBS,
    Draft,
    JobItemPlan,
    PlannedStep,
    PSDPlanner,
    RequestState,
    WaitPolicy,
)
from minedraft.engine.settings import Mode


def req(rid: str, num_tokens: int = 10, decoding: bool = True, room: int = 50, last: int = 7) -> RequestState:
    return RequestState(rid, num_tokens, decoding, draft_room=room, pad_room=room + 100, last_token_id=last)


def planner_with(groups: dict[str, int], k: int = 3) -> PSDPlanner:
    planner = PSDPlanner(k=k)
    for rid, group in groups.items():
        planner.subbatches.groups[group][rid] = None
        planner.record(rid)
    return planner


JOB_IDS = itertools.count(1)


def give_drafts(planner: PSDPlanner, drafts: dict[str, Draft]) -> None:
    """Exactly these drafts held (as replies would have left them)."""
    for rid, record in planner.records.items():
        record.draft = drafts.get(rid)
    for rid, draft in drafts.items():
        planner.record(rid).draft = draft


def coming(planner: PSDPlanner, group: int, drafted: set[str]) -> None:
    """A job in flight for `group` drafting `drafted` (the drafter link's write, here by hand)."""
    planner.in_flight.add(JobInFlight(group, 100 + group, frozenset(drafted), frozenset(drafted), 0.0))


def sent(planner: PSDPlanner, group: int, items: Sequence[JobItemPlan]) -> None:
    """What the engine does when the drafter takes a job: the link records it in flight, the planner what it holds."""
    planner.in_flight.add(JobInFlight(group, next(JOB_IDS), frozenset(i.request_id for i in items),
                                   frozenset(i.request_id for i in items if i.num_draft_tokens > 0), 0.0))
    planner.job_sent(items)


def answered(planner: PSDPlanner, group: int) -> JobInFlight | None:
    """The drafter answered `group`'s job: the link takes it out of flight and hands it to the handler."""
    job = planner.in_flight.get(group)
    return planner.in_flight.complete(job.job_id) if job is not None else None


def test_only_the_verified_side_carries_drafts_and_only_requests_with_drafts_coming_sit_out():
    planner = planner_with({"a": 0, "b": 0, "c": 1, "d": 1})
    requests = [req("a"), req("b"), req("c"), req("d")]
    give_drafts(planner, {"a": Draft(10, [1, 2, 3], None), "b": Draft(10, [4, 5, 6], None)})
    coming(planner, 1, {"c"})  # d: the drafter was not asked (say its last token)
    plan = planner.plan(requests, Mode.PSD, 0)
    assert plan.held_out == {"c"}
    assert plan.proposals["a"] == [1, 2, 3] and plan.proposals["b"] == [4, 5, 6]
    # d runs now instead of sitting out a step for nothing; padded to k like every request in the step.
    assert plan.drafted_lengths["d"] == 0 and plan.proposals["d"] == [7, 7, 7]


def test_a_draft_is_used_only_for_exactly_the_context_it_was_made_from():
    planner = planner_with({"a": 0, "b": 0})
    give_drafts(planner, {"a": Draft(9, [1, 2, 3], None), "b": Draft(10, [4, 5, 6], None)})
    plan = planner.plan([req("a", 10), req("b", 10)], Mode.PSD, 0, pad=False)
    assert "a" not in plan.proposals, "a stale draft (made from 9 tokens) was verified"
    assert plan.proposals == {"b": [4, 5, 6]}


def test_other_side_requests_holding_drafts_wait_for_their_turn():
    planner = planner_with({"a": 0, "c": 1})
    give_drafts(planner, {"c": Draft(10, [1, 2, 3], None)})
    plan = planner.plan([req("a"), req("c")], Mode.PSD, 0)
    assert plan.held_out == {"c"}


def test_padding_gives_every_decoding_request_exactly_k_in_fixed_modes_only():
    planner = planner_with({"a": 0, "b": 0, "n": 0})
    give_drafts(planner, {"a": Draft(10, [1, 2, 3], None), "b": Draft(10, [4], None)})
    requests = [req("a"), req("b"), req("n"), req("p", decoding=False)]
    plan = planner.plan(requests, Mode.PSD, 0)
    assert plan.proposals == {"a": [1, 2, 3], "b": [4, 4, 4], "n": [7, 7, 7]}
    assert plan.drafted_lengths == {"a": 3, "b": 1, "n": 0}
    assert plan.num_drafted_tokens == 4
    # Auto varies k anyway: no padding there; nor without any draft in the step (a plain step is uniform too).
    assert planner.plan(requests, Mode.PSD, 0, pad=False).proposals == {"a": [1, 2, 3], "b": [4]}
    give_drafts(planner, {})
    assert planner.plan(requests, Mode.PSD, 0).proposals == {}


def test_padding_stops_at_the_context_limit():
    planner = planner_with({"a": 0, "b": 0})
    give_drafts(planner, {"a": Draft(10, [1, 2, 3], None)})
    tight = RequestState("b", 10, True, draft_room=0, pad_room=1, last_token_id=5)
    plan = planner.plan([req("a"), tight], Mode.PSD, 0)
    assert plan.proposals["b"] == [5]


def test_drafts_are_cut_to_the_output_budget():
    planner = planner_with({"a": 0})
    planner.pad_to_k = False
    give_drafts(planner, {"a": Draft(10, [1, 2, 3], None)})
    assert planner.plan([req("a", room=1)], Mode.PSD, 0).proposals == {"a": [1]}


def test_ar_plans_nothing_and_holds_nothing():
    planner = planner_with({"a": 0, "c": 1})
    coming(planner, 1, {"c"})
    assert planner.plan([req("a"), req("c")], Mode.AR, None) == PlannedStep(Mode.AR, None, {}, {}, frozenset())


def test_one_empty_side_falls_back_to_the_other_instead_of_stalling():
    planner = planner_with({"a": 1, "b": 1})
    assert planner.pick_group([req("a"), req("b")], Mode.PSD) == 1
    assert planner.pick_group([req("a")], Mode.SD) == 0


def test_after_step_admits_newcomers_rebalances_and_passes_the_turn():
    planner = planner_with({"a": 0, "b": 0, "c": 0, "d": 1})
    planner.after_step([req("a"), req("b"), req("c"), req("d"), req("e")], Mode.PSD, 0, Mode.PSD)
    assert sorted(planner.subbatches.sizes()) == [2, 3]
    assert planner.turn == 1
    planner.check_invariants([req(r) for r in "abcde"], set("abcde"), Mode.PSD)


def test_draft_jobs_send_deltas_and_whole_contexts_after_a_restart():
    planner = planner_with({"a": 0, "b": 0})
    requests = [req("a", 100), req("b", 40)]
    first = planner.draft_job(requests, 0)
    assert first == [JobItemPlan("a", 0, 100, 3), JobItemPlan("b", 0, 40, 3)]
    sent(planner, 0, first)
    assert planner.draft_job(requests, 0) == [], "one job in flight per sub-batch"
    answered(planner, 0)
    later = planner.draft_job([req("a", 103), req("b", 41)], 0)
    assert [(i.base_num_tokens, i.num_tokens) for i in later] == [(100, 103), (40, 41)]
    sent(planner, 0, later)
    answered(planner, 0)
    planner.need_full_context(["b"])
    assert [i.base_num_tokens for i in planner.draft_job([req("a", 104), req("b", 42)], 0)] == [103, 0]
    sent(planner, 0, planner.draft_job([req("a", 104), req("b", 42)], 0))
    planner.in_flight.drop_all()  # the link, on finding a new drafter process
    planner.drafter_restarted()
    assert not planner.in_flight
    assert [i.base_num_tokens for i in planner.draft_job([req("a", 104), req("b", 42)], 0)] == [0, 0]


def test_draft_jobs_skip_requests_with_valid_drafts_no_room_or_in_quarantine():
    planner = planner_with({"a": 0, "b": 0, "c": 0, "d": 1})
    give_drafts(planner, {"a": Draft(10, [1], None)})
    planner.record("c").quarantined = True
    items = planner.draft_job([req("a"), req("b", room=0), req("c"), req("d"), req("e")], 0)
    assert items == []
    assert [i.num_draft_tokens for i in planner.draft_job([req("b", room=2)], 0)] == [2]


def test_finished_requests_are_forgotten_everywhere_and_named_for_the_drafter():
    planner = planner_with({"a": 0, "b": 1})
    give_drafts(planner, {"a": Draft(10, [1], None)})
    sent(planner, 0, [JobItemPlan("a", 0, 10, 3)])
    assert planner.forget(["a", "b"]) == ["a"]
    assert planner.drafts == {} and planner.drafter_holds == {} and planner.subbatches.sizes() == (0, 0)
    assert planner.records == {}, "one record per request, dropped whole"
    with pytest.raises(AssertionError, match="finished"):
        planner.record("zombie").drafter_holds = 5
        planner.check_invariants([], set(), Mode.PSD)


def test_a_named_culprit_is_quarantined_at_once_and_the_rest_keep_drafting():
    planner = planner_with({"a": 0, "b": 0})
    sent(planner, 0, [JobItemPlan("a", 0, 10, 3), JobItemPlan("b", 0, 10, 3)])
    assert planner.job_failed(answered(planner, 0), ["b"]) == ["b"]
    assert [i.request_id for i in planner.draft_job([req("a"), req("b")], 0)] == ["a"]
    give_drafts(planner, {"b": Draft(10, [1, 2, 3], None)})
    assert "b" not in planner.plan([req("b")], Mode.PSD, 0, pad=False).proposals


def test_unattributed_failures_quarantine_a_request_after_repeated_failed_jobs():
    planner = planner_with({"a": 0})
    for attempt in range(QUARANTINE_AFTER_FAILED_JOBS):
        assert planner.quarantined == set()
        sent(planner, 0, planner.draft_job([req("a", 10 + attempt)], 0))
        newly = planner.job_failed(answered(planner, 0), [])
    assert newly == ["a"] and planner.draft_job([req("a", 20)], 0) == []
    # A success in between resets the count.
    other = planner_with({"b": 0})
    for _ in range(QUARANTINE_AFTER_FAILED_JOBS - 1):
        sent(other, 0, other.draft_job([req("b")], 0))
        other.job_failed(answered(other, 0), [])
    other.store_drafts([("b", Draft(10, [1], None))], lambda rid: True)
    sent(other, 0, [JobItemPlan("b", 10, 11, 3)])
    assert other.job_failed(answered(other, 0), []) == []


def test_drafts_of_finished_requests_are_not_stored():
    planner = PSDPlanner(k=3)
    planner.store_drafts([("gone", Draft(3, [1], None)), ("live", Draft(3, [2], None))], lambda rid: rid == "live")
    assert set(planner.drafts) == {"live"}


def test_check_step_catches_a_held_out_request_run_and_a_stale_draft_verified():
    planner = planner_with({"a": 0, "c": 1})
    give_drafts(planner, {"a": Draft(10, [1, 2, 3], None)})
    coming(planner, 1, {"c"})
    requests = [req("a"), req("c")]
    plan = planner.plan(requests, Mode.PSD, 0)
    planner.check_step(plan, requests, {"a": [1, 2, 3]})
    planner.check_step(plan, requests, {"a": [1, 2]})  # vLLM may trim at the context limit
    planner.check_step(plan, requests, {"a": [1, 2, 3], "resumed": [-1, -1, -1]})  # vLLM's own padding
    with pytest.raises(AssertionError, match="held out"):
        planner.check_step(plan, requests, {"a": [1, 2, 3], "c": [9]})
    with pytest.raises(AssertionError, match="planned"):
        planner.check_step(plan, requests, {"a": [1, 9, 3]})
    # The draft was replaced by one for another context after planning: what ran was not made from this context.
    planner.record("a").draft = Draft(11, [1, 2, 3], None)
    with pytest.raises(AssertionError, match="committed context"):
        planner.check_step(plan, requests, {"a": [1, 2, 3]})


def test_wait_budget_is_a_fraction_of_the_measured_step_not_the_configured_cap():
    policy = WaitPolicy(cap_seconds=5.0, slack=1.5, floor_seconds=0.002)
    assert policy.budget_seconds() == 5.0, "before anything is measured (first jobs carry whole prompts)"
    for _ in range(50):
        policy.observe_verify(0.020)
    assert policy.budget_seconds() == pytest.approx(0.030)
    for _ in range(50):
        policy.observe_draft(0.040)
    assert policy.budget_seconds() == pytest.approx(0.060), "a drafter slower than verification sets the pace"
    for _ in range(200):
        policy.observe_verify(0.0)
        policy.observe_draft(0.0)
    assert policy.budget_seconds() == pytest.approx(0.002, abs=1e-4)
    policy.observe_verify(100.0)
    assert policy.budget_seconds() == 5.0


def test_a_request_past_the_drafters_length_is_not_sent_and_decodes_in_every_step():
    # The drafter can hold 100 tokens: "long" (100) would be skipped there yet held out of every other step for drafts
    # that never come. It is not sent, so nothing is coming for it and it runs in the other side's steps too.
    planner = planner_with({"short": 0, "long": 0, "other": 1})
    planner.drafter_max_tokens = 100
    requests = [req("short", 40), req("long", 100), req("other", 40)]
    items = planner.draft_job(requests, 0)
    assert [i.request_id for i in items] == ["short"]
    sent(planner, 0, items)
    plan = planner.plan(requests, Mode.PSD, 1, pad=False)
    assert plan.held_out == frozenset({"short"}) and "long" not in plan.held_out
    # Near the limit the draft is cut to fit: 98 tokens leave room for 2.
    assert [i.num_draft_tokens for i in planner_with({"x": 0}, k=3).draft_job([req("x", 98)], 0)] == [3]
    near = planner_with({"x": 0})
    near.drafter_max_tokens = 100
    assert [i.num_draft_tokens for i in near.draft_job([req("x", 98)], 0)] == [2]


def test_a_long_catch_up_goes_in_bounded_chunks_and_delays_no_one():
    planner = planner_with({"old": 0, "new": 0})
    planner.catch_up_tokens_per_job = 64
    planner.record("old").drafter_holds = 10
    requests = [req("old", 12), req("new", 150, room=500)]
    first = planner.draft_job(requests, 0)
    # "old" gets its usual delta and its drafts; "new" sends 64 of its 150 prompt tokens and drafts nothing.
    assert first == [JobItemPlan("old", 10, 12, 3), JobItemPlan("new", 0, 64, 0)]
    sent(planner, 0, first)
    assert planner.in_flight.coming(0) == frozenset({"old"}), "only drafted requests are coming"
    # Nothing coming for "new": it decodes in the other side's step instead of sitting out.
    assert planner.plan(requests, Mode.PSD, 1, pad=False).held_out == frozenset({"old"})
    answered(planner, 0)
    second = planner.draft_job([req("old", 14), req("new", 151, room=500)], 0)
    assert second == [JobItemPlan("old", 12, 14, 3), JobItemPlan("new", 64, 128, 0)]
    sent(planner, 0, second)
    answered(planner, 0)
    third = planner.draft_job([req("old", 16), req("new", 152, room=500)], 0)
    assert third == [JobItemPlan("old", 14, 16, 3), JobItemPlan("new", 128, 152, 3)], "caught up: drafted again"


def test_the_context_a_drafter_keeps_hanging_on_is_quarantined_not_resent_forever():
    planner = planner_with({"a": 0, "b": 0})
    num_tokens = {"a": 40, "b": 4000}
    assert planner.job_hung(frozenset({"a", "b"}), num_tokens) == []
    assert planner.job_hung(frozenset({"a", "b"}), num_tokens) == ["b"], "the longest context, at its second hang"
    assert planner.quarantined == {"b"} and planner.records["a"].hangs == 0
    assert [i.request_id for i in planner.draft_job([req("a", 40), req("b", 4000)], 0)] == ["a"]


def test_a_job_that_blames_every_request_it_carried_blames_the_drafter():
    planner = planner_with({"a": 0, "b": 0})
    sent(planner, 0, [JobItemPlan("a", 0, 10, 3), JobItemPlan("b", 0, 10, 3)])
    assert planner.blames_the_drafter(planner.in_flight.get(0), ["a", "b"])
    assert not planner.blames_the_drafter(planner.in_flight.get(0), ["b"])
    planner.drafter_failed(answered(planner, 0))
    assert planner.quarantined == set() and 0 not in planner.in_flight and planner.drafter_holds == {}
    lone = planner_with({"a": 0})
    sent(lone, 0, [JobItemPlan("a", 0, 10, 3)])
    lone_job = lone.in_flight.get(0)
    assert not lone.blames_the_drafter(lone_job, ["a"]), "one request alone may be poison (the probe tells)"


def test_a_burst_of_newcomers_goes_whole_and_only_each_prompt_is_bounded():
    # Nobody in the sub-batch is drafting yet (arrivals together, or a restarted drafter): no one's drafts can be
    # delayed, so each newcomer's prompt goes whole, and only a prompt longer than the bound is chunked.
    planner = planner_with({"a": 0, "b": 0, "c": 0})
    planner.catch_up_tokens_per_job = 512
    items = planner.draft_job([req("a", 500, room=900), req("b", 500, room=900), req("c", 800, room=900)], 0)
    assert items == [JobItemPlan("a", 0, 500, 3), JobItemPlan("b", 0, 500, 3), JobItemPlan("c", 0, 512, 0)]
