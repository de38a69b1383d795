"""The engine loop dying mid-stream: every stream ends with EngineDeadError, nothing hangs, new work is refused."""

from __future__ import annotations

import pytest

from minedraft.engine.async_engine import AsyncEngine
from minedraft.engine.requests import EngineDeadError, OutputDelta, SamplingSettings


class DyingEngine:
    """Streams one token per request per step, then its step raises (a vLLM worker crash, say)."""

    settings = None

    def __init__(self, die_at_step: int) -> None:
        self.die_at_step = die_at_step
        self.steps = 0
        self.requests: list[str] = []

    def encode_prompt(self, prompt):
        return [1, 2, 3]

    def add_request(self, request_id, prompt_token_ids, sampling):
        self.requests.append(request_id)

    def abort(self, request_ids):
        self.requests = [r for r in self.requests if r not in request_ids]

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.steps += 1
        if self.steps >= self.die_at_step:
            raise RuntimeError("worker crashed")
        return [OutputDelta(r, [self.steps], "x") for r in self.requests]

    def shutdown(self):
        pass


async def test_streams_in_flight_end_with_engine_dead_and_new_work_is_refused():
    engine = AsyncEngine(DyingEngine(die_at_step=4))  # type: ignore[arg-type]
    received: list[int] = []
    with pytest.raises(EngineDeadError, match="worker crashed"):
        async for delta in engine.generate("hi", SamplingSettings(max_tokens=50), request_id="a"):
            received.extend(delta.token_ids)
    assert received == [1, 2, 3], "tokens before the crash were delivered"
    assert isinstance(engine.dead_error, RuntimeError)
    assert engine.num_in_flight == 0
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate("hi", SamplingSettings(max_tokens=5)):
            pass
    with pytest.raises(EngineDeadError):
        await engine.call(lambda e: e.steps)
    await engine.shutdown()


async def test_a_call_cancelled_while_queued_does_not_kill_the_loop():
    """A caller cancelled while its call waits behind another (a metrics poll when the server stops) must not take the
    engine loop down when the loop gets to it."""
    import asyncio
    import time

    engine = AsyncEngine(DyingEngine(die_at_step=1000))  # type: ignore[arg-type]
    try:
        slow = asyncio.ensure_future(engine.call(lambda e: time.sleep(0.3)))
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(engine.call(lambda e: e.steps))
        await asyncio.sleep(0.05)
        queued.cancel()
        await slow
        assert await engine.call(lambda e: "alive") == "alive" and engine.dead_error is None
    finally:
        await engine.shutdown()
