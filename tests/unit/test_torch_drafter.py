"""The plain-torch drafter drafts exactly what the draft model's greedy decoding gives, across jobs."""

import random

import pytest
import torch


@pytest.fixture(scope="module")
def models(pair_dir):
    from transformers import LlamaForCausalLM

    from minedraft.engine.drafter.torch_backend import TorchLlamaDrafter

    drafter = TorchLlamaDrafter(str(pair_dir / "draft"), max_slots=4, max_model_len=512)
    reference = LlamaForCausalLM.from_pretrained(str(pair_dir / "draft")).eval()
    return drafter, reference


def greedy(model, context, n):
    mask = torch.ones(1, len(context), dtype=torch.long)
    out = model.generate(input_ids=torch.tensor([context]), attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, len(context):].tolist()


def test_drafts_match_greedy_decoding_as_contexts_grow_and_diverge(models):
    drafter, reference = models
    rng = random.Random(0)
    contexts = {f"r{i}": [rng.randrange(2048) for _ in range(rng.randrange(5, 60))] for i in range(3)}
    for job in range(4):
        items = [(rid, list(ctx), 3) for rid, ctx in contexts.items()]
        drafts = drafter.draft(items, want_logprobs=job == 1)
        for (rid, ctx, n), (tokens, logprobs) in zip(items, drafts, strict=True):
            assert tokens == greedy(reference, ctx, n), f"job {job} {rid}"
            if job == 1:
                assert logprobs is not None and len(logprobs) == n and all(lp <= 0 for lp in logprobs)
            # The verifier accepts a prefix and adds one token of its own: the cache must follow.
            accepted = rng.randrange(0, n + 1)
            contexts[rid] = ctx + tokens[:accepted] + [rng.randrange(2048)]
        # The drafter times its catch-up and first drafted token (the cost model prices the other positions apart).
        assert drafter.last_first_token_seconds > 0


def test_slots_are_reused_and_evicted(models):
    drafter, reference = models
    for i in range(6):  # more requests than the 4 slots: the least recently used are evicted
        ctx = [7, 8, 9, i]
        assert drafter.draft([(f"evict-{i}", ctx, 2)], want_logprobs=False)[0][0] == greedy(reference, ctx, 2)
    drafter.forget([f"evict-{i}" for i in range(6)])
    assert len(drafter.slots) == 0


@pytest.mark.parametrize("architecture", ["qwen3", "llama"])
def test_real_architectures_draft_what_transformers_decodes(architecture):
    """Qwen3's per-head q/k RMSNorm (and GQA) in the torch drafter, against transformers' own model."""
    from transformers import AutoModelForCausalLM

    from minedraft.engine.drafter.torch_backend import TorchLlamaDrafter
    from minedraft.models.tiny import tiny_pair

    draft_dir = tiny_pair(architecture) / "draft"
    drafter = TorchLlamaDrafter(str(draft_dir), max_slots=4, max_model_len=256)
    reference = AutoModelForCausalLM.from_pretrained(str(draft_dir)).eval()
    rng = random.Random(1)
    contexts = {f"q{i}": [rng.randrange(2048) for _ in range(rng.randrange(5, 40))] for i in range(3)}
    for _ in range(2):
        items = [(rid, list(ctx), 4) for rid, ctx in contexts.items()]
        for (rid, ctx, n), (tokens, _) in zip(items, drafter.draft(items, want_logprobs=False), strict=True):
            assert tokens == greedy(reference, ctx, n), rid
            contexts[rid] = ctx + tokens[:2] + [rng.randrange(2048)]


def test_an_architecture_it_does_not_implement_is_refused_by_name(tmp_path):
    from transformers import MistralConfig

    from minedraft.engine.drafter.torch_backend import TorchLlamaDrafter

    MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'mistral'"):
        TorchLlamaDrafter(str(tmp_path), max_slots=1, max_model_len=32)
