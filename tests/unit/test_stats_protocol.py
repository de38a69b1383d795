from dataclasses import replace

import msgspec
import pytest

from minedraft.engine.control.stats import EngineTotals, StatsRecorder, StepRecord, summarize
from minedraft.engine.drafter import protocol


def record(step, drafted, accepted, wait, draft, per_pos_d=(), per_pos_a=()):
    return StepRecord(
        step=step, started_at=0.0, mode="psd", verified_group=step % 2, group_sizes=(2, 2),
        num_decode_requests=2, num_prefill_requests=0, num_requests_with_drafts=2 if drafted else 0,
        num_draft_tokens=drafted, num_accepted_tokens=accepted, drafted_per_position=per_pos_d,
        accepted_per_position=per_pos_a, num_output_tokens=accepted + 2, num_scheduled_tokens=drafted + 2,
        verify_seconds=0.03, wait_seconds=wait, draft_seconds=draft, drafter_idle_seconds=0.0,
        schedule_seconds=0.001, step_seconds=0.031 + wait, drafter_up=True, k=3,
    )


def test_overlap_is_the_share_of_drafting_hidden_behind_verification():
    assert EngineTotals(draft_seconds=2.0, wait_seconds=0.5).overlap_fraction == 0.75
    assert EngineTotals(draft_seconds=1.0, wait_seconds=1.2).overlap_fraction == 0.0
    assert EngineTotals().overlap_fraction == 0.0


def test_recorder_accumulates_acceptance_per_position():
    stats = StatsRecorder(history=3)
    stats.record(record(1, 6, 3, 0.0, 0.02, (2, 2, 2), (2, 1)))
    stats.record(record(2, 6, 6, 0.01, 0.02, (2, 2, 2), (2, 2, 2)))
    totals = stats.totals()
    assert totals.acceptance_rate == 9 / 12
    assert totals.drafted_per_position == [4, 4, 4]
    assert totals.accepted_per_position == [4, 3, 2]
    # 4 verifications that carried drafts produced 9 accepted + 4 bonus tokens.
    assert totals.mean_accepted_length == 1 + 9 / 4
    assert totals.overlap_fraction == 1 - 0.01 / 0.04
    for i in range(3, 6):
        stats.record(record(i, 0, 0, 0.0, 0.0))
    assert [r.step for r in stats.records()] == [3, 4, 5], "history is bounded"
    assert [r.step for r in stats.records(since_step=4)] == [5]


def test_summarize_matches_totals():
    records = [record(1, 6, 3, 0.0, 0.02, (2, 2, 2), (2, 1)), record(2, 6, 6, 0.02, 0.02, (2, 2, 2), (2, 2, 2))]
    summary = summarize(records)
    assert summary["acceptance_rate"] == 0.75
    assert summary["acceptance_per_position"] == [1.0, 0.75, 0.5]
    assert summary["overlap_fraction"] == 0.5


def test_protocol_round_trips_token_ids_only():
    job = protocol.DraftJob(7, [protocol.DraftItem("r1", [1, 2, 3], 4)], want_logprobs=True)
    data = protocol.encode(job)
    assert protocol.decode_to_drafter(data) == job
    assert len(data) < 64, "a job is token ids, not tensors"
    reply = protocol.DraftReply(7, [protocol.DraftResult("r1", 3, [4, 5], [-0.1, -0.2])], 0.01, 0.0, 0.006)
    decoded = protocol.decode_from_drafter(protocol.encode(reply))
    assert decoded == reply and isinstance(decoded, protocol.DraftReply) and decoded.first_token_seconds == 0.006
    assert isinstance(protocol.decode_to_drafter(protocol.encode(protocol.CancelRequests(["r1"]))),
                      protocol.CancelRequests)


def test_totals_difference_pools_counts_between_snapshots():
    stats = StatsRecorder(history=2)
    stats.record(record(1, 6, 3, 0.0, 0.02, (2, 2, 2), (2, 1)))
    before = stats.totals()
    stats.record(record(2, 6, 6, 0.01, 0.02, (2, 2, 2), (2, 2, 2)))
    stats.record(record(3, 3, 0, 0.02, 0.02, (3,), ()))
    stats.record(record(4, 0, 0, 0.0, 0.0))  # the ring buffer holds 2 records; totals still hold all
    window = stats.totals() - before
    assert window.steps == 3
    assert window.draft_tokens == 9 and window.accepted_tokens == 6
    assert window.accepted_per_position == [2, 2, 2]
    assert window.drafted_per_position == [5, 2, 2]
    summary = window.summary()
    assert summary["acceptance_rate"] == 6 / 9
    assert summary["overlap_fraction"] == pytest.approx(1 - 0.03 / 0.04)
    assert (before + window).draft_tokens == stats.totals().draft_tokens


def test_lookahead_fields_round_trip_and_old_messages_stay_valid():
    item = protocol.DraftItem("r1", [1, 2], 3, 10, tail=[7, 8], branch=2)
    job = protocol.DraftJob(9, [item, protocol.DraftItem("r1", [], 3, 12, tail=[9], branch=1)], top_f=4)
    assert protocol.decode_to_drafter(protocol.encode(job)) == job
    result = protocol.DraftResult("r1", 14, [4, 5], None, branch=2, tail=[7, 8], candidates=[[4, 6], [5, 1], [3, 2]])
    reply = protocol.DraftReply(9, [result], 0.01, 0.0)
    decoded = protocol.decode_from_drafter(protocol.encode(reply))
    assert isinstance(decoded, protocol.DraftReply) and decoded.results[0] == result
    # A message from a peer that predates lookahead (no tail, branch, top_f, candidates) decodes with the defaults.
    old_job = msgspec.msgpack.encode(["job", 3, [["r1", [1, 2], 3, 0]], False])
    decoded_job = protocol.decode_to_drafter(old_job)
    assert isinstance(decoded_job, protocol.DraftJob) and decoded_job.top_f == 0
    assert decoded_job.items[0].tail == [] and decoded_job.items[0].branch == 0
    old_reply = msgspec.msgpack.encode(["reply", 3, [["r1", 2, [4, 5], None]], 0.01, 0.0])
    decoded_reply = protocol.decode_from_drafter(old_reply)
    assert isinstance(decoded_reply, protocol.DraftReply)
    assert decoded_reply.results[0].candidates == [] and decoded_reply.results[0].tail == []


def test_branch_totals_pool_hits_and_misses():
    stats = StatsRecorder(history=4)
    base = record(1, 6, 3, 0.0, 0.02, (2, 2, 2), (2, 1))
    stats.record(replace(base, mode="lookahead", num_branches_drafted=5, num_branch_hits=1, num_branch_misses=1))
    stats.record(replace(base, step=2, mode="lookahead", num_branch_hits=2, num_bonus_after_full=2,
                         num_bonus_covered_after_full=1))
    totals = stats.totals()
    assert (totals.branch_hits, totals.branch_misses, totals.branches_drafted) == (3, 1, 5)
    assert totals.summary()["branch_hit_rate"] == 0.75
    assert (totals.bonus_after_full, totals.bonus_covered_after_full) == (2, 1)
