"""engine_core.skip_draft_token_round_trip: only MineDraft's scheduler (whose in-worker proposer proposes nothing)
loses vLLM's per-step `take_draft_token_ids` round trip; vLLM's own speculative decoding keeps it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def test_the_round_trip_is_skipped_for_minedrafts_scheduler_only():
    pytest.importorskip("vllm")
    from minedraft.engine.vllm_adapter.engine_core import skip_draft_token_round_trip
    from minedraft.engine.vllm_adapter.scheduler import PSDScheduler

    ours = SimpleNamespace(scheduler=object.__new__(PSDScheduler), check_for_draft_tokens=True)
    assert skip_draft_token_round_trip(ours) and ours.check_for_draft_tokens is False
    vllms = SimpleNamespace(scheduler=object(), check_for_draft_tokens=True)
    assert not skip_draft_token_round_trip(vllms) and vllms.check_for_draft_tokens is True
    plain = SimpleNamespace(scheduler=object.__new__(PSDScheduler), check_for_draft_tokens=False)
    assert not skip_draft_token_round_trip(plain)
