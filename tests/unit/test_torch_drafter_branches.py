"""Lookahead's branches in the torch drafters: several branches of one request share its committed KV, each drafts
exactly what drafting from the committed context plus its tail directly gives, and the request's own cache is left
holding its committed tokens only."""

import random

import pytest
import torch

from minedraft.engine.drafter import protocol
from minedraft.engine.drafter.backends import TorchDrafter
from minedraft.engine.drafter.torch_backend import TorchLlamaDrafter
from minedraft.engine.drafter.torch_window import WindowedTorchDrafter

K = 3
TOP_F = 4


def _drafter(model: TorchLlamaDrafter) -> TorchDrafter:
    drafter = TorchDrafter.__new__(TorchDrafter)  # (its model built here, not from a settings dict)
    drafter.model = model
    drafter.cancelled = set()
    return drafter


@pytest.mark.parametrize("window", [0, 24])
def test_branches_draft_what_their_context_plus_tail_drafts_and_leave_the_committed_cache_alone(pair_dir, window):
    path = str(pair_dir / "draft")
    model = (WindowedTorchDrafter(path, max_slots=16, max_model_len=512, window=window) if window
             else TorchLlamaDrafter(path, max_slots=16, max_model_len=512))
    fresh = (WindowedTorchDrafter(path, max_slots=16, max_model_len=512, window=window) if window
             else TorchLlamaDrafter(path, max_slots=16, max_model_len=512))
    drafter = _drafter(model)
    rng = random.Random(window)
    contexts = {f"r{i}": [rng.randrange(2048) for _ in range(rng.randrange(20, 80))] for i in range(2)}
    # A first (root) job: the drafter holds the committed contexts.
    roots = protocol.DraftJob(1, [protocol.DraftItem(rid, ctx, K + 1) for rid, ctx in contexts.items()], top_f=TOP_F)
    root_results, _, _ = drafter.draft(roots, None)
    for rid in contexts:
        contexts[rid] = contexts[rid] + [rng.randrange(2048)]  # committed since: one token
    items = []
    for rid, ctx in contexts.items():
        root = next(r for r in root_results if r.request_id == rid)
        tails = [[root.token_ids[0]], [*root.token_ids[:2], rng.randrange(2048)], [rng.randrange(2048)]]
        for branch, tail in enumerate(tails):
            items.append(protocol.DraftItem(rid, ctx, K, 0, tail, branch))
    cached = {rid: [cache[model.slots[rid].index].clone() for cache in model.k_cache] for rid in contexts}
    results, _, _ = drafter.draft(protocol.DraftJob(2, items, top_f=TOP_F), None)
    assert [(r.request_id, r.branch, r.tail) for r in results] == [(i.request_id, i.branch, i.tail) for i in items]
    for item, result in zip(items, results, strict=True):
        context = [*item.token_ids, *item.tail]
        want = fresh.draft_with_candidates([("fresh-" + str(len(context)), context, K)], False, top_f=TOP_F)[0]
        fresh.forget(["fresh-" + str(len(context))])
        assert result.token_ids == want[0], f"{item.request_id} branch {item.branch}"
        assert result.context_num_tokens == len(context)
        assert len(result.candidates) == K + 1 and result.candidates == want[2]
        assert [c[0] for c in result.candidates[:K]] == result.token_ids, "greedy: the top candidate is the draft"
        assert all(len(c) == TOP_F for c in result.candidates)
    for rid, ctx in contexts.items():
        slot = model.slots[rid]
        assert slot.tokens == ctx, "the request's slot holds its committed tokens only"
        n = len(ctx) - 1  # positions written before this job (the last committed token was fed in it)
        for before, cache in zip(cached[rid], model.k_cache, strict=True):
            now = cache[slot.index]
            if window:
                positions = model.cache_positions[slot.index]
                assert (positions < len(ctx)).all(), "no branch position entered the request's ring"
            else:
                assert torch.equal(now[:, :n], before[:, :n]), "committed KV unchanged"
    assert len(model.slots) == len(contexts), "the branches' scratch slots are freed"
    # The next job continues from the committed context as if no branch had been drafted.
    nxt = {rid: [*ctx, rng.randrange(2048)] for rid, ctx in contexts.items()}
    got = drafter.draft(protocol.DraftJob(3, [protocol.DraftItem(rid, c, K) for rid, c in nxt.items()]), None)[0]
    for result in got:
        ctx = nxt[result.request_id]
        assert result.token_ids == fresh.draft([("again-" + result.request_id, ctx, K)], False)[0][0]


def test_dense_drafter_drafts_branches_as_one_tree_row_per_request_without_forking(pair_dir, monkeypatch):
    """The dense drafter's branch job: no scratch slot is forked; roots, tails of every length, a request new to the
    drafter (a long catch-up) and a request near the end of its context (regions that do not fit: forked instead)
    each draft exactly what drafting from the context plus the tail gives."""
    path = str(pair_dir / "draft")
    model = TorchLlamaDrafter(path, max_slots=16, max_model_len=128)
    fresh = TorchLlamaDrafter(path, max_slots=16, max_model_len=128)
    drafter = _drafter(model)
    rng = random.Random(7)
    held = {"old": [rng.randrange(2048) for _ in range(40)], "end": [rng.randrange(2048) for _ in range(121)]}
    drafter.draft(protocol.DraftJob(1, [protocol.DraftItem(rid, ctx, K + 1) for rid, ctx in held.items()]), None)
    contexts = {"old": [*held["old"], *[rng.randrange(2048) for _ in range(3)]],
                "new": [rng.randrange(2048) for _ in range(30)], "end": [*held["end"], rng.randrange(2048)]}
    tails = {"old": [(), (5,), (7, 9), (7, 9, 11, 13)], "new": [()], "end": [(), (3, 4)]}

    def job(names: list[str]) -> list[protocol.DraftItem]:
        return [protocol.DraftItem(rid, contexts[rid], K + (0 if tail else 1), 0, list(tail), branch)
                for rid in names for branch, tail in enumerate(tails[rid])]

    forked: list[str] = []
    monkeypatch.setattr(model, "fork", lambda rid, key, n: forked.append(key) or TorchLlamaDrafter.fork(model, rid,
                                                                                                        key, n))
    for names, forks in ((["old", "new"], False), (["end"], True)):
        items = job(names)
        results, _, _ = drafter.draft(protocol.DraftJob(2, items, top_f=TOP_F), None)
        assert bool(forked) is forks
        for item, result in zip(items, results, strict=True):
            context = [*item.token_ids, *item.tail]
            key = f"fresh-{item.request_id}-{item.branch}"
            room = min(item.num_draft_tokens, 128 - len(context))
            want = fresh.draft_with_candidates([(key, context, room)], False, top_f=TOP_F)[0]
            fresh.forget([key])
            assert result.token_ids == want[0], f"{item.request_id} branch {item.branch}"
            assert result.candidates == want[2], f"{item.request_id} branch {item.branch}"
        for rid in names:
            assert model.slots[rid].tokens == contexts[rid]
    assert set(model.slots) == set(contexts), "no scratch slot left"
