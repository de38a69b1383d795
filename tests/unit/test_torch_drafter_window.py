"""The windowed torch drafter: each step reads only sinks + the last W tokens, with a cache bounded by the window."""

import random

import pytest

from minedraft.engine.drafter.torch_backend import TorchLlamaDrafter
from minedraft.engine.drafter.torch_window import WindowedTorchDrafter


def _jobs(drafter, contexts, rng, num_jobs, n=3):
    """Jobs as the verifier sends them: each context grows by an accepted prefix of the draft and one token of the
    verifier's own (rejections roll the drafter's written tail back). Returns each job's drafts."""
    out = []
    for _ in range(num_jobs):
        items = [(rid, list(ctx), n) for rid, ctx in contexts.items()]
        drafts = drafter.draft(items, want_logprobs=False)
        out.append([tokens for tokens, _ in drafts])
        for (rid, ctx, _), (tokens, _) in zip(items, drafts, strict=True):
            accepted = rng.randrange(0, n + 1)
            contexts[rid] = ctx + tokens[:accepted] + [rng.randrange(2048)]
    return out


def test_a_window_wider_than_every_context_drafts_exactly_what_the_dense_drafter_drafts(pair_dir):
    dense = TorchLlamaDrafter(str(pair_dir / "draft"), max_slots=4, max_model_len=512)
    wide = WindowedTorchDrafter(str(pair_dir / "draft"), max_slots=4, max_model_len=512, window=400)
    rng = random.Random(1)
    contexts = {f"r{i}": [rng.randrange(2048) for _ in range(rng.randrange(5, 150))] for i in range(3)}
    expected = _jobs(dense, dict(contexts), random.Random(2), 6)
    assert _jobs(wide, dict(contexts), random.Random(2), 6) == expected


@pytest.mark.parametrize("window, sinks", [(16, 4), (40, 0), (100, 4)])
def test_drafting_incrementally_with_rollbacks_equals_drafting_the_same_context_afresh(pair_dir, window, sinks):
    """Each position sees the sinks and its own window whatever the order tokens arrived in: a drafter that took the
    context in over many jobs (drafted tails rolled back, contexts past the ring, catch-ups longer than a chunk) drafts
    what a fresh one drafts from the whole context at once."""
    path = str(pair_dir / "draft")
    incremental = WindowedTorchDrafter(path, max_slots=4, max_model_len=512, window=window, num_sink_tokens=sinks)
    rng = random.Random(window)
    contexts = {f"r{i}": [rng.randrange(2048) for _ in range(rng.randrange(20, 200))] for i in range(3)}
    _jobs(incremental, contexts, rng, 30)
    fresh = WindowedTorchDrafter(path, max_slots=4, max_model_len=512, window=window, num_sink_tokens=sinks)
    items = [(rid, ctx, 3) for rid, ctx in contexts.items()]
    got = incremental.draft(items, want_logprobs=True)
    want = fresh.draft(items, want_logprobs=True)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert a == pytest.approx(b, abs=1e-4)


def test_a_window_reads_only_the_window(pair_dir):
    """One-layer draft, no sinks: the first drafted token's log-probability depends only on the last W tokens (the
    dense drafter on just those tokens gives it: RoPE sees the same relative distances)."""
    path = str(pair_dir / "draft")
    window = 24
    windowed = WindowedTorchDrafter(path, max_slots=2, max_model_len=512, window=window, num_sink_tokens=0)
    dense = TorchLlamaDrafter(path, max_slots=2, max_model_len=512)
    rng = random.Random(3)
    context = [rng.randrange(2048) for _ in range(300)]
    assert len(windowed.layers) == 1
    (tokens, logprobs), = windowed.draft([("r", context, 1)], want_logprobs=True)
    (dense_tokens, dense_logprobs), = dense.draft([("r", context[-window:], 1)], want_logprobs=True)
    assert tokens == dense_tokens and logprobs == pytest.approx(dense_logprobs, abs=1e-4)
    # ... and not on anything before it: another past gives the same draft.
    other = [rng.randrange(2048) for _ in range(150)] + context[-window:]
    (again, again_logprobs), = windowed.draft([("s", other, 1)], want_logprobs=True)
    assert again == tokens and again_logprobs == pytest.approx(logprobs, abs=1e-4)


def test_the_cache_is_bounded_by_the_window_not_the_context_length(pair_dir):
    path = str(pair_dir / "draft")
    short = WindowedTorchDrafter(path, max_slots=4, max_model_len=256, window=64)
    long = WindowedTorchDrafter(path, max_slots=4, max_model_len=2048, window=64)
    dense = TorchLlamaDrafter(path, max_slots=4, max_model_len=2048)
    dense_bytes = sum(c.numel() * c.element_size() for c in (*dense.k_cache, *dense.v_cache))
    assert short.cache_bytes == long.cache_bytes < dense_bytes / 10


def test_a_long_prompt_costs_the_drafter_at_most_the_sinks_and_the_window(pair_dir):
    """A newcomer's prompt is taken in trimmed to what a later query sees (the sinks and the last W positions): the
    catch-up is bounded by the window whatever the prompt's length, and drafts what taking in every token drafts
    (exact for this one-layer draft model)."""
    path = str(pair_dir / "draft")
    window, sinks = 32, 4
    rng = random.Random(9)
    prompts = {f"p{i}": [rng.randrange(2048) for _ in range(400 + 50 * i)] for i in range(2)}
    trimmed = WindowedTorchDrafter(path, max_slots=2, max_model_len=512, window=window, num_sink_tokens=sinks)
    drafts = trimmed.draft([(rid, ctx, 3) for rid, ctx in prompts.items()], want_logprobs=True)
    assert trimmed.catch_up_tokens_taken <= 2 * (sinks + window)
    # The same prompts fed 16 tokens at a time (each catch-up within the window) take every token in, and draft the
    # same.
    stepwise = WindowedTorchDrafter(path, max_slots=2, max_model_len=512, window=window, num_sink_tokens=sinks)
    for n in range(16, 400, 16):
        stepwise.draft([(rid, ctx[:n], 1) for rid, ctx in prompts.items()], want_logprobs=False)
    assert stepwise.catch_up_tokens_taken > 2 * 300
    expected = stepwise.draft([(rid, ctx, 3) for rid, ctx in prompts.items()], want_logprobs=True)
    assert [t for t, _ in drafts] == [t for t, _ in expected]
    for (_, a), (_, b) in zip(drafts, expected, strict=True):
        assert a == pytest.approx(b, abs=1e-4)
