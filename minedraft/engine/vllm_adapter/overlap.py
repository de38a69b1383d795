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
cannot be used as is on this path: its size comes from `VllmConfig.max_concurrent_batches`, which is 1 unless async
scheduling (refused with a custom proposer) or pipeline parallelism is on. How a step is handed to the target while
the engine thread goes on depends on the executor (the `launcher`):

- TP = 1, `ModelThread`: the in-process executor (vllm/v1/executor/uniproc_executor.py,
  `UniProcExecutor.collective_rpc`) runs `execute_model` inline even with `non_block=True`: its future is already
  done when returned, the model having run on the calling thread (only a GPU's asynchronous output copy makes it
  overlap there). So the model runs on one thread of its own here, the engine's (scheduling, drafter I/O, output
  processing) meanwhile on the calling thread; torch's kernels release the GIL, so the two overlap on a CPU as well.
  One thread keeps the model runner's calls in order (execute n, sample n, execute n+1, ...), as the runner requires.
- TP > 1, `WorkerProcesses`: vLLM's multiprocess executor (`MultiprocExecutor.collective_rpc`, used in-process here
  too: the engine core runs in this process, its workers in their own) enqueues an RPC on the workers' broadcast
  queue and, with `non_block=True`, returns a future at once; each worker runs its RPCs one after another in the
  order sent. A step is one RPC (worker_steps.execute_step: the worker's execute_model and sample_tokens, and its
  own start and end), so the workers take step n+1 up the moment step n is done, while this thread processes step
  n's output. No thread of ours: the engine thread only enqueues and later reads the answer. The worker's own input
  preparation for a step (`_update_states`, `_prepare_inputs`) runs in the worker, inside its step, as at TP = 1.

Invariants: at most one step in flight when the next is scheduled; a request in flight is never scheduled again
until its step's output has been processed (the scheduler holds it out); a step's output is processed before any
step that needs its tokens is scheduled (the sub-batch verified at n is next scheduled at n+2, after n's update);
outputs are processed in the order the steps were scheduled.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

# A step's model-runner output, and when the worker started and finished it (time.perf_counter seconds).
WorkerStep = tuple[Any, float, float]


@dataclass
class _Launched:
    scheduler_output: Any
    future: Future[WorkerStep]
    # Set when the target takes the step up (the model thread), or at once (worker processes: their queue is theirs).
    started: threading.Event


@dataclass
class OverlapCounters:
    """How the steps ran."""

    # Steps scheduled while the previous step was still in flight.
    ahead: int = 0
    # Steps that ran as vLLM's synchronous step (nothing in flight when scheduled, model on the engine thread).
    inline: int = 0


class StepLauncher(Protocol):
    """Hands a scheduled step to the target without waiting for it; steps run in the order launched."""

    def launch(self, scheduler_output: Any, grammar_output: Any) -> tuple[Future[WorkerStep], threading.Event]: ...

    def shutdown(self, in_flight: list[Future[WorkerStep]]) -> None:
        """Let the steps in flight finish (their outputs are dropped: the engine is going away), then stop."""


class ModelThread:
    """TP = 1 (in-process executor): the model runs on one thread of its own."""

    def __init__(self, executor: Any, init: Callable[[], None] | None = None) -> None:
        self._executor = executor
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minedraft-model", initializer=init)

    def launch(self, scheduler_output: Any, grammar_output: Any) -> tuple[Future[WorkerStep], threading.Event]:
        started = threading.Event()
        return self._pool.submit(self._execute, scheduler_output, grammar_output, started), started

    def _execute(self, scheduler_output: Any, grammar_output: Any, started_event: threading.Event) -> WorkerStep:
        """On the model thread: the runner's execute and sample calls of one step, and when the worker ran it."""
        started_event.set()
        started = time.perf_counter()
        model_output = self._executor.execute_model(scheduler_output)
        if model_output is None:
            model_output = self._executor.sample_tokens(grammar_output)
        return model_output, started, time.perf_counter()

    def shutdown(self, in_flight: list[Future[WorkerStep]]) -> None:
        self._pool.shutdown(wait=True)


class WorkerProcesses:
    """TP > 1 (vLLM's multiprocess executor): one non-blocking collective RPC per step, answered by the output rank."""

    def __init__(self, executor: Any, timeout_seconds: float | None,
                 execute_step: Callable[..., WorkerStep] | None = None) -> None:
        """`timeout_seconds`: the longest a step's answer may take once sent (vLLM's own for its step RPCs is
        VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS); `execute_step`: what each worker runs (worker_steps.execute_step)."""
        if execute_step is None:
            from minedraft.engine.vllm_adapter.worker_steps import execute_step as worker_execute_step

            execute_step = worker_execute_step
        self._executor = executor
        self._execute_step = execute_step
        self._timeout_seconds = timeout_seconds
        self._taken_up = threading.Event()
        self._taken_up.set()

    def launch(self, scheduler_output: Any, grammar_output: Any) -> tuple[Future[WorkerStep], threading.Event]:
        future: Future[WorkerStep] = self._executor.collective_rpc(
            self._execute_step, args=(scheduler_output, grammar_output), unique_reply_rank=self._executor.output_rank,
            non_block=True, timeout=self._timeout_seconds)
        return future, self._taken_up

    def shutdown(self, in_flight: list[Future[WorkerStep]]) -> None:
        if getattr(self._executor, "is_failed", False):
            return  # a worker died: nothing will answer (the executor is shutting itself down)
        for future in in_flight:
            # Shutting down: a failed step's error was the step's to report.
            with contextlib.suppress(Exception):
                future.result()


class OverlappedSteps:
    """The engine core's step function with async PSD steps."""

    def __init__(self, core: Any, model_thread_init: Callable[[], None] | None = None,
                 launcher: StepLauncher | None = None) -> None:
        self.core = core
        self.counters = OverlapCounters()
        self._in_flight: deque[_Launched] = deque()
        self._launcher = launcher if launcher is not None else ModelThread(core.model_executor, model_thread_init)
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
        with self.core.log_error_detail(scheduler_output):
            future, started = self._launcher.launch(scheduler_output, grammar_output)
        self._in_flight.append(_Launched(scheduler_output, future, started))

    def _finish_oldest(self) -> dict[int, Any]:
        core = self.core
        launched = self._in_flight.popleft()
        scheduler_output = launched.scheduler_output
        with core.capture_iteration_details(scheduler_output) as details, core.log_error_detail(scheduler_output):
            model_output, started, finished = launched.future.result()
            if self._in_flight:
                # Let the model thread take the next step up before this thread processes the output: otherwise this
                # thread keeps the GIL through update_from_output while the model thread waits for it (up to
                # Python's switch interval), and the target idles for the length of the update. (Worker processes
                # have it queued already.)
                self._in_flight[0].started.wait()
        core._process_aborts_queue()
        core.scheduler.worker_seconds = finished - started
        outputs: dict[int, Any] = core.scheduler.update_from_output(scheduler_output, model_output)
        core._attach_iteration_details(outputs, details)
        core._attach_weight_version(outputs)
        return outputs

    def shutdown(self) -> None:
        """Let the steps in flight finish (their outputs are dropped: the engine is going away), then stop."""
        self._launcher.shutdown([launched.future for launched in self._in_flight])
        self._in_flight.clear()
        self.core.step_fn = self._vllm_step
