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


STRETCHED = {
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "max_position_embeddings": 8192},
    "yarn": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
             "max_position_embeddings": 8192},
}


@pytest.mark.parametrize("scaling", sorted(STRETCHED))
def test_a_stretched_context_drafts_what_transformers_decodes_with_the_same_overrides(pair_dir, scaling):
    """The hf_overrides a user gives vLLM to stretch a model's context (RoPE scaling) reach the torch drafter's
    rotary tables as transformers applies them, windowed drafter included (a window wider than the context)."""
    from transformers import AutoConfig, LlamaForCausalLM

    from minedraft.engine.drafter.torch_backend import TorchLlamaDrafter, apply_config_overrides
    from minedraft.engine.drafter.torch_window import WindowedTorchDrafter

    path = str(pair_dir / "draft")
    overrides = STRETCHED[scaling]
    config = apply_config_overrides(AutoConfig.from_pretrained(path), overrides)
    reference = LlamaForCausalLM.from_pretrained(path, config=config).eval()
    plain = TorchLlamaDrafter(path, max_slots=4, max_model_len=512)
    drafters = [TorchLlamaDrafter(path, max_slots=4, max_model_len=512, config_overrides=overrides),
                WindowedTorchDrafter(path, max_slots=4, max_model_len=512, window=480, config_overrides=overrides)]
    rng = random.Random(5)
    contexts = {f"s{i}": [rng.randrange(2048) for _ in range(rng.randrange(100, 300))] for i in range(3)}
    items = [(rid, ctx, 4) for rid, ctx in contexts.items()]
    expected = [greedy(reference, ctx, n) for _, ctx, n in items]
    with torch.no_grad():  # the reference's log-probability of its next token after each context
        expected_logprobs = [float(torch.log_softmax(reference(input_ids=torch.tensor([ctx])).logits[0, -1], -1).max())
                             for _, ctx, _ in items]
    for drafter in drafters:
        drafts = drafter.draft(items, want_logprobs=True)
        assert [tokens for tokens, _ in drafts] == expected
        assert [lps[0] for _, lps in drafts] == pytest.approx(expected_logprobs, abs=1e-4)
    # (The scaling matters: the drafter at the pair's own RoPE gives other log-probabilities.)
    unscaled = [lps[0] for _, lps in plain.draft(items, want_logprobs=True)]
    assert unscaled != pytest.approx(expected_logprobs, abs=1e-3)


def test_a_rope_scaling_that_changes_with_the_context_is_refused_by_name(pair_dir):
    from minedraft.engine.drafter.torch_backend import TorchLlamaDrafter

    with pytest.raises(ValueError, match=r"rope_type.*'dynamic'"):
        TorchLlamaDrafter(str(pair_dir / "draft"), max_slots=1, max_model_len=32,
                          config_overrides={"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
