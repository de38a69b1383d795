"""One engine step inside a tensor-parallel worker process, run as one RPC (async PSD steps at TP > 1).

vLLM's engine core sends a step to its workers as two collective RPCs, `execute_model` then `sample_tokens`. With
steps scheduled ahead (vllm_adapter/overlap.py) the engine sends one instead, this function, through the multiprocess
executor's non-blocking `collective_rpc`: every rank runs the same two calls of its worker, in the same order as
vLLM's two RPCs would run them, and the output rank answers with the step's output and when its worker started and
finished the step (its own clock: `time.perf_counter`, CLOCK_MONOTONIC on Linux, one clock for every process of the
machine). The engine reads the worker's time from it (the step's verify time: the engine thread's own clock would
count the wait behind the step before) and sends one message per step instead of two.

Passed to `collective_rpc` as a function: vLLM pickles it by reference (this module's name) and each worker calls it
with its `WorkerWrapperBase`, exactly the object vLLM's own RPCs reach (the wrapper's `execute_model` applies its
multimodal cache first, as for vLLM's RPC).
"""

from __future__ import annotations

import time
from typing import Any


def execute_step(worker: Any, scheduler_output: Any, grammar_output: Any) -> tuple[Any, float, float]:
    """On a worker: the step's forward and, where it has tokens to sample, its sampling; with the worker's start and
    end of the step. A step with nothing to sample has its output from `execute_model` (vLLM's protocol)."""
    started = time.perf_counter()
    output = worker.execute_model(scheduler_output)
    if output is None:
        output = worker.sample_tokens(grammar_output)
    get_output = getattr(output, "get_output", None)
    if callable(get_output):
        # An AsyncModelRunnerOutput (vLLM's async scheduling, which engines with MineDraft's scheduler refuse): the
        # executor resolves bare ones before answering; inside this tuple it would not.
        output = get_output()
    return output, started, time.perf_counter()
