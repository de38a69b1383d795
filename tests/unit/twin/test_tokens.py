"""The twin's token ids: drafts are the drafter's top choices, the target commits them as the acceptance model
says, and its bonus token lands on the drafter's candidates by the measured ranks."""

from __future__ import annotations

from typing import Any

import pytest

from minedraft.twin.costs import AcceptanceModel, Hardware, StepCosts
from minedraft.twin.curves import load_curves
from minedraft.twin.replica import ReplicaSettings, SimRequest, TwinReplica
from minedraft.twin.tokens import TokenModel

RANKS = (0.5, 0.3)  # rank 2 half the time a top choice is wrong, rank 3 0.3, a fresh token 0.2


def test_a_draft_is_the_chain_of_top_choices_and_its_candidates_rank_them() -> None:
    model = TokenModel(RANKS)
    drafted, ranked = model.draft_with_candidates(stream=7, position=100, previous=5, length=3, count=3)
    assert drafted == model.draft(7, 100, 5, 3)
    assert len(ranked) == 4 and all(len(options) == 3 and len(set(options)) == 3 for options in ranked)
    assert [options[0] for options in ranked[:3]] == drafted
    # Every row is `candidates` at its position after the token before it (the unrolled hash is `candidate`'s).
    assert ranked == [model.candidates(7, 100 + i, previous, 3) for i, previous in enumerate([5, *drafted])]
    # The candidates after the draft follow its last token; another previous token gives other candidates.
    assert ranked[3] == model.candidates(7, 103, drafted[-1], 3)
    assert model.candidates(7, 103, drafted[-1] + 1, 3) != ranked[3]


def test_the_bonus_lands_on_the_drafters_ranks_as_measured() -> None:
    model = TokenModel(RANKS, seed=3)
    draws = 20_000
    proposal = model.draft(1, 10, 0, 2)
    rank_of: dict[int, int] = {}
    rejected = {1: 0, 2: 0, 3: 0, None: 0}
    full = {1: 0, 2: 0, 3: 0, None: 0}
    for counts, accepted in ((rejected, 0), (full, 2)):
        previous = 0 if accepted == 0 else proposal[-1]
        rank_of = {c: r for r, c in enumerate(model.candidates(1, 10 + accepted, previous, 3), start=1)}
        for _ in range(draws):
            committed = model.commit(1, 10, 0, proposal, accepted, top_choice_rate=0.8)
            assert committed[:accepted] == proposal[:accepted] and len(committed) == accepted + 1
            counts[rank_of.get(committed[-1])] += 1
    # After a rejection at position 0 the bonus is never the rejected draft token (rank 1).
    assert rejected[1] == 0
    assert rejected[2] / draws == pytest.approx(0.5, abs=0.02)
    assert rejected[3] / draws == pytest.approx(0.3, abs=0.02)
    # After a full acceptance: the top choice at the acceptance rate, the rest by the same ranks.
    assert full[1] / draws == pytest.approx(0.8, abs=0.02)
    assert full[2] / draws == pytest.approx(0.2 * 0.5, abs=0.02)


def test_the_replica_commits_its_drafts_token_ids() -> None:
    curves = load_curves("benchmarks/curves/h200-qwen3-32b.json")
    costs = StepCosts.from_curves(curves, "qwen3-32b", "qwen3-1.7b", Hardware())
    replica = TwinReplica(costs, AcceptanceModel.constant(0.8), ReplicaSettings(mode="sd", k=3, check_invariants=True))
    for index in range(4):
        replica.add(SimRequest(f"r{index}", 64, 400, 0.0))
    decisions = []
    schedule = replica.core.schedule

    def spy(*args: Any, **kwargs: Any) -> Any:
        decisions.append(schedule(*args, **kwargs))
        return decisions[-1]

    replica.core.schedule = spy  # type: ignore[method-assign]
    total_accepted = 0
    for _ in range(30):
        before = {rid: len(r.tokens) for rid, r in replica.requests.items()}
        replica.step()
        record, plan = replica.records[-1], decisions[-1].plan
        matched = 0
        for rid, proposal in plan.proposals.items():
            new = replica.requests[rid].tokens[before[rid]:]
            assert len(replica.requests[rid].tokens) == replica.requests[rid].output_tokens
            # The accepted drafts are the proposal's own token ids, and the bonus after them is not the next one.
            run = next((i for i, (a, b) in enumerate(zip(new, proposal, strict=False)) if a != b),
                       min(len(new), len(proposal)))
            matched += run
        assert matched == record.num_accepted_tokens
        total_accepted += matched
    assert total_accepted > 0


def test_a_draft_from_another_context_is_rejected_where_it_leaves_the_real_one() -> None:
    model = TokenModel(RANKS, seed=5)
    right = model.draft(2, 50, 9, 3)
    wrong = model.draft(2, 50, 10, 3)  # drafted after another token (a lookahead backup's wrong bonus)
    assert model.valid_prefix(2, 50, 9, right) == 3 and model.valid_prefix(2, 50, 9, wrong) == 0
    # A draw of 3 accepted drafts for a well-formed proposal commits them; for the wrong one none is accepted and
    # the target's token there is the drafter's top choice in the real context (the draw went on past it).
    assert model.judge(2, 50, 9, right, 3, 0.8)[:3] == right
    assert model.judge(2, 50, 9, wrong, 3, 0.8) == [right[0]]
    # A draw that stopped there leaves another rank as the bonus, never the top choice.
    assert all(model.judge(2, 50, 9, wrong, 0, 0.8) != [right[0]] for _ in range(50))
