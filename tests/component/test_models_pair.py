"""The committed local pair is a realistic speculative pair: measured on a fixed held-out sample."""

import pytest

from minedraft.models.check import greedy_acceptance, load_heldout, load_pair
from minedraft.models.spec import RECIPE


@pytest.fixture(scope="module")
def pair(pair_dir):
    return load_pair(pair_dir)


def test_held_out_sample_is_not_training_text(pair_dir):
    from minedraft.models.corpus import read_texts, split_stdlib

    snippets = load_heldout(pair_dir)
    assert len(snippets) >= 16
    training = "\n".join(read_texts(split_stdlib(RECIPE.heldout_modulus).train_files))
    # The standard library carries a few duplicated files, so a handful of held-out snippets also occur in
    # training files (3 of 32 when this was written); most must not.
    verbatim = sum(snippet in training for snippet in snippets)
    assert verbatim <= len(snippets) // 8, f"{verbatim} of {len(snippets)} held-out snippets are training text"


def test_greedy_acceptance_at_k4_is_realistic(pair_dir, pair):
    target, draft, tokenizer = pair
    report = greedy_acceptance(target, draft, tokenizer, load_heldout(pair_dir)[:16], num_speculative_tokens=4)
    assert report.num_prompts >= 12
    assert 0.5 <= report.acceptance_rate <= 0.9, report


def test_target_costs_clearly_more_than_the_draft(pair):
    target, draft, _ = pair
    target_params = sum(p.numel() for p in target.parameters())
    draft_params = sum(p.numel() for p in draft.parameters())
    assert target_params > 3 * draft_params
    assert target.config.num_hidden_layers > draft.config.num_hidden_layers
    assert target.config.vocab_size == draft.config.vocab_size, "one tokenizer for both"
