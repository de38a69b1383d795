from minedraft.engine.psd.subbatch import SubBatches, select_draft_lengths


def test_newcomers_fill_the_smaller_side_and_ties_go_to_the_preferred_side():
    sb = SubBatches()
    assert sb.admit("a", preferred_group=1) == 1
    assert sb.admit("b", preferred_group=1) == 0
    assert sb.admit("c", preferred_group=0) == 0
    assert sb.admit("d", preferred_group=0) == 1
    assert sb.sizes() == (2, 2)
    assert sb.admit("a", preferred_group=0) == 1, "re-admitting keeps the existing side"


def test_admission_without_balancing_goes_to_the_preferred_side():
    sb = SubBatches()
    for i in range(3):
        assert sb.admit(f"r{i}", preferred_group=0, balance=False) == 0
    assert sb.sizes() == (3, 0)


def test_rebalance_after_finishes_keeps_sizes_within_one():
    sb = SubBatches()
    for i in range(8):
        sb.admit(f"r{i}", preferred_group=0)
    for rid in sb.members(1):
        sb.remove(rid)
    assert sb.sizes() == (4, 0)
    moves = sb.rebalance()
    assert sb.sizes() == (2, 2)
    assert len(moves) == 2 and all(m.from_group == 0 and m.to_group == 1 for m in moves)
    sb.check_balanced()


def test_rebalance_is_a_no_op_when_balanced():
    sb = SubBatches()
    for i in range(5):
        sb.admit(f"r{i}", preferred_group=0)
    assert sb.rebalance() == []


def test_merge_puts_everyone_in_one_side():
    sb = SubBatches()
    for i in range(5):
        sb.admit(f"r{i}", preferred_group=0)
    sb.merge_into(0)
    assert sb.sizes() == (5, 0)
    assert sb.rebalance()
    assert abs(sb.sizes()[0] - sb.sizes()[1]) <= 1


def test_check_balanced_raises_on_imbalance():
    sb = SubBatches()
    sb.groups[0].update({"a": None, "b": None, "c": None})
    try:
        sb.check_balanced()
    except AssertionError as exc:
        assert "3 vs 0" in str(exc)
    else:
        raise AssertionError("imbalance not detected")


def test_without_budget_each_request_keeps_k_tokens():
    lengths = select_draft_lengths({"a": [0.0] * 5, "b": [0.0] * 2}, num_speculative_tokens=3, budget=None)
    assert lengths == {"a": 3, "b": 2}


def test_top_c_keeps_the_most_likely_positions_across_the_sub_batch():
    # a is confident (cumulative -0.1, -0.2, -0.3, -0.4), b is not (-2, -4, ...); budget 5 of 8 positions.
    drafts = {"a": [-0.1, -0.1, -0.1, -0.1], "b": [-2.0, -2.0, -2.0, -2.0]}
    assert select_draft_lengths(drafts, num_speculative_tokens=2, budget=5) == {"a": 4, "b": 1}


def test_top_c_cuts_each_draft_at_its_furthest_kept_position():
    # Cumulative: a -0.5, -1.0, -4.0; b -0.2, -0.4, -0.6; c -5.0. The best three: b0, b1, a0.
    drafts = {"a": [-0.5, -0.5, -3.0], "b": [-0.2, -0.2, -0.2], "c": [-5.0]}
    lengths = select_draft_lengths(drafts, num_speculative_tokens=1, budget=3)
    assert lengths == {"a": 1, "b": 2, "c": 0}
    assert sum(lengths.values()) == 3
