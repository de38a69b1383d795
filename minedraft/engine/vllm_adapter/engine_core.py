"""The in-process vLLM engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0): what the engine reads and patches of it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def in_process_scheduler(llm_engine: Any) -> Any:
    """The scheduler object of an LLMEngine whose engine core runs in this process (vLLM's InprocClient)."""
    return llm_engine.engine_core.engine_core.scheduler


def in_process_core(llm_engine: Any) -> Any:
    """The EngineCore of an LLMEngine whose engine core runs in this process."""
    return llm_engine.engine_core.engine_core


def disable_envs_cache() -> None:
    """vLLM caches its environment once an engine is up (vllm.envs.enable_envs_cache): a later engine in this process
    (the test suite, bench, doctor) would read the first one's values, e.g. a TP=2 engine getting a TP=1 engine's
    one-core thread binding. Called after the process environment is set for a new engine."""
    import vllm.envs

    vllm.envs.disable_envs_cache()


@contextlib.contextmanager
def keep_distributed_state() -> Iterator[None]:
    """Shut an engine core down without tearing down vLLM's process-wide distributed state (parallel groups), which
    another engine still running in this process needs."""
    import vllm.v1.engine.core as vllm_core

    cleanup = vllm_core.cleanup_dist_env_and_memory
    vllm_core.cleanup_dist_env_and_memory = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        yield
    finally:
        vllm_core.cleanup_dist_env_and_memory = cleanup


def skip_draft_token_round_trip(core: Any) -> bool:
    """Stop vLLM's engine core asking the workers for in-worker drafts after every step (`post_step` calls
    `take_draft_token_ids`, a collective RPC to every worker at TP > 1, while the GPUs idle), where the answer is
    always discarded: MineDraft's in-worker proposer (NullProposer) proposes nothing and PSDScheduler's
    `update_draft_token_ids` ignores what comes back; the drafts come from the drafter process. Only for engines
    with MineDraft's scheduler (vLLM's own speculative decoding, vllm-sd, needs the round trip). Returns whether
    it was skipped."""
    from minedraft.engine.vllm_adapter.scheduler import PSDScheduler

    if not isinstance(core.scheduler, PSDScheduler) or not getattr(core, "check_for_draft_tokens", False):
        return False
    core.check_for_draft_tokens = False
    return True


def in_process_model_runner(llm_engine: Any) -> Any:
    """The model runner of a TP=1 in-process engine (its only worker runs in this process): for benchmarks that time
    the runner's own methods."""
    return in_process_core(llm_engine).model_executor.driver_worker.worker.model_runner


def step_launcher(llm_engine: Any, model_thread_init: Any) -> Any | None:
    """How this engine core's steps can be handed to the target without waiting (async PSD steps, overlap.py): a model
    thread for the in-process executor (TP = 1), one non-blocking RPC per step for vLLM's multiprocess executor
    (TP > 1; its futures are real). None for any other executor (Ray's, an external launcher's), and where the
    executor merges connector outputs (a KV or encoder-cache connector: vLLM's step RPCs pass its aggregator, which
    would not understand a step's (output, start, end) answer): those run synchronous steps."""
    import vllm.envs
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    from minedraft.engine.vllm_adapter.overlap import ModelThread, WorkerProcesses

    executor = in_process_core(llm_engine).model_executor
    if executor.kv_output_aggregator is not None or executor.ec_output_aggregator is not None:
        return None
    if isinstance(executor, MultiprocExecutor):
        return WorkerProcesses(executor, float(vllm.envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS))
    if type(executor) is UniProcExecutor:
        return ModelThread(executor, model_thread_init)
    return None


def model_thread_init(llm_engine: Any, bind_cores: Any) -> Any:
    """What a thread that runs the in-process model (async PSD steps) does first: `bind_cores()` (the target's CPU
    cores and thread count), and on a GPU the worker's device, which is per thread in CUDA (a new thread starts on
    device 0). Not run on a GPU yet: whether vLLM's GPU runner keeps any other per-thread state is unverified."""

    def init() -> None:
        bind_cores()
        device = getattr(in_process_core(llm_engine).model_executor.driver_worker.worker, "device", None)
        if device is not None and getattr(device, "type", "") == "cuda":
            import torch

            torch.cuda.set_device(device)

    return init
