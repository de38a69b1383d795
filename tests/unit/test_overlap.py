"""Async PSD steps' step loop (vllm_adapter/overlap.py) against a fake engine core: the order of schedules, model
calls and updates, and which thread runs the model."""

from __future__ import annotations

import contextlib
import threading
import time
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


# -- TP > 1: one non-blocking RPC per step to worker processes (WorkerProcesses) ------------------------------------


class Request:
    def __init__(self, request_id: str, group: int) -> None:
        self.request_id = request_id
        self.group = group


class PSDLikeScheduler:
    """Two sub-batches verified alternately, as PSDScheduler does: a step verifies one side; the next may be scheduled
    ahead while it is in flight, never with a request of a step still in flight, and each request's tokens must be
    updated before it is scheduled again. Asserts the invariants at every schedule and update."""

    def __init__(self, events: list[str], steps: int, requests_per_side: int = 3, ahead: bool = True) -> None:
        self.events = events
        # False: as sd, ar or one-sided psd (PSDScheduler never schedules ahead there).
        self.ahead = ahead
        self.left = steps
        self.requests = [Request(f"r{side}-{i}", side) for side in (0, 1) for i in range(requests_per_side)]
        # Output tokens committed per request (what the next verification of it builds on).
        self.tokens = {r.request_id: 0 for r in self.requests}
        self.in_flight: list[tuple[int, list[str], dict[str, int]]] = []
        self.scheduled = 0
        self.updated: list[int] = []
        self.worker_seconds: float | None = None
        self.worker_seconds_seen: list[float | None] = []
        self.lock = threading.Lock()

    def has_requests(self) -> bool:
        return self.left > 0

    def schedule(self, throttle: bool) -> Output:
        assert len(self.in_flight) <= 1, "a step was scheduled with two steps in flight"
        self.scheduled += 1
        self.left -= 1
        group = self.scheduled % 2
        busy = {rid for _, ids, _ in self.in_flight for rid in ids}
        ids = [r.request_id for r in self.requests if r.group == group]
        assert not busy & set(ids), f"step {self.scheduled} rescheduled requests in flight: {busy & set(ids)}"
        # What the step builds on: the tokens committed so far (a step scheduled before the update of the previous
        # step of the same side would read stale ones; the assertion above rules that out).
        self.in_flight.append((self.scheduled, ids, {rid: self.tokens[rid] for rid in ids}))
        self.events.append(f"schedule {self.scheduled}")
        return Output(self.scheduled)

    def may_schedule_ahead(self) -> bool:
        if not self.ahead or len(self.in_flight) != 1:
            return False
        _, ids, _ = self.in_flight[0]
        return any(r.request_id not in ids for r in self.requests)

    def get_grammar_bitmask(self, output: Output) -> str:
        return f"grammar {output.step}"

    def update_from_output(self, output: Output, model_output: Any) -> dict[int, Any]:
        step, ids, based_on = self.in_flight.pop(0)
        assert step == output.step, f"output of step {output.step} processed before step {step}'s"
        assert model_output == f"sampled {step}", model_output
        for rid in ids:
            assert self.tokens[rid] == based_on[rid]
            self.tokens[rid] += 1
        self.worker_seconds_seen.append(self.worker_seconds)
        self.worker_seconds = None
        self.updated.append(step)
        self.events.append(f"update {step}")
        return {0: step}


class FakeWorker:
    """A worker process: runs what it is sent, one call after another, on a thread of its own."""

    def __init__(self, events: list[str], forward_seconds: float) -> None:
        self.events = events
        self.forward_seconds = forward_seconds
        self.current: Output | None = None

    def execute_model(self, output: Output) -> None:
        self.events.append(f"execute {output.step}")
        self.current = output
        time.sleep(self.forward_seconds)
        return None

    def sample_tokens(self, grammar: str) -> str:
        assert self.current is not None and grammar == f"grammar {self.current.step}", grammar
        return f"sampled {self.current.step}"


class FakeMultiprocExecutor:
    """vLLM's MultiprocExecutor as the step loop uses it: collective_rpc(non_block=True) enqueues on the workers'
    queue and returns a future; the worker answers in order."""

    output_rank = 0

    def __init__(self, events: list[str], forward_seconds: float = 0.01) -> None:
        import queue

        self.worker = FakeWorker(events, forward_seconds)
        self.calls: list[tuple[Any, dict[str, Any]]] = []
        self.is_failed = False
        # Calls waiting in the queue as each call finished.
        self.pending_after: list[int] = []
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="fake-worker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            method, args, future = item
            try:
                result = method(self.worker, *args)
                self.pending_after.append(self._queue.qsize())
                future.set_result(result)
            except Exception as exc:  # handed to the caller, as the executor does
                future.set_exception(exc)

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple[Any, ...] = (),
                       non_block: bool = False, unique_reply_rank: int | None = None) -> Any:
        from concurrent.futures import Future

        self.calls.append((method, {"timeout": timeout, "non_block": non_block, "rank": unique_reply_rank}))
        future: Future[Any] = Future()
        self._queue.put((method, args, future))
        return future if non_block else future.result()

    def execute_model(self, output: Output, non_block: bool = False) -> Any:
        return self.collective_rpc(lambda worker, o: worker.execute_model(o), args=(output,), non_block=non_block)

    def sample_tokens(self, grammar: Any) -> Any:
        return self.collective_rpc(lambda worker, g: worker.sample_tokens(g), args=(grammar,))

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()


class WorkerProcessCore(FakeCore):
    def __init__(self, steps: int, forward_seconds: float = 0.01, ahead: bool = True) -> None:
        self.events = []
        self.scheduler = PSDLikeScheduler(self.events, steps, ahead=ahead)  # type: ignore[assignment]
        self.model_executor = FakeMultiprocExecutor(self.events, forward_seconds)  # type: ignore[assignment]
        self.step_fn = self.vllm_step


def run_on_workers(core: WorkerProcessCore) -> tuple[list[Any], OverlappedSteps]:
    from minedraft.engine.vllm_adapter.overlap import WorkerProcesses
    from minedraft.engine.vllm_adapter.worker_steps import execute_step

    overlap = OverlappedSteps(core, launcher=WorkerProcesses(core.model_executor, 30.0, execute_step))
    results = []
    try:
        while core.scheduler.has_requests() or overlap.num_in_flight:
            outputs, _ = core.step_fn()
            results.append(outputs)
    finally:
        overlap.shutdown()
        core.model_executor.stop()  # type: ignore[attr-defined]
    return results, overlap


def test_at_tp2_each_step_is_one_rpc_sent_before_the_previous_output_is_processed():
    from minedraft.engine.vllm_adapter.worker_steps import execute_step

    core = WorkerProcessCore(steps=8)
    results, overlap = run_on_workers(core)
    # Outputs handed back one step per call, in the order scheduled.
    assert results == [{0: i} for i in range(1, 9)]
    assert core.scheduler.updated == list(range(1, 9))  # type: ignore[attr-defined]
    events = core.events
    assert [e for e in events if e.startswith("execute")] == [f"execute {i}" for i in range(1, 9)]
    for n in range(1, 8):
        # Step n+1 was sent (scheduled) before step n's output was processed: the worker had it queued.
        assert events.index(f"schedule {n + 1}") < events.index(f"update {n}")
    # One non-blocking RPC per step: the worker-side step function, answered by the output rank, with a deadline.
    calls = core.model_executor.calls  # type: ignore[attr-defined]
    assert [method for method, _ in calls] == [execute_step] * 8
    assert all(options == {"timeout": 30.0, "non_block": True, "rank": 0} for _, options in calls)
    assert (overlap.counters.ahead, overlap.counters.inline) == (7, 0)
    # The update reads the worker's own time of the step (a ~10 ms forward), not the engine thread's wait.
    seen = core.scheduler.worker_seconds_seen  # type: ignore[attr-defined]
    assert len(seen) == 8 and all(s is not None and 0.009 < s < 1.0 for s in seen), seen


def test_at_tp2_the_engine_thread_schedules_while_the_worker_computes():
    """Step n+1 is scheduled (host work: planning, drafts, vLLM's scheduler) while the worker runs step n, with no
    thread of ours (the engine thread only enqueues): when the worker finishes a step the next one is already queued,
    so the worker never waits for the engine's host work."""
    core = WorkerProcessCore(steps=6, forward_seconds=0.05)
    schedule = core.scheduler.schedule
    schedule_threads = []

    def slow_schedule(throttle: bool) -> Output:
        schedule_threads.append(threading.current_thread().name)
        time.sleep(0.005)  # host work, well inside the worker's 50 ms forward
        return schedule(throttle)

    core.scheduler.schedule = slow_schedule  # type: ignore[method-assign]
    run_on_workers(core)
    # Steps waiting in the worker's queue when it finished each step: the next one, except after the last.
    assert core.model_executor.pending_after == [1, 1, 1, 1, 1, 0]  # type: ignore[attr-defined]
    assert schedule_threads == [threading.current_thread().name] * 6


def test_steps_that_cannot_be_scheduled_ahead_run_as_vllms_synchronous_step_on_the_workers():
    core = WorkerProcessCore(steps=3, ahead=False)
    results, overlap = run_on_workers(core)
    assert results == [{0: 1}, {0: 2}, {0: 3}]
    assert (overlap.counters.ahead, overlap.counters.inline) == (0, 3)
    assert core.events == ["schedule 1", "execute 1", "update 1", "schedule 2", "execute 2", "update 2",
                           "schedule 3", "execute 3", "update 3"]
    # vLLM's own two RPCs per step (execute_model, then sample_tokens).
    assert len(core.model_executor.calls) == 6  # type: ignore[attr-defined]


def test_shutdown_with_a_step_in_flight_waits_for_it_and_puts_vllms_step_back():
    from minedraft.engine.vllm_adapter.overlap import WorkerProcesses

    core = WorkerProcessCore(steps=4)
    overlap = OverlappedSteps(core, launcher=WorkerProcesses(core.model_executor, 30.0))
    core.step_fn()  # two launched, the first processed: one still in flight
    assert overlap.num_in_flight == 1
    overlap.shutdown()
    core.model_executor.stop()  # type: ignore[attr-defined]
    assert overlap.num_in_flight == 0 and core.step_fn == core.vllm_step
    assert core.events.count("execute 2") == 1
