"""Async PSD steps: step n+1 is scheduled, and its inputs prepared, while the target computes step n.

Consecutive PSD steps verify disjoint sub-batches. The sub-batch step n+1 verifies had its tokens final at the end of
step n-1 and its drafts made while step n runs, so nothing step n+1 needs depends on step n's output: it can be
scheduled before step n's output is processed, with no placeholder tokens and nothing to roll back (vLLM's own async
scheduling needs both only because it schedules the same requests again before their tokens are known). The
scheduler (PSDScheduler.may_schedule_ahead) says when this holds; every other step runs exactly as vLLM's
`EngineCore.step` does.

This replaces the in-process engine core's `step_fn`, as vLLM's own `EngineCore.step_with_batch_queue` would, but
with the scheduler deciding per step whether a second batch may be queued (vLLM's batch queue always fills itself,
which with sd/ar would schedule empty batches or, with async scheduling, need placeholders). vLLM's batch queue
cannot be used as is on this path for two reasons: its size comes from `VllmConfig.max_concurrent_batches`, which is
1 unless async scheduling (refused with a custom proposer) or pipeline parallelism is on; and the in-process
executor (vllm/v1/executor/uniproc_executor.py, `UniProcExecutor.collective_rpc`) runs `execute_model` inline even
with `non_block=True`: its future is already done when returned, the model having run on the calling thread (only
a GPU's asynchronous output copy makes it overlap there). So the model runs on one thread of its own here, the
engine's (scheduling, drafter I/O, output processing) meanwhile on the calling thread; torch's kernels release the
GIL, so the two overlap on a CPU as well. One thread keeps the model runner's calls in order
(execute n, sample n, execute n+1, ...), as the runner requires.

Invariants: at most one step in flight when the next is scheduled; a request in flight is never scheduled again
until its step's output has been processed (the scheduler holds it out); a step's output is processed before any
step that needs its tokens is scheduled (the sub-batch verified at n is next scheduled at n+2, after n's update).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass
class _Launched:
    scheduler_output: Any
    future: Future[tuple[Any, float, float]]
    # Set by the model thread when it takes the step up.
    started: threading.Event


@dataclass
class OverlapCounters:
    """How the steps ran."""

    # Steps scheduled while the previous step was still in flight.
    ahead: int = 0
    # Steps that ran as vLLM's synchronous step (nothing in flight when scheduled, model on the engine thread).
    inline: int = 0


class OverlappedSteps:
    """The engine core's step function with async PSD steps (TP=1, in-process executor only)."""

    def __init__(self, core: Any, model_thread_init: Callable[[], None] | None = None) -> None:
        self.core = core
        self.counters = OverlapCounters()
        self._in_flight: deque[_Launched] = deque()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minedraft-model",
                                        initializer=model_thread_init)
        self._vllm_step = core.step_fn
        core.step_fn = self.step

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def step(self) -> tuple[dict[int, Any], bool]:
        core = self.core
        scheduler = core.scheduler
        if not self._in_flight:
            if not scheduler.has_requests():
                return {}, False
            scheduler_output = scheduler.schedule(core._should_throttle_prefills())
            if not scheduler.may_schedule_ahead():
                self.counters.inline += 1
                return self._run_inline(scheduler_output)
            self._launch(scheduler_output)
        if scheduler.has_requests() and scheduler.may_schedule_ahead():
            # Scheduled (drafts waited for, inputs planned) while the step in flight computes.
            self._launch(scheduler.schedule(core._should_throttle_prefills()))
            self.counters.ahead += 1
        # The model-runner output of a step is never handed to vLLM's post_step here: it would read the runner from
        # this thread while the next step may be running on it, and our proposer proposes nothing anyway.
        return self._finish_oldest(), False

    def _run_inline(self, scheduler_output: Any) -> tuple[dict[int, Any], bool]:
        """vLLM's EngineCore.step after its schedule(), on this thread (widening onto the drafter's cores applies)."""
        core = self.core
        future = core.model_executor.execute_model(scheduler_output, non_block=True)
        grammar_output = core.scheduler.get_grammar_bitmask(scheduler_output)
        with core.capture_iteration_details(scheduler_output) as details, core.log_error_detail(scheduler_output):
            model_output = future.result()
            if model_output is None:
                model_output = core.model_executor.sample_tokens(grammar_output)
        core._process_aborts_queue()
        outputs = core.scheduler.update_from_output(scheduler_output, model_output)
        core._attach_iteration_details(outputs, details)
        core._attach_weight_version(outputs)
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    def _launch(self, scheduler_output: Any) -> None:
        grammar_output = self.core.scheduler.get_grammar_bitmask(scheduler_output)
        started = threading.Event()
        future = self._pool.submit(self._execute, scheduler_output, grammar_output, started)
        self._in_flight.append(_Launched(scheduler_output, future, started))

    def _execute(self, scheduler_output: Any, grammar_output: Any, started_event: threading.Event
                 ) -> tuple[Any, float, float]:
        """On the model thread: the runner's execute and sample calls of one step, and when the worker ran it."""
        started_event.set()
        executor = self.core.model_executor
        started = time.perf_counter()
        model_output = executor.execute_model(scheduler_output)
        if model_output is None:
            model_output = executor.sample_tokens(grammar_output)
        return model_output, started, time.perf_counter()

    def _finish_oldest(self) -> dict[int, Any]:
        core = self.core
        launched = self._in_flight.popleft()
        scheduler_output = launched.scheduler_output
        with core.capture_iteration_details(scheduler_output) as details, core.log_error_detail(scheduler_output):
            model_output, started, finished = launched.future.result()
            if self._in_flight:
                # Let the model thread take the next step up before this thread processes the output: otherwise this
                # thread keeps the GIL through update_from_output while the model thread waits for it (up to
                # Python's switch interval), and the target idles for the length of the update.
                self._in_flight[0].started.wait()
        core._process_aborts_queue()
        core.scheduler.worker_seconds = finished - started
        outputs: dict[int, Any] = core.scheduler.update_from_output(scheduler_output, model_output)
        core._attach_iteration_details(outputs, details)
        core._attach_weight_version(outputs)
        return outputs

    def shutdown(self) -> None:
        """Let the step in flight finish (its output is dropped: the engine is going away), then stop the thread."""
        self._pool.shutdown(wait=True)
        self._in_flight.clear()
        self.core.step_fn = self._vllm_step
