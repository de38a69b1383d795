"""The vLLM drafter's first-token time is when the first forward's tokens reached the host: under vLLM's async
scheduling a step() call launches a forward and returns the previous one's outputs, so the first call returns before
any forward has run (the cost model read that as the first token's price: drafting priced far below what it costs).
A stand-in engine with vLLM's call pattern; vLLM's own request types are built (import only, no model)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from minedraft.engine.drafter import protocol
from minedraft.engine.drafter.vllm_backend import VllmDrafter, steps_behind

FORWARD_SECONDS = 0.15


class _Engine:
    """Each forward takes FORWARD_SECONDS and yields one token per request; with `async_scheduling` a call launches
    forward n and returns forward n - 1's outputs (the first call returns at once, empty), else it runs forward n
    and returns its outputs."""

    def __init__(self, async_scheduling: bool) -> None:
        self.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))
        self.requests: dict[str, int] = {}
        self.made: dict[str, list[int]] = {}
        self.launched = 0

    def add_request(self, key, prompt, params) -> None:
        self.requests[key] = params.max_tokens
        self.made[key] = []

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _forward(self) -> list:
        time.sleep(FORWARD_SECONDS)
        outputs = []
        for key in list(self.requests):
            self.made[key].append(7)
            if len(self.made[key]) == self.requests[key]:
                del self.requests[key]
                outputs.append(SimpleNamespace(finished=True, request_id=key,
                                               outputs=[SimpleNamespace(token_ids=self.made[key], logprobs=None)]))
        return outputs

    def step(self) -> list:
        if self.vllm_config.scheduler_config.async_scheduling and self.launched == 0:
            self.launched += 1
            return []  # forward 1 launched, nothing back yet
        self.launched += 1
        return self._forward()


def _drafter(engine: _Engine) -> VllmDrafter:
    drafter = VllmDrafter.__new__(VllmDrafter)
    drafter.engine = engine
    drafter.steps_behind = steps_behind(engine)
    drafter.max_model_len = 1000
    drafter.cancelled = set()
    drafter.block_hashes = None
    return drafter


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_first_token_time_covers_the_first_forward(async_scheduling):
    pytest.importorskip("vllm")
    engine = _Engine(async_scheduling)
    job = protocol.DraftJob(1, [protocol.DraftItem("a", [1, 2, 3], 3), protocol.DraftItem("b", [4, 5], 3)])
    results, seconds, first = _drafter(engine).draft(job, poll_messages=lambda: None)
    assert sorted(r.request_id for r in results) == ["a", "b"] and all(r.token_ids == [7, 7, 7] for r in results)
    assert first >= FORWARD_SECONDS * 0.9, "the first token was reported before its forward ran"
    assert first < seconds


def test_steps_behind_reads_vllms_scheduler_config():
    assert steps_behind(_Engine(async_scheduling=True)) == 1
    assert steps_behind(_Engine(async_scheduling=False)) == 0
    assert steps_behind(SimpleNamespace()) == 0
