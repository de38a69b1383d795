"""Keyed races for seeded sampling: exact samples of the target's distribution, a function of (seed, position) only,
and the rejection step's hand-over to vLLM's greedy rule (with a stand-in for vLLM's function)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from minedraft.engine.vllm_adapter import keyed_race as kr
from minedraft.engine.vllm_adapter import keyed_sampling as ks


def test_noise_is_a_function_of_seed_position_and_vocabulary_id_alone():
    keys = ks.position_keys([7, 7, 7, 8, 2**40 + 7], [0, 0, 1, 0, 0])
    noise = ks.keyed_gumbel(keys, 1000)
    assert torch.equal(noise[0], noise[1])
    # Another position, another seed, another high word of the seed: other noise.
    for other in (2, 3, 4):
        assert not torch.equal(noise[0], noise[other])
    # The same keys on a batch of another shape give the same rows (no state, no batch dependence).
    again = ks.keyed_gumbel(ks.position_keys([2**40 + 7, 7], [0, 1]), 1000)
    assert torch.equal(again[0], noise[4]) and torch.equal(again[1], noise[2])
    assert torch.isfinite(noise).all()


def test_keys_do_not_overflow_for_any_int64_seed():
    keys = ks.position_keys([0, 2**63 - 1, 2**32 - 1, 2**32], [2**31, 0, 5, 5])
    assert ((keys >= 0) & (keys < 2**32)).all()
    assert len(set(keys.tolist())) == 4


def test_positions_must_match_seeds():
    with pytest.raises(ValueError, match="positions"):
        ks.position_keys([1, 2], [0])


@pytest.fixture(params=["torch", "fused-cpu", "single-pass"])
def race(request):
    """Each way the engine draws a race: torch's elementwise passes, vLLM's CPU kernel, and the one-pass algorithm
    the CUDA kernel runs (keyed_race.single_pass_winners, in torch, with small blocks so rows span several
    segments)."""
    if request.param == "single-pass":
        return lambda logits, keys: kr.single_pass_winners(logits, keys, block=32)
    fused = ks.fused_cpu_race()
    if request.param == "fused-cpu" and fused is None:
        pytest.skip("vLLM's CPU kernel is not built here")
    return None if request.param == "torch" else fused


def test_the_race_winner_is_an_exact_sample_of_the_distribution(race):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    expected = torch.softmax(logits, dim=0).double()
    n = 20_000
    winners = ks.keyed_tokens(logits.expand(n, -1), list(range(n)), [3] * n, race)
    counts = torch.bincount(winners, minlength=6).double()
    assert chisquare(counts.numpy(), (expected * n).numpy()).pvalue > 1e-3


def test_masked_entries_never_win(race):
    logits = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf")]]).expand(4000, -1)
    winners = ks.keyed_tokens(logits, list(range(4000)), [0] * 4000, race)
    assert set(winners.tolist()) == {0, 2}


def test_draws_at_two_positions_are_independent(race):
    # A weak hash would correlate neighbouring positions of one seed; the joint counts must factor.
    logits = torch.zeros(4)
    n = 8000
    first = ks.keyed_tokens(logits.expand(n, -1), list(range(n)), [10] * n, race)
    second = ks.keyed_tokens(logits.expand(n, -1), list(range(n)), [11] * n, race)
    table = torch.zeros(4, 4)
    for a, b in zip(first.tolist(), second.tolist(), strict=True):
        table[a, b] += 1
    assert chi2_contingency(table.numpy())[1] > 1e-3


def test_a_rows_winner_does_not_depend_on_the_other_rows(race):
    logits = torch.randn(6, 500)
    together = ks.keyed_tokens(logits, [1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5], race)
    alone = torch.cat([ks.keyed_tokens(logits[i:i + 1], [i + 1], [i], race) for i in range(6)])
    assert torch.equal(together, alone)


def test_keyed_step_positions_without_and_with_drafts():
    assert ks.keyed_step([], None) is None
    plain = ks.keyed_step([(0, 5, 10), (2, 6, 0)], None)
    assert plain == ks.KeyedStep(rows=(0, 2), seeds=(5, 6), first_positions=(10, 0), sample_positions=(10, 0))
    # With drafts the plain sampler draws the bonus token, after the row's drafts.
    drafted = ks.keyed_step([(0, 5, 10), (2, 6, 0)], [3, 1, 0])
    assert drafted.first_positions == (10, 0) and drafted.sample_positions == (13, 0)


@dataclass
class _Metadata:
    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool


def test_rejection_step_verifies_keyed_requests_greedily_on_their_winners(race):
    seen = {}

    def vllm_rejection_sample(draft_ids, num_draft, max_len, cu, draft_probs, target_logits, bonus, metadata):
        seen.update(target=target_logits.clone(), metadata=metadata)
        return "vllm's output"

    wrapped = ks.keyed_rejection_sample(vllm_rejection_sample, race)
    vocab = 50
    # Three requests: 0 keyed with 2 drafts, 1 unseeded random with 1 draft, 2 keyed with no drafts (bonus only).
    logits = torch.randn(3, vocab)
    metadata = _Metadata(torch.tensor([1.0, 0.7, 0.9]), all_greedy=False, all_random=True)
    step = ks.KeyedStep(rows=(0, 2), seeds=(11, 12), first_positions=(4, 9), sample_positions=(6, 9))
    token = ks._STEP.set(step)
    try:
        out = wrapped(torch.zeros(3, dtype=torch.int64), [2, 1, 0], 2, torch.tensor([2, 3, 3]), None,
                      logits.clone(), torch.zeros(3, 1), metadata)
    finally:
        ks._STEP.reset(token)
    assert out == "vllm's output"
    # The keyed request's two draft positions (4 and 5) are its winners there, what the plain stage would draw.
    expected = ks.keyed_tokens(logits[:2], [11, 11], [4, 5], race)
    assert torch.equal(seen["target"][:2].argmax(dim=-1), expected)
    assert torch.equal(seen["target"][2], logits[2]), "an unseeded request's logits were touched"
    assert seen["metadata"].temperature.tolist() == pytest.approx([0.0, 0.7, 0.0])
    assert not seen["metadata"].all_greedy and not seen["metadata"].all_random


def test_rejection_step_outside_a_keyed_step_is_vllms():
    calls = []
    wrapped = ks.keyed_rejection_sample(lambda *args: calls.append(args) or "plain")
    metadata = _Metadata(torch.tensor([1.0]), all_greedy=False, all_random=True)
    logits = torch.randn(1, 8)
    assert wrapped(torch.zeros(1), [1], 1, torch.tensor([1]), None, logits, torch.zeros(1, 1), metadata) == "plain"
    assert calls[0][7] is metadata and torch.equal(calls[0][5], logits)


def test_the_top_k_top_p_stage_overwrites_keyed_rows_only(race):
    pytest.importorskip("vllm")
    vocab = 40
    stage = SimpleNamespace(forward=lambda logits, generators, k, p: (torch.full((logits.shape[0],), 39), None))
    ks._wrap_top_k_top_p(SimpleNamespace(topk_topp_sampler=stage), race)
    logits = torch.randn(3, vocab)
    # Row 2 nearly flat under top-k 2: unfiltered, its winner would fall outside {38, 39} nineteen times in twenty.
    logits[2] = torch.arange(vocab) * 0.01
    k = torch.tensor([vocab, vocab, 2])
    for seed in range(20):
        step = ks.KeyedStep(rows=(0, 2), seeds=(3, seed), first_positions=(0, 5), sample_positions=(1, 5))
        token = ks._STEP.set(step)
        try:
            sampled, _ = stage.forward(logits.clone(), {}, k, None)
        finally:
            ks._STEP.reset(token)
        assert sampled[1] == 39, "an unkeyed row's draw was replaced"
        assert sampled[0] == ks.keyed_tokens(logits[:1], [3], [1], race)[0]
        assert int(sampled[2]) in {38, 39}, "top-k was not applied before the race"
