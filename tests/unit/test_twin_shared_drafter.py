"""The shared-drafter twin: N replicas drafting on one drafter GPU (batched rounds, queueing), and the drafter
window in the twin's costs. Small synthetic curves; no I/O."""

from __future__ import annotations

from typing import Any

import pytest

from minedraft.twin.costs import DRAFTER_SINK_TOKENS, AcceptanceModel, Hardware, StepCosts
from minedraft.twin.curves import parse_curves
from minedraft.twin.run import Workload, run_concurrency
from minedraft.twin.shared_drafter import SharedDrafter, run_shared

LONG = Workload(prompt_tokens=1000, output_tokens=1000, output_spread=0.2)
ACCEPTANCE = AcceptanceModel.constant(0.8)


def curves(verify_ms: float, draft_ms: float, draft_ms_per_request: float) -> dict[str, Any]:
    """A flat target forward (verify_ms) and a k=3 draft loop of draft_ms + draft_ms_per_request x batch; draft loops
    at 4096 context cost twice those at 1024."""
    forward = [{"batch": b, "context": 1024, "new_tokens": q, "ms": verify_ms}
               for b in (1, 4, 16, 64, 256) for q in (1, 4)]
    loops = [{"batch": b, "context": c, "k": k, "ms": (draft_ms + draft_ms_per_request * b) * (1 if c == 1024 else 2)}
             for b in (1, 4, 16, 64, 256) for c in (1024, 4096) for k in (3, 5)]
    return {"format": "minedraft-cost-curves/v1", "models": {
        "t": {"role": "target", "config": {"layers": 10}, "forward_ms": forward},
        "d": {"role": "drafter", "draft_loop_ms": loops}}}


def costs_of(data: dict[str, Any], **hardware: Any) -> StepCosts:
    return StepCosts.from_curves(parse_curves(data), "t", "d", Hardware(**hardware))


def test_one_replica_on_the_shared_drafter_is_the_replica_with_a_drafter_of_its_own() -> None:
    costs = costs_of(curves(verify_ms=20.0, draft_ms=6.0, draft_ms_per_request=0.05))
    own = run_concurrency(costs, ACCEPTANCE, "psd", 3, 16, LONG)
    shared = run_shared(costs, ACCEPTANCE, 3, 1, 16, LONG)
    assert shared.result.tokens_per_s == pytest.approx(own.tokens_per_s, rel=0.02)
    assert shared.result.gpus == own.gpus == 2


def test_a_flat_drafter_serves_several_replicas_in_batched_rounds_at_their_own_speed() -> None:
    # Drafting 6 ms, flat in batch, against 20 ms verifications: four replicas' jobs fit on one drafter.
    costs = costs_of(curves(verify_ms=20.0, draft_ms=6.0, draft_ms_per_request=0.0))
    one = run_shared(costs, ACCEPTANCE, 3, 1, 16, LONG)
    four = run_shared(costs, ACCEPTANCE, 3, 4, 16, LONG)
    assert four.result.tokens_per_s / 4 == pytest.approx(one.result.tokens_per_s, rel=0.05)
    assert four.result.gpus == 4 + 1
    assert four.result.tokens_per_s_per_gpu > 1.5 * one.result.tokens_per_s_per_gpu
    assert four.result.deadline_misses == 0
    # One round drafts a job of every replica (one per replica: each has one sub-batch's job in flight at a time).
    assert one.jobs_per_round == pytest.approx(1.0)
    assert four.jobs_per_round == pytest.approx(4.0, abs=0.3)


def test_jobs_of_several_replicas_queue_when_the_drafter_is_the_bottleneck() -> None:
    # Drafting grows with the batch and is as long as a verification: four replicas' jobs cannot all fit.
    costs = costs_of(curves(verify_ms=10.0, draft_ms=6.0, draft_ms_per_request=0.5))
    one = run_shared(costs, ACCEPTANCE, 3, 1, 16, LONG)
    four = run_shared(costs, ACCEPTANCE, 3, 4, 16, LONG)
    assert four.drafter_utilisation > 0.95
    assert four.result.tokens_per_s / 4 < 0.8 * one.result.tokens_per_s
    # The drafter's capacity: back-to-back rounds of the mean batch, each drafted request worth at most the expected
    # accepted length. Drafting rounds side by side (no queueing) would exceed it.
    batch = four.mean_round_batch
    capacity = batch * ACCEPTANCE.expected_accepted_length(3) / (costs.draft_ms(batch, 1000, 3) / 1000)
    assert four.result.tokens_per_s <= 1.02 * capacity


def test_a_job_arriving_while_the_drafter_is_busy_joins_the_next_round_at_the_total_batch() -> None:
    costs = costs_of(curves(verify_ms=20.0, draft_ms=6.0, draft_ms_per_request=0.5))
    drafter = SharedDrafter(costs)
    first = drafter.join(0.0, 4, 4 * 1024.0, 3)
    assert first.end == pytest.approx(costs.draft_ms(4, 1024, 3) / 1000)
    second = drafter.join(0.001, 4, 4 * 1024.0, 3)  # the drafter is busy: the next round, from when it is free
    third = drafter.join(0.002, 8, 8 * 1024.0, 3)  # that round has not started: drafted with it, in one loop
    assert second is third and second.start == pytest.approx(first.end)
    assert second.end - second.start == pytest.approx(costs.draft_ms(12, 1024, 3) / 1000)
    second.closed = True  # a replica received its reply: a later job queues behind it instead of lengthening it
    fourth = drafter.join(0.002, 1, 1024.0, 3)
    assert fourth is not second and fourth.start == pytest.approx(second.end)


def test_a_round_drafts_a_lone_jobs_extra_branches_and_drops_them_once_another_job_joins() -> None:
    costs = costs_of(curves(verify_ms=20.0, draft_ms=6.0, draft_ms_per_request=0.5))
    drafter = SharedDrafter(costs)
    drafter.join(0.0, 1, 1024.0, 3)  # busy until its end: the next jobs form the next round
    # A lookahead job of 4 requests x 3 branches; the extra 8 make 60% of its drafted tokens.
    lone = drafter.join(0.001, 12, 12 * 1024.0, 3, required=4, required_context_tokens=4 * 1024.0,
                        optional_share=0.6)
    assert lone.batch == 12 and lone.end - lone.start == pytest.approx(costs.draft_ms(12, 1024, 3) / 1000)
    assert drafter.optional_seconds == pytest.approx(0.6 * (lone.end - lone.start))
    joined = drafter.join(0.002, 4, 4 * 1024.0, 3)  # another replica's sd job: the round is shared now
    assert joined is lone and joined.shared and joined.batch == 4 + 4
    assert joined.end - joined.start == pytest.approx(costs.draft_ms(8, 1024, 3) / 1000)
    assert drafter.optional_seconds == pytest.approx(0.0)
    assert drafter.busy_seconds == pytest.approx(costs.draft_ms(1, 1024, 3) / 1000 + joined.end - joined.start)


def test_lookahead_replicas_share_a_drafter_their_extra_branches_yielding_to_each_others_jobs() -> None:
    # Drafting grows with the batch: one lookahead replica alone widens its branches into the drafter's spare time
    # (counted as optional: its required work is about sd's); two replicas' rounds are shared, and their extra
    # branches dropped, so their rounds stay near the size of their required work.
    costs = costs_of(curves(verify_ms=20.0, draft_ms=6.0, draft_ms_per_request=0.3))
    sd = run_shared(costs, ACCEPTANCE, 3, 1, 16, LONG, mode="sd")
    one = run_shared(costs, ACCEPTANCE, 3, 1, 16, LONG, mode="lookahead")
    assert one.optional_utilisation > 0.2 and one.drafter_utilisation > sd.drafter_utilisation
    assert one.drafter_utilisation - one.optional_utilisation < 1.5 * sd.drafter_utilisation
    assert one.mean_round_batch > 16 * 1.5  # branches as rows
    two = run_shared(costs, ACCEPTANCE, 3, 2, 16, LONG, mode="lookahead")
    assert two.jobs_per_round > 1.0
    assert two.mean_round_batch < one.mean_round_batch * two.jobs_per_round
    assert two.result.tokens_per_s > 1.5 * one.result.tokens_per_s


def test_the_window_caps_the_drafters_context_but_not_vllms_colocated_drafter() -> None:
    data = curves(verify_ms=20.0, draft_ms=6.0, draft_ms_per_request=0.0)
    plain = costs_of(data)
    windowed = costs_of(data, drafter_window_tokens=1020)
    assert plain.draft_ms(8, 4096, 3) == pytest.approx(2 * plain.draft_ms(8, 1024, 3))
    assert windowed.draft_ms(8, 4096, 3) == pytest.approx(plain.draft_ms(8, 1020 + DRAFTER_SINK_TOKENS, 3))
    assert windowed.draft_ms(8, 4096, 3, colocated=True) == pytest.approx(plain.draft_ms(8, 4096, 3, colocated=True))
    with pytest.raises(ValueError, match="drafter_window_tokens"):
        Hardware(drafter_window_tokens=-1)


def test_a_shared_drafter_refuses_modes_without_a_drafter() -> None:
    costs = costs_of(curves(verify_ms=20.0, draft_ms=6.0, draft_ms_per_request=0.0))
    with pytest.raises(ValueError, match="mode"):
        run_shared(costs, ACCEPTANCE, 3, 2, 4, LONG, mode="ar")


CHURN = Workload(prompt_tokens=2000, output_tokens=40, output_spread=0.2)


def test_shared_rounds_pay_their_jobs_catch_up_as_a_drafter_of_its_own_does() -> None:
    """Newcomers' prompts cost a shared drafter what they cost a drafter of its own: one replica on the shared
    drafter runs as the replica alone, with prompts priced (short outputs: a newcomer every few steps)."""
    data = curves(verify_ms=20.0, draft_ms=6.0, draft_ms_per_request=0.05)
    data["models"]["d"]["catch_up_ms_per_token"] = 0.01  # a 2000-token prompt: 20 ms, three draft loops
    priced = costs_of(data)
    own = run_concurrency(priced, ACCEPTANCE, "psd", 3, 16, CHURN)
    shared = run_shared(priced, ACCEPTANCE, 3, 1, 16, CHURN)
    assert shared.result.tokens_per_s == pytest.approx(own.tokens_per_s, rel=0.03)
    # (The price matters here: free prompts would make both faster.)
    free = run_concurrency(costs_of(curves(verify_ms=20.0, draft_ms=6.0, draft_ms_per_request=0.05)), ACCEPTANCE,
                           "psd", 3, 16, CHURN)
    assert free.tokens_per_s > 1.1 * own.tokens_per_s


def test_a_round_pays_each_jobs_catch_up_bounded_by_the_window() -> None:
    from minedraft.engine.drafter import protocol
    from minedraft.twin.replica import SimClock
    from minedraft.twin.shared_drafter import SharedDrafterClient

    data = curves(verify_ms=20.0, draft_ms=6.0, draft_ms_per_request=0.0)
    data["models"]["d"]["catch_up_ms_per_token"] = 0.01
    newcomer = protocol.DraftItem("new", list(range(3001)), 3)  # a whole prompt: 3000 tokens to take in
    running = protocol.DraftItem("old", [1, 2, 3], 3, base_num_tokens=500)  # two accepted tokens since its last job
    for window, taken in ((0, 3000 + 2), (256, 256 + DRAFTER_SINK_TOKENS + 2)):
        costs = costs_of(data, drafter_window_tokens=window)
        drafter = SharedDrafter(costs)
        client = SharedDrafterClient(SimClock(), costs, drafter)
        client.submit([newcomer, running], want_logprobs=False)
        round_ = drafter.rounds[-1]
        context = (3001 + 503) / 2
        assert round_.end - round_.start == pytest.approx((costs.draft_ms(2, context, 3) + 0.01 * taken) / 1000)
