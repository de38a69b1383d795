"""Drive a synchronous Engine step by step: arrivals at given steps, aborts after given token counts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from minedraft.engine.core import Engine
from minedraft.engine.requests import Completion, SamplingSettings


@dataclass(frozen=True)
class Planned:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSettings
    arrive_at_step: int = 0
    abort_after_tokens: int | None = None


@dataclass
class RunResult:
    completions: dict[str, Completion] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    steps: int = 0


def drive(engine: Engine, plan: list[Planned], max_steps: int = 5000, between_steps: Callable[[], None] | None = None
          ) -> RunResult:
    result = RunResult()
    pending = sorted(plan, key=lambda p: p.arrive_at_step)
    by_id = {p.request_id: p for p in plan}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrive_at_step <= step:
            p = pending.pop(0)
            engine.add_request(p.request_id, p.prompt_token_ids, p.sampling)
            result.completions[p.request_id] = Completion(p.request_id)
        if engine.has_unfinished_requests():
            for delta in engine.step():
                completion = result.completions[delta.request_id]
                completion.add(delta)
                limit = by_id[delta.request_id].abort_after_tokens
                if limit is not None and not delta.finished and len(completion.token_ids) >= limit:
                    engine.abort([delta.request_id])
                    result.aborted.add(delta.request_id)
        if between_steps is not None:
            between_steps()
        step += 1
        if step > max_steps:
            raise AssertionError(f"engine did not finish within {max_steps} steps")
    result.steps = step
    return result


def reference(engine: Engine, prompts: list[list[int]], sampling: SamplingSettings) -> list[list[int]]:
    """Outputs of all prompts run together as one batch."""
    plan = [Planned(f"ref-{i}", p, sampling) for i, p in enumerate(prompts)]
    run = drive(engine, plan)
    return [run.completions[f"ref-{i}"].token_ids for i in range(len(prompts))]


def drafter_keeps_up(engine: Engine, timeout_seconds: float = 120.0) -> Callable[[], None]:
    """For `drive(between_steps=...)`: after each step, let the drafter finish every job it holds, as a drafter on a
    device of its own keeps up with the target. On this CPU a tiny target's step can be a few milliseconds while a
    draft job takes tenths of a second, so tests about which requests get drafts would otherwise hang on timing."""
    import time

    scheduler = engine.psd_scheduler
    assert scheduler is not None

    def wait() -> None:
        deadline = time.monotonic() + timeout_seconds
        while scheduler.link.jobs and time.monotonic() < deadline:
            scheduler.core.poll_drafter(0.05)
            scheduler.link.check()

    return wait
