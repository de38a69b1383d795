"""Async PSD steps' step loop (vllm_adapter/overlap.py) against a fake engine core: the order of schedules, model
calls and updates, and which thread runs the model."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from minedraft.engine.vllm_adapter.overlap import OverlappedSteps


class Output:
    def __init__(self, step: int) -> None:
        self.step = step
        self.total_num_scheduled_tokens = 1


class FakeScheduler:
    def __init__(self, events: list[str], steps: int, ahead: bool) -> None:
        self.events = events
        self.left = steps
        self.ahead = ahead
        self.scheduled = 0
        self.updated = 0
        self.worker_seconds: float | None = None

    def has_requests(self) -> bool:
        return self.left > 0

    def schedule(self, throttle: bool) -> Output:
        self.scheduled += 1
        self.left -= 1
        self.events.append(f"schedule {self.scheduled}")
        return Output(self.scheduled)

    def may_schedule_ahead(self) -> bool:
        # As PSDScheduler: at most one step in flight when the next is scheduled.
        return self.ahead and self.scheduled - self.updated == 1

    def get_grammar_bitmask(self, output: Output) -> None:
        return None

    def update_from_output(self, output: Output, model_output: Any) -> dict[int, Any]:
        assert model_output == f"sampled {output.step}"
        self.updated += 1
        self.events.append(f"update {output.step}")
        return {0: output.step}


class FakeExecutor:
    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.threads: list[str] = []
        self.current: Output | None = None

    def execute_model(self, output: Output, non_block: bool = False) -> Any:
        self.threads.append(threading.current_thread().name)
        self.events.append(f"execute {output.step}")
        self.current = output
        if non_block:
            from concurrent.futures import Future

            future: Future[Any] = Future()
            future.set_result(None)
            return future
        return None

    def sample_tokens(self, grammar: Any) -> str:
        assert self.current is not None
        return f"sampled {self.current.step}"


class FakeCore:
    def __init__(self, steps: int, ahead: bool) -> None:
        self.events: list[str] = []
        self.scheduler = FakeScheduler(self.events, steps, ahead)
        self.model_executor = FakeExecutor(self.events)
        self.step_fn = self.vllm_step

    def vllm_step(self) -> tuple[dict[int, Any], bool]:
        raise AssertionError("replaced")

    def _should_throttle_prefills(self) -> bool:
        return False

    @contextlib.contextmanager
    def capture_iteration_details(self, output: Any) -> Iterator[None]:
        yield None

    @contextlib.contextmanager
    def log_error_detail(self, output: Any) -> Iterator[None]:
        yield

    def _process_aborts_queue(self) -> None:
        pass

    def _attach_iteration_details(self, outputs: Any, details: Any) -> None:
        pass

    def _attach_weight_version(self, outputs: Any) -> None:
        pass


def run(core: FakeCore) -> list[Any]:
    overlap = OverlappedSteps(core)
    core.overlap = overlap  # type: ignore[attr-defined]
    results = []
    try:
        while core.scheduler.has_requests() or overlap.num_in_flight:
            outputs, _ = core.step_fn()
            results.append(outputs)
    finally:
        overlap.shutdown()
    assert core.step_fn == core.vllm_step, "shutdown puts vLLM's step back"
    return results


def test_each_step_is_scheduled_before_the_previous_update_and_after_the_one_before():
    core = FakeCore(steps=4, ahead=True)
    results = run(core)
    updates_and_schedules = [e for e in core.events if not e.startswith("execute")]
    assert updates_and_schedules == ["schedule 1", "schedule 2", "update 1", "schedule 3", "update 2", "schedule 4",
                                     "update 3", "update 4"]
    # Every engine call hands back exactly one step's output, in order.
    assert results == [{0: 1}, {0: 2}, {0: 3}, {0: 4}]
    # The model ran on its own thread, in order.
    assert [e for e in core.events if e.startswith("execute")] == [f"execute {i}" for i in range(1, 5)]
    assert all(name.startswith("minedraft-model") for name in core.model_executor.threads)
    assert (core.overlap.counters.ahead, core.overlap.counters.inline) == (3, 0)  # type: ignore[attr-defined]
    assert core.scheduler.worker_seconds is not None, "the model thread's time is handed to the update"


def test_without_a_step_to_schedule_ahead_each_step_is_vllms_synchronous_step_on_the_calling_thread():
    core = FakeCore(steps=3, ahead=False)
    run(core)
    assert core.events == ["schedule 1", "execute 1", "update 1", "schedule 2", "execute 2", "update 2",
                           "schedule 3", "execute 3", "update 3"]
    assert core.model_executor.threads == [threading.current_thread().name] * 3
    assert (core.overlap.counters.ahead, core.overlap.counters.inline) == (0, 3)  # type: ignore[attr-defined]


def test_the_next_step_starts_on_the_model_thread_before_the_previous_output_is_processed():
    core = FakeCore(steps=3, ahead=True)
    run(core)
    # execute n+1 comes before update n: the model thread took it up before this thread processed step n's output.
    events = core.events
    assert events.index("execute 2") < events.index("update 1")
    assert events.index("execute 3") < events.index("update 2")
