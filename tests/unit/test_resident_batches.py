"""The choice of persistent batch per step (pure: request ids in, batch index and evictions out)."""

import pytest

from minedraft.engine.vllm_adapter.resident_batches import ResidentBatchChoice, choose_resident_batch

A = {"a1", "a2", "a3"}
B = {"b1", "b2", "b3"}


def test_alternating_sub_batches_each_run_in_the_batch_that_holds_them():
    assert choose_resident_batch(A, (), [A, B], current=1) == ResidentBatchChoice(0, frozenset())
    assert choose_resident_batch(B, (), [A, B], current=0) == ResidentBatchChoice(1, frozenset())


def test_first_two_sub_batches_land_in_different_batches():
    # Step 1: nothing resident, A's new requests go to the current batch.
    first = choose_resident_batch(A, (), [set(), set()], current=0)
    assert first.current == 0
    # Step 2: B's requests are not resident either; the empty batch takes them, so A stays where it is.
    second = choose_resident_batch(B, (), [A, set()], current=0)
    assert second == ResidentBatchChoice(1, frozenset())
    # From then on each sub-batch finds its own batch.
    assert choose_resident_batch(A, (), [A, B], current=1).current == 0


def test_all_requests_every_step_keeps_one_batch():
    # ar and sd: every request each step; a new arrival never flips the batch.
    everyone = A | B
    assert choose_resident_batch(everyone, (), [everyone, set()], current=0) == ResidentBatchChoice(0, frozenset())
    assert choose_resident_batch(everyone | {"new"}, (), [everyone, set()], current=0).current == 0
    # A tie (nothing resident, nothing to remove) keeps the current batch.
    assert choose_resident_batch({"x"}, (), [set(), set()], current=1).current == 1


def test_a_request_moved_to_the_other_sub_batch_leaves_its_old_batch():
    # Rebalancing moved b1 into A's sub-batch: it runs in A's batch and must not stay behind in B's (a stale entry
    # there would be used the next time B's batch is current).
    plan = choose_resident_batch(A | {"b1"}, (), [A, B], current=1)
    assert plan == ResidentBatchChoice(0, frozenset({"b1"}))


def test_finished_requests_leave_the_other_batch_too():
    plan = choose_resident_batch(A, {"b2", "a3"}, [A, B], current=1)
    assert plan.current == 0
    # a3 is in the current batch: vLLM's own path removes it there.
    assert plan.evict_from_other == frozenset({"b2"})


def test_most_held_wins_over_the_current_batch():
    # A sub-batch that mostly lives in batch 1 runs there even if batch 0 was current.
    plan = choose_resident_batch({"a1", "b1", "b2", "b3"}, (), [A, B], current=0)
    assert plan == ResidentBatchChoice(1, frozenset({"a1"}))


def test_switched_off_is_vllms_single_batch():
    # Batch 0 always; whatever the other batch still holds drains into it as it is scheduled.
    assert (choose_resident_batch(B, (), [A, B], current=1, resident_sub_batches=False)
            == ResidentBatchChoice(0, frozenset(B)))
    assert (choose_resident_batch(A, (), [A, set()], current=0, resident_sub_batches=False)
            == ResidentBatchChoice(0, frozenset()))


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="residents"):
        choose_resident_batch(A, (), [A], current=0)
    with pytest.raises(ValueError, match="current"):
        choose_resident_batch(A, (), [A, B], current=2)


def _scheduler(async_scheduling=False, v2=False):
    from types import SimpleNamespace

    return SimpleNamespace(
        scheduler_config=SimpleNamespace(async_scheduling=async_scheduling), use_v2_model_runner=v2,
        running=[SimpleNamespace(request_id=r) for r in ("a1", "b1")], prev_step_scheduled_req_ids={"a1"})


def test_running_requests_count_as_scheduled_last_step_so_vllm_sends_no_whole_contexts():
    from minedraft.engine.vllm_adapter.resident_batches import skip_token_resend

    scheduler = _scheduler()
    skip_token_resend(scheduler)
    # b1 sat out the previous step (the other sub-batch): vLLM would copy all its tokens into the step's output.
    assert scheduler.prev_step_scheduled_req_ids == {"a1", "b1"}
    for kind in (_scheduler(async_scheduling=True), _scheduler(v2=True)):
        # Async scheduling reads those tokens (and Model Runner V2 keeps no such set): left alone.
        skip_token_resend(kind)
        assert kind.prev_step_scheduled_req_ids == {"a1"}
