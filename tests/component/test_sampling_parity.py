"""Presence/frequency penalties and log-probabilities under speculation, on the real engine: psd and sd give what the
target alone (ar) gives. vLLM's rejection sampler applies the penalties at every draft position (counting the drafts
before it as output) and reports each accepted token's log-probabilities from the target's logits at that position;
these tests check that the engine's own speculative path keeps both (its step path hands vLLM the drafts)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from minedraft.engine.requests import SamplingSettings, TokenLogprob
from minedraft.engine.settings import Mode

pytestmark = pytest.mark.engine

PROMPTS = ["def parse_args(argv):\n    ", "import numpy as np\n", "class Foo:\n    def __init__(self",
           "for i in range(10):"]
MAX_TOKENS = 24


@dataclass
class Run:
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    drafted: int = 0


def run(engine, mode: Mode, sampling: SamplingSettings, tag: str, draft_length: str = "fixed") -> Run:
    engine.set_mode(mode, 3, 0)
    engine.psd_scheduler.core.set_draft_length(draft_length)
    try:
        return _run(engine, mode, sampling, f"{tag}-{draft_length}")
    finally:
        engine.psd_scheduler.core.set_draft_length("fixed")


def _run(engine, mode: Mode, sampling: SamplingSettings, tag: str) -> Run:
    ids = [f"{tag}-{mode.value}-{i}" for i in range(len(PROMPTS))]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    logprobs: dict[str, list[TokenLogprob]] = {i: [] for i in ids}
    for request_id, prompt in zip(ids, PROMPTS, strict=True):
        engine.add_request(request_id, engine.encode_prompt(prompt), sampling)
    result = Run()
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
            if delta.logprobs is not None:
                assert len(delta.logprobs) == len(delta.token_ids)
                logprobs[delta.request_id] += delta.logprobs
            result.drafted += delta.num_draft_tokens
    result.tokens = [tokens[i] for i in ids]
    result.logprobs = [logprobs[i] for i in ids]
    return result


def test_penalties_are_honoured_losslessly_under_speculation(psd):
    penalised = SamplingSettings(max_tokens=MAX_TOKENS, presence_penalty=1.5, frequency_penalty=1.0)
    target = run(psd, Mode.AR, penalised, "penalty")
    plain = run(psd, Mode.AR, SamplingSettings(max_tokens=MAX_TOKENS), "plain")
    assert target.tokens != plain.tokens, "the penalties change nothing here: this test would prove nothing"
    for mode in (Mode.SD, Mode.PSD):
        speculative = run(psd, mode, penalised, "penalty")
        assert speculative.drafted > 0, f"{mode.value} drafted nothing"
        assert speculative.tokens == target.tokens, f"{mode.value} with penalties differs from the target alone"


def test_logprobs_are_the_targets_under_speculation(psd):
    sampling = SamplingSettings(max_tokens=MAX_TOKENS, logprobs=3)
    target = run(psd, Mode.AR, sampling, "logprobs")
    for tokens, logprobs in zip(target.tokens, target.logprobs, strict=True):
        assert len(logprobs) == len(tokens) == MAX_TOKENS
        for token, entry in zip(tokens, logprobs, strict=True):
            assert len(entry.top) == 3 and entry.top[0][0] == token  # greedy: the chosen token is the most likely
            assert entry.logprob == entry.top[0][1] and entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]
    for mode in (Mode.SD, Mode.PSD):
        speculative = run(psd, mode, sampling, "logprobs")
        assert speculative.drafted > 0, f"{mode.value} drafted nothing"
        assert speculative.tokens == target.tokens
        for got, want in zip(speculative.logprobs, target.logprobs, strict=True):
            assert [e.top[:1][0][0] for e in got] == [e.top[0][0] for e in want]
            assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-4), mode.value
            assert [[lp for _, lp in e.top] for e in got] == [
                pytest.approx([lp for _, lp in e.top], abs=1e-4) for e in want]


def test_seeded_sampling_with_penalties_and_logprobs_is_the_same_in_every_mode(psd):
    """At temperature 1 with a seed (keyed races: the same tokens whatever was drafted), penalties and log-probabilities
    together: sd and psd give ar's tokens and log-probabilities."""
    sampling = SamplingSettings(max_tokens=MAX_TOKENS, temperature=1.0, seed=7, presence_penalty=1.0,
                                frequency_penalty=0.5, logprobs=2)
    target = run(psd, Mode.AR, sampling, "seeded")
    assert all(len(lps) == len(tokens) == MAX_TOKENS for tokens, lps in zip(target.tokens, target.logprobs,
                                                                             strict=True))
    # (--draft-length adaptive too: drafts of each request's own length, cut by the step's verify budget.)
    for mode, draft_length in ((Mode.SD, "fixed"), (Mode.PSD, "fixed"), (Mode.SD, "adaptive"),
                               (Mode.PSD, "adaptive")):
        speculative = run(psd, mode, sampling, "seeded", draft_length)
        label = f"{mode.value} {draft_length}"
        assert speculative.drafted > 0, f"{label} drafted nothing"
        assert speculative.tokens == target.tokens, label
        for got, want in zip(speculative.logprobs, target.logprobs, strict=True):
            assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-4), label
