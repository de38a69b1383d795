"""Adaptive draft lengths (psd/verify_budget.py): per-request lengths from acceptance, the per-step verify budget at
the verify curve's knee, the draft depth where drafts are made in series; and the planner applying them."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from minedraft.engine.psd.planner import Draft, PSDPlanner, RequestState
from minedraft.engine.psd.verify_budget import AcceptanceBelief, DraftLengthPolicy
from minedraft.engine.settings import Mode


def believed(policy: DraftLengthPolicy, accepted_each: int, drafted_each: int, times: int) -> AcceptanceBelief:
    belief = AcceptanceBelief()
    for _ in range(times):
        policy.observe(belief, drafted_each, accepted_each)
    return belief


def linear(base_seconds: float, per_token_seconds: float) -> Callable[[int, float], float]:
    return lambda requests, tokens: base_seconds + per_token_seconds * tokens


def test_a_request_whose_drafts_are_rejected_drafts_nothing_and_one_that_accepts_drafts_k():
    policy = DraftLengthPolicy(k_max=4, threshold=0.3)
    rejected = believed(policy, 0, 4, 20)
    accepted = believed(policy, 4, 4, 20)
    assert policy.rate(rejected) < 0.3 < 0.9 < policy.rate(accepted)
    assert policy.draft_length(rejected, room=4) == 0
    assert policy.draft_length(accepted, room=4) == 4
    assert policy.draft_length(accepted, room=2) == 2  # never past its room


def test_a_newcomer_starts_from_the_batch_rate_and_evidence_fades_while_it_is_not_drafted():
    policy = DraftLengthPolicy(k_max=4)
    believed(policy, 1, 4, 50)  # the batch: one of four accepted, then a rejection
    assert policy.rate(None) == pytest.approx(0.5, abs=0.02)
    belief = believed(policy, 0, 4, 10)
    low = policy.rate(belief)
    for _ in range(30):
        policy.observe(belief, 0, 0)  # decoded without drafts
    assert low < policy.rate(belief) == pytest.approx(policy.rate(None), abs=0.05)


def test_free_verification_keeps_every_drafted_position():
    policy = DraftLengthPolicy(k_max=3, verify_seconds=lambda requests, tokens: 0.02, probe_every=0)
    drafts = {"a": (3, believed(policy, 0, 3, 10)), "b": (2, None)}
    assert policy.budget(drafts, num_requests=3) == {"a": 3, "b": 2}
    assert policy.threshold == 0.0


def test_costly_verification_keeps_only_the_likely_positions_as_prefixes():
    policy = DraftLengthPolicy(k_max=4, verify_seconds=linear(0.01, 0.002), probe_every=0)
    good = believed(policy, 4, 4, 30)
    poor = believed(policy, 0, 4, 30)
    lengths = policy.budget({"good": (4, good), "poor": (4, poor)}, num_requests=2)
    assert lengths["good"] > lengths["poor"] == 0
    # The threshold is the step's tokens per second times the marginal verify seconds per token.
    assert policy.threshold == pytest.approx(policy.tokens_per_second * 0.002)
    assert policy.rate(poor) < policy.threshold < policy.rate(good)


def test_verification_too_dear_for_any_draft_is_plain_decoding():
    policy = DraftLengthPolicy(k_max=3, verify_seconds=linear(0.001, 1.0), probe_every=0)
    lengths = policy.budget({"a": (3, None), "b": (3, None)}, num_requests=2)
    assert lengths == {"a": 0, "b": 0}


def test_without_a_measured_verify_curve_every_draft_is_kept():
    policy = DraftLengthPolicy(k_max=3, threshold=0.5)
    assert policy.budget({"a": (3, None)}, num_requests=1) == {"a": 3}
    assert policy.threshold == 0.0


def test_probes_verify_fewer_positions_only_in_steps_without_prompts():
    policy = DraftLengthPolicy(k_max=2, verify_seconds=lambda requests, tokens: 0.02, early_probe_every=2,
                               early_probes=1, probe_every=100)
    drafts = {f"r{i}": (2, None) for i in range(10)}
    totals = [sum(policy.budget(drafts, 10, may_probe=False).values()) for _ in range(4)]
    assert totals == [20] * 4
    assert sum(policy.budget(drafts, 10, may_probe=True).values()) == 14


def test_drafting_in_series_stops_at_the_depth_whose_drafter_time_is_not_worth_it():
    policy = DraftLengthPolicy(k_max=4, verify_seconds=lambda requests, tokens: 0.02,
                               draft_seconds=lambda requests, depth: 0.004 * depth, probe_every=0)
    beliefs = {"a": None, "b": None}
    policy.budget({"a": (4, None), "b": (4, None)}, num_requests=2)
    assert policy.draft_depth({"a": 4, "b": 4}, beliefs) == 4  # not in series: the drafter works beside
    policy.drafts_in_series = True
    policy.budget({"a": (4, None), "b": (4, None)}, num_requests=2)
    depth = policy.draft_depth({"a": 4, "b": 4}, beliefs)
    assert 0 < depth < 4


def view(rid: str, num_tokens: int) -> RequestState:
    return RequestState(rid, num_tokens, True, draft_room=100, pad_room=100, last_token_id=7)


def test_the_planner_verifies_the_budget_unpadded_and_drafts_each_request_its_own_length():
    policy = DraftLengthPolicy(k_max=3, verify_seconds=linear(0.01, 0.002), probe_every=0)
    planner = PSDPlanner(k=3, draft_lengths=policy)
    requests = [view("good", 10), view("poor", 10)]
    planner.after_step(requests, Mode.SD, None, Mode.SD)
    for _ in range(30):
        policy.observe(planner.record("good").acceptance, 3, 3)
        policy.observe(planner.record("poor").acceptance, 3, 0)
    planner.store_drafts([(rid, Draft(10, [1, 2, 3], None)) for rid in ("good", "poor")], lambda rid: True)
    plan = planner.plan(requests, Mode.SD, 0)
    assert plan.proposals["good"] == [1, 2, 3] and "poor" not in plan.proposals  # no padding to k
    items = {item.request_id: item for item in planner.draft_job([view("good", 14), view("poor", 11)], 0)}
    assert items["good"].num_draft_tokens == 3 and "poor" not in items
    # Any subset of a draft is a valid proposal: what the planner verifies is a prefix of what was drafted.
    planner.observe_acceptance("poor", 0, 0)
    assert planner.record("poor").acceptance.accepted == 0.0


def test_the_padding_helper_pads_fixed_steps_to_k():
    planner = PSDPlanner(k=3)
    requests = [view("a", 10), view("b", 10)]
    planner.after_step(requests, Mode.SD, None, Mode.SD)
    planner.store_drafts([("a", Draft(10, [1], None))], lambda rid: True)
    plan = planner.plan(requests, Mode.SD, 0)
    assert plan.proposals == {"a": [1, 1, 1], "b": [7, 7, 7]}
    assert plan.drafted_lengths == {"a": 1, "b": 0}


def test_a_request_left_undrafted_is_drafted_one_token_again_even_after_its_batch_rejected_everything():
    policy = DraftLengthPolicy(k_max=3, threshold=0.5)
    belief = believed(policy, 0, 3, 5)  # the only request: the batch's rate fell with it
    assert policy.draft_length(belief, room=3) == 0
    for _ in range(policy.explore_after_steps):
        policy.observe(belief, 0, 0)
    assert policy.draft_length(belief, room=3) == 1
    policy.observe(belief, 1, 1)
    assert belief.undrafted_steps == 0


def test_an_explored_token_is_verified_even_where_the_budget_would_cut_it():
    """After a phase of rejected drafts the batch's rate is low and verification dear: the budget alone would cut
    every position, so the one token drafted to measure a request again must be verified, or no evidence ever
    arrives and the batch stays at plain decoding after its acceptance recovers."""
    policy = DraftLengthPolicy(k_max=3, verify_seconds=linear(0.01, 0.0005), probe_every=0)
    beliefs = {f"r{i}": AcceptanceBelief() for i in range(8)}
    for _ in range(30):
        for belief in beliefs.values():
            policy.observe(belief, 3, 0)
    low = policy.batch_rate()
    verified = 0
    for _ in range(4 * policy.explore_after_steps):
        lengths = {rid: policy.draft_length(belief, room=3) for rid, belief in beliefs.items()}
        drafted = {rid: (n, beliefs[rid]) for rid, n in lengths.items() if n}
        kept = policy.budget(drafted, num_requests=len(beliefs)) if drafted else {}
        for rid, belief in beliefs.items():
            policy.observe(belief, kept.get(rid, 0), kept.get(rid, 0))  # acceptance has recovered: all accepted
            verified += kept.get(rid, 0)
    assert verified > 0 and policy.batch_rate() > low


def test_a_step_scheduled_while_another_is_in_flight_may_still_probe():
    """Async psd steps: the requests of the step in flight are not decoding in the views (their tokens are not in),
    but they take in no prompt in this step: its verify time is a decode-only step's, so it may probe."""
    policy = DraftLengthPolicy(k_max=2, verify_seconds=lambda requests, tokens: 0.02, early_probe_every=1,
                               early_probes=1, probe_every=100)
    planner = PSDPlanner(k=2, draft_lengths=policy)
    ids = [f"r{i}" for i in range(10)]
    requests = [view(rid, 10) for rid in ids]
    planner.after_step(requests, Mode.SD, None, Mode.SD)
    planner.store_drafts([(rid, Draft(10, [1, 2], None)) for rid in ids], lambda rid: True)
    in_flight = RequestState("other", 10, False, draft_room=100, pad_room=100, last_token_id=7)
    plan = planner.plan([*requests, in_flight], Mode.SD, 0, busy=frozenset({"other"}))
    assert sum(len(p) for p in plan.proposals.values()) == 14  # 70% of the 20 drafted positions: a probe


def test_a_job_in_series_still_drafts_the_token_that_explores_a_request():
    """sd prices the job's depth: after a phase of rejected drafts depth 1 is not worth its drafter seconds, but the
    one token drafted to measure a request again must be drafted, or the batch never drafts again."""
    policy = DraftLengthPolicy(k_max=3, verify_seconds=linear(0.01, 0.0005), draft_seconds=lambda r, d: 0.004 * d,
                               probe_every=0, drafts_in_series=True)
    beliefs = {f"r{i}": AcceptanceBelief() for i in range(8)}
    for _ in range(30):
        for belief in beliefs.values():
            policy.observe(belief, 3, 0)
    policy.budget({rid: (3, belief) for rid, belief in beliefs.items()}, num_requests=8)
    assert policy.draft_depth(dict.fromkeys(beliefs, 1), dict(beliefs)) == 0  # not explored yet: not worth it
    for _ in range(policy.explore_after_steps):
        for belief in beliefs.values():
            policy.observe(belief, 0, 0)
    lengths = {rid: policy.draft_length(belief, room=3) for rid, belief in beliefs.items()}
    assert set(lengths.values()) == {1}
    assert policy.draft_depth(lengths, dict(beliefs)) == 1
