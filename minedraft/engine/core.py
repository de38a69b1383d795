"""One engine replica: vLLM's V1 engine with our scheduler in this process, the drafter in its own.

The engine core runs in-process (vLLM's InprocClient) so the scheduler's per-step statistics are plain objects the
rest of the product reads directly. The target worker is bound to its own cores, the drafter to others.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from minedraft.engine.control.auto import AutoSettings, Decision
from minedraft.engine.control.cost_model import Prediction
from minedraft.engine.control.stats import EngineTotals, StepRecord
from minedraft.engine.drafter.backends import context_overrides
from minedraft.engine.placement import (
    ComputePlacement,
    DevicePlan,
    check_model_pair,
    cpu_thread_binding,
    detect_device,
    narrow_visible_devices,
    plan_devices,
    resolved_settings,
)
from minedraft.engine.requests import OutputDelta, RequestError, SamplingSettings, TokenLogprob, encode_prompt
from minedraft.engine.settings import EngineSettings, Mode, SchedulerSettings
from minedraft.engine.vllm_adapter import (
    PROPOSER_CLASS,
    SCHEDULER_CLASS,
    WORKER_EXTENSION_CLASS,
    check_vllm_version,
)
from minedraft.engine.vllm_adapter.cpu_fixes import apply_cpu_fixes
from minedraft.engine.vllm_adapter.engine_core import (
    disable_envs_cache,
    in_process_core,
    in_process_scheduler,
    keep_distributed_state,
    model_thread_init,
    skip_draft_token_round_trip,
    step_launcher,
)
from minedraft.engine.vllm_adapter.overlap import OverlappedSteps

log = logging.getLogger(__name__)


BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"


def deterministic_environment(settings: EngineSettings, plan: DevicePlan) -> dict[str, str]:
    """vLLM's switch for --deterministic: its batch-invariant mode on GPUs (read by every GPU worker at its start,
    which inherits this process's environment); "0" otherwise, so an inherited 1 cannot turn it on unasked. CPUs need
    none: float32 there is batch-invariant (resolve_for_device refuses --deterministic with another dtype). Pure."""
    on_gpu = plan.target_visible_devices is not None
    return {BATCH_INVARIANT_ENV: "1" if settings.deterministic and on_gpu else "0"}


def _configure_process(settings: EngineSettings, plan: DevicePlan) -> None:
    # The engine core must live in this process (statistics, invariants); vLLM reads these lazily.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # Tensor-parallel workers are started by spawn, never fork (vLLM's default on GPUs until CUDA is initialised).
    # This process already runs threads by then (`minedraft serve`: gRPC's, the HTTP server's, ZMQ's for the
    # drafter, the engine's own), and a forked child inherits their locks in whatever state they were, held ones
    # included: a worker that hangs at start or in its first collective. vLLM's own API server makes the same choice.
    # Spawned workers import this code afresh (the worker extension class re-installs the CPU corrections there).
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    if plan.target_visible_devices is not None:
        # The target (and its tensor-parallel workers, which inherit this) sees exactly its own GPUs. CUDA is not
        # initialised yet in this process: detect_device counts GPUs through NVML.
        narrow_visible_devices(os.environ, plan.target_visible_devices)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(settings.kv_cache_gib)))
    os.environ.update(deterministic_environment(settings, plan))
    if settings.tensor_parallel_size > 1 and plan.target_visible_devices is None:
        # CPU tensor parallelism: one worker process per rank, each bound to its own cores ("0|1").
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(
            settings.target_cpu_cores, settings.tensor_parallel_size, tuple(sorted(os.sched_getaffinity(0))))
    elif settings.target_cpu_cores:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in settings.target_cpu_cores)
        # One OpenMP thread per bound core, set before vLLM binds them: vLLM 0.32 binds the threads to these cores
        # but then refuses to lower torch's thread count ("doesn't allow torch.set_num_threads after the thread
        # binding"), leaving more threads than cores. On this machine that made every parallel kernel pay for a
        # thread sharing its core: the slot-mapping kernel took 4.5 ms per step instead of 4 us.
        import torch

        torch.set_num_threads(len(settings.target_cpu_cores))
    # A later engine in this process must not read an earlier one's cached vLLM environment (e.g. a TP=2 engine
    # getting a TP=1 engine's one-core thread binding: "CPU id list ['0'] doesn't match local world size 2").
    disable_envs_cache()


# Engines alive in this process (ids): the last one to shut down tears down vLLM's process-wide state.
_LIVE_ENGINES: set[int] = set()


def drafter_process_settings(settings: EngineSettings, plan: DevicePlan | None = None) -> dict[str, Any]:
    drafter = settings.drafter
    return {
        "model": drafter.model,
        "backend": drafter.backend,
        "cpu_cores": list(drafter.cpu_cores),
        "gpu_index": drafter.gpu_index,
        # The drafter's device as the pod names it (an entry of the inherited CUDA_VISIBLE_DEVICES); None: CPU.
        "cuda_visible_devices": plan.drafter_visible_devices if plan is not None else None,
        "gpu_memory_utilization": drafter.gpu_memory_utilization,
        "kv_cache_gib": drafter.kv_cache_gib,
        "drafter_window": drafter.window,
        # A target stretched past its native context (--hf-overrides with RoPE scaling): its drafter too.
        "hf_overrides": context_overrides(settings.extra_vllm_args.get("hf_overrides")),
        # 0: vLLM fits the draft's own context length to its KV cache.
        "max_model_len": settings.max_model_len,
        "max_num_seqs": settings.max_num_seqs,
        "dtype": settings.dtype,
        "seed": settings.seed,
    }


def overlap_possible(settings: EngineSettings) -> bool:
    """Whether this engine can run async PSD steps: a mode with sub-batches (psd, sd or auto: sd and auto can switch
    to psd at run time). At TP = 1 the model then runs on a thread of its own, at TP > 1 each step is one non-blocking
    RPC to the worker processes (vllm_adapter/overlap.py); an executor that offers neither runs synchronous steps
    (vllm_adapter/engine_core.step_launcher)."""
    return settings.mode.uses_drafter


def engine_args(settings: EngineSettings) -> Any:
    """vLLM engine arguments for a mode (pure apart from vLLM's own argument object)."""
    from vllm import EngineArgs

    common: dict[str, Any] = {
        "model": settings.model,
        "dtype": settings.dtype,
        # -1: the model's own context length, or what the KV cache holds if that is less (vLLM's auto-fit).
        "max_model_len": settings.max_model_len or -1,
        "max_num_seqs": settings.max_num_seqs,
        "seed": settings.seed,
        "disable_log_stats": False,
        "tensor_parallel_size": settings.tensor_parallel_size,
    }
    if settings.gpu_memory_utilization is not None:
        common["gpu_memory_utilization"] = settings.gpu_memory_utilization
    # With tensor parallelism the workers are processes of their own: the CPU kernel correction must be installed
    # in each of them too (importing the extension's module does it; harmless in-process and on GPUs), and resident
    # sub-batches are switched on in each of them through the extension's methods.
    common["worker_extension_cls"] = WORKER_EXTENSION_CLASS
    common.update(settings.extra_vllm_args)
    if settings.mode is Mode.AR:
        return EngineArgs(**common)
    if settings.mode is Mode.VLLM_SD:
        return EngineArgs(
            **common,
            speculative_config={
                "method": "draft_model",
                "model": settings.drafter.model,
                "num_speculative_tokens": settings.num_speculative_tokens,
            },
            per_request_spec_decode_metrics="summary",
        )
    return EngineArgs(
        **common,
        scheduler_cls=SCHEDULER_CLASS,
        speculative_config={
            "method": "custom_class",
            "model": PROPOSER_CLASS,
            "num_speculative_tokens": settings.max_draft_tokens_per_request,
        },
        per_request_spec_decode_metrics="summary",
        additional_config={"minedraft": SchedulerSettings.from_engine(
            settings,
            drafter=drafter_process_settings(settings),
            async_steps=settings.async_psd_steps and overlap_possible(settings),
            # Only a single in-process CPU worker can widen onto the drafter's cores.
            lend_cpu_cores=settings.drafter.cpu_cores if settings.lend_drafter_cores
            and settings.drafter.gpu_index is None and settings.tensor_parallel_size == 1 else (),
        ).to_config()},
    )


def vllm_sampling_params(sampling: SamplingSettings, max_tokens: int, detokenize: bool = True) -> Any:
    """vLLM's sampling parameters of a request (streamed as deltas). Without detokenisation vLLM takes no stop
    strings: whoever detokenises matches them."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import RequestOutputKind

    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=sampling.seed,
            stop=(list(sampling.stop) or None) if detokenize else None,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            ignore_eos=sampling.ignore_eos,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            logprobs=sampling.logprobs,
            output_kind=RequestOutputKind.DELTA,
            detokenize=detokenize,
        )
    except (ValueError, VLLMClientError) as exc:
        # vLLM's own checks at request creation: a value they refuse is the request's fault (INVALID_ARGUMENT naming
        # the field), never an unhandled error (a 500 the SDKs retry). The server's checks refuse such values first;
        # this keeps a check vLLM adds later from becoming a 500.
        parameter = getattr(exc, "parameter", None)
        field_name = f"sampling_params.{parameter}" if parameter else "sampling_params"
        raise RequestError(field_name, str(exc.args[0]) if exc.args else repr(exc)) from exc


def token_logprobs(token_ids: Sequence[int], positions: Iterable[Mapping[int, Any]] | Any,
                   num_top: int) -> tuple[TokenLogprob, ...]:
    """vLLM's per-position log-probabilities ({token id: Logprob(logprob, rank)}: the chosen token and the top ones)
    as the engine's own: the chosen token's, and the `num_top` most likely tokens by rank. Under speculation vLLM's
    rejection sampler reports them for every accepted token from the target's own logits at that position, so they
    are the same as without speculation (tests/component/test_sampling_parity.py)."""
    out = []
    for token_id, position in zip(token_ids, positions, strict=False):
        top = sorted(((lp.rank, t, lp.logprob) for t, lp in position.items()
                      if lp.rank is not None and lp.rank <= num_top), key=lambda entry: entry[0])
        out.append(TokenLogprob(position[token_id].logprob, tuple((t, lp) for _, t, lp in top)))
    return tuple(out)


class Engine:
    """Synchronous engine: add requests, step, read deltas. Not thread-safe; AsyncEngine drives it from a thread."""

    def __init__(self, settings: EngineSettings) -> None:
        from vllm.v1.engine.llm_engine import LLMEngine

        started = time.perf_counter()
        # The adapters are written for one vLLM release: any other fails here, by name, not inside a step.
        check_vllm_version()
        # Before anything loads: concrete dtype and drafter backend for this machine, each process's devices, and a
        # draft model whose token ids are the target's.
        device = detect_device()
        settings = resolved_settings(settings, device)
        self.device_plan = plan_devices(settings, device)
        self.pair_check: dict[str, Any] | None = None
        # (A shared drafter service holds the draft model: it checks every token id against its vocabulary.)
        remote_drafter = settings.drafter.address is not None and settings.mode.uses_drafter
        if (settings.mode.uses_drafter or settings.mode is Mode.VLLM_SD) and not remote_drafter:
            self.pair_check = check_model_pair(settings.model, settings.drafter.model, settings.drafter.backend
                                               if settings.mode.uses_drafter else "vllm")
        self.settings = settings
        _configure_process(settings, self.device_plan)
        drafter = None
        # The torch drafter sizes its KV cache by the context length: with the length left to vLLM it starts once the
        # target's is known (it loads in seconds). The vLLM drafter fits its own and starts first, loading meanwhile.
        drafter_after_target = settings.drafter.backend == "torch" and not settings.max_model_len
        if settings.mode.uses_drafter and not drafter_after_target:
            drafter = self._start_drafter(settings)
        try:
            self._llm = LLMEngine.from_engine_args(engine_args(settings))
        except BaseException:
            if drafter is not None:
                drafter.shutdown()
            raise
        _LIVE_ENGINES.add(id(self))
        # From here on settings.max_model_len is the length vLLM chose (the servicer's limits read it).
        self.settings = settings = settings.with_changes(max_model_len=int(self._llm.model_config.max_model_len))
        if settings.mode.uses_drafter and drafter_after_target:
            drafter = self._start_drafter(settings)
        # After the engine: its in-process worker has just registered the CPU platform's kernels.
        apply_cpu_fixes()
        if settings.mode is not Mode.VLLM_SD:
            # vLLM's own speculative decoding (the anchor) keeps vLLM's sampling; every engine mode of ours keys it.
            self.set_reproducible_seeds(settings.reproducible_seeds)
        if settings.mode.uses_drafter and settings.resident_sub_batches:
            # After the KV cache is sized: the runner's persistent batch has its final block sizes by now.
            self.set_resident_sub_batches(True)
        if drafter is not None:
            scheduler = self.psd_scheduler
            assert scheduler is not None
            scheduler.attach_drafter(drafter)
        # One worker round trip less per step (a collective RPC at TP > 1) whose answer is always discarded.
        skip_draft_token_round_trip(in_process_core(self._llm))
        self.overlap: OverlappedSteps | None = None
        if overlap_possible(settings):
            # Installed on every engine that could use it, so async steps can be switched on and off at run time
            # (benchmarks compare both in one run); with them off each step is exactly vLLM's EngineCore.step.
            # At TP = 1 the model thread computes on the target's own cores (a new thread starts with the process's
            # affinity and OpenMP's default thread count, not the engine thread's binding).
            model_placement = ComputePlacement(settings.target_cpu_cores, ())
            launcher = step_launcher(self._llm, model_thread_init(self._llm, lambda: model_placement.apply(wide=False)))
            if launcher is not None:
                self.overlap = OverlappedSteps(in_process_core(self._llm), launcher=launcher)
        scheduler = self.psd_scheduler
        if self.overlap is None and scheduler is not None:
            # No way to overlap on this executor: the core must not price or plan steps scheduled ahead.
            scheduler.core.async_steps = False
        self.tokenizer = self._llm.get_tokenizer()
        self.startup_seconds = time.perf_counter() - started
        self._prompt_lengths: dict[str, int] = {}
        self._output_counts: dict[str, int] = {}
        # Requests asking for log-probabilities: how many top tokens each wants per position.
        self._top_logprobs: dict[str, int] = {}
        log.info("engine (%s, %s on %s, %s steps) ready in %.1fs", settings.mode.value, settings.dtype,
                 "gpu" if device.has_gpu else "cpu", "async psd" if self.async_psd_steps else "synchronous",
                 self.startup_seconds)

    def _start_drafter(self, settings: EngineSettings) -> Any:
        if settings.drafter.address is not None:
            from minedraft.engine.drafter.remote import RemoteDrafterClient
            from minedraft.engine.drafter.wire import LiveTokens

            remote = RemoteDrafterClient(settings.drafter.address, LiveTokens(str(settings.drafter.token_file)),
                                         deadline_seconds=settings.drafter.deadline_seconds)
            remote.start()
            return remote
        from minedraft.engine.drafter.client import DrafterClient

        drafter = DrafterClient(
            drafter_process_settings(settings, self.device_plan),
            restart=settings.drafter.restart,
            startup_timeout_seconds=settings.drafter.startup_timeout_seconds,
        )
        drafter.start()
        return drafter

    # -- plumbing into vLLM's internals (pinned version) -------------------------------------------------------

    @property
    def scheduler(self) -> Any:
        """Our PSDScheduler (or vLLM's own scheduler for ar and vllm-sd)."""
        return in_process_scheduler(self._llm)

    @property
    def psd_scheduler(self) -> Any | None:
        from minedraft.engine.vllm_adapter.scheduler import PSDScheduler

        scheduler = self.scheduler
        return scheduler if isinstance(scheduler, PSDScheduler) else None

    def wait_for_drafter(self, timeout_seconds: float = 300.0) -> bool:
        scheduler = self.psd_scheduler
        if scheduler is None or scheduler.drafter is None:
            return True
        return bool(scheduler.drafter.wait_ready(timeout_seconds))

    # -- requests ----------------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, self.vocab_size, self.max_model_len)

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSettings,
                    detokenize: bool = True) -> None:
        """`detokenize=False`: token ids only, no text and no stop strings (an engine process's front end
        detokenises and matches stop strings itself, then aborts the request)."""
        from vllm.inputs import TokensPrompt

        sampling.validate()
        room = self.max_model_len - len(prompt_token_ids)
        params = vllm_sampling_params(sampling, min(sampling.max_tokens, room), detokenize)
        self._llm.add_request(request_id, TokensPrompt(prompt_token_ids=prompt_token_ids), params)
        self._prompt_lengths[request_id] = len(prompt_token_ids)
        self._output_counts[request_id] = 0
        if sampling.logprobs is not None:
            self._top_logprobs[request_id] = sampling.logprobs

    def abort(self, request_ids: list[str]) -> None:
        self._llm.abort_request(request_ids)
        for request_id in request_ids:
            self._prompt_lengths.pop(request_id, None)
            self._output_counts.pop(request_id, None)
            self._top_logprobs.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        # A step still in flight (async PSD steps) is finished by the next step() even if its requests were aborted.
        in_flight = self.overlap is not None and self.overlap.num_in_flight > 0
        return in_flight or bool(self._llm.has_unfinished_requests())

    def step(self) -> list[OutputDelta]:
        deltas = []
        for output in self._llm.step():
            completion = output.outputs[0] if output.outputs else None  # type: ignore[index]
            if completion is None:
                continue
            request_id = output.request_id
            count = self._output_counts.get(request_id, 0) + len(completion.token_ids)
            finished = bool(output.finished)
            drafted = accepted = 0
            metrics = getattr(completion, "spec_decode_metrics", None)
            if finished and metrics is not None:
                drafted = int(metrics.num_draft_tokens)
                accepted = sum(j * n for j, n in enumerate(metrics.histogram))
            deltas.append(
                OutputDelta(
                    request_id=request_id,
                    token_ids=list(completion.token_ids),
                    text=completion.text or "",
                    finish_reason=(completion.finish_reason or "stop") if finished else None,
                    num_prompt_tokens=self._prompt_lengths.get(request_id, 0),
                    num_output_tokens=count,
                    num_draft_tokens=drafted,
                    num_accepted_tokens=accepted,
                    logprobs=None if completion.logprobs is None else token_logprobs(
                        completion.token_ids, completion.logprobs, self._top_logprobs.get(request_id, 0)),
                )
            )
            if finished:
                self._prompt_lengths.pop(request_id, None)
                self._output_counts.pop(request_id, None)
                self._top_logprobs.pop(request_id, None)
            else:
                self._output_counts[request_id] = count
        return deltas

    # -- statistics and control --------------------------------------------------------------------------------

    def totals(self) -> EngineTotals:
        scheduler = self.psd_scheduler
        if scheduler is None:
            return EngineTotals()
        totals: EngineTotals = scheduler.core.stats.totals()
        if scheduler.drafter is not None:
            totals.drafter_restarts = scheduler.drafter.num_restarts
        return totals

    def step_records(self, since_step: int = -1) -> list[StepRecord]:
        scheduler = self.psd_scheduler
        return scheduler.core.stats.records(since_step) if scheduler is not None else []

    def set_mode(
        self,
        mode: Mode,
        k: int | None = None,
        num_extra_draft_tokens: int | None = None,
        auto_settings: AutoSettings | None = None,
    ) -> None:
        """Switch between psd, sd, ar and auto at the next step boundary; requests in flight carry on."""
        scheduler = self.psd_scheduler
        if scheduler is None:
            raise ValueError(f"mode: this engine was built for {self.settings.mode.value} and cannot switch")
        scheduler.core.set_mode(mode, k, num_extra_draft_tokens, auto_settings)

    @property
    def async_psd_steps(self) -> bool:
        """Whether psd steps are scheduled while the previous step computes (where they can be: see overlap.py)."""
        scheduler = self.psd_scheduler
        return self.overlap is not None and scheduler is not None and bool(scheduler.core.async_steps)

    def set_async_psd_steps(self, enabled: bool) -> None:
        """Switch async PSD steps on or off; a step in flight finishes with the next step() either way."""
        scheduler = self.psd_scheduler
        if self.overlap is None or scheduler is None:
            raise ValueError("async_psd_steps: needs a psd, sd or auto engine on vLLM's in-process (TP = 1) or "
                             "multiprocess (TP > 1) executor")
        scheduler.core.async_steps = enabled

    def set_reproducible_seeds(self, enabled: bool) -> None:
        """Seeded requests at temperature > 0 sample by randomness keyed by (seed, output position) (True), or by
        vLLM's per-request generator, whose draws shift with the drafts verified beside each token (False). Every
        worker, TP ranks too; takes effect from the next step."""
        if self.settings.mode is Mode.VLLM_SD:
            raise ValueError("reproducible_seeds: a vllm-sd engine samples as vLLM does")
        self._llm.collective_rpc("minedraft_set_reproducible_seeds", args=(enabled,))
        self.settings = self.settings.with_changes(reproducible_seeds=enabled)

    def set_resident_sub_batches(self, enabled: bool) -> None:
        """Keep both sub-batches resident in the target's model runner (True), or let vLLM's single persistent batch
        remove and re-add the requests left out of each step (False, for comparisons). Every worker, TP ranks too."""
        if not self.settings.mode.uses_drafter:
            raise ValueError(f"resident_sub_batches: a {self.settings.mode.value} engine verifies every request each "
                             "step and has no sub-batches")
        self._llm.collective_rpc("minedraft_set_resident_sub_batches", args=(enabled,))
        scheduler = self.psd_scheduler
        if scheduler is not None:
            scheduler.resident_sub_batches = enabled

    def resident_batch_sizes(self) -> list[list[int]]:
        """Per worker: requests held by each of the model runner's persistent batches."""
        return [list(sizes) for sizes in self._llm.collective_rpc("minedraft_resident_batch_sizes")]

    @property
    def max_model_len(self) -> int:
        """The context length vLLM runs with (the configured one, or the model's own fitted to the KV cache)."""
        return int(self._llm.model_config.max_model_len)

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary size (token ids must be below it)."""
        return int(self._llm.model_config.get_vocab_size())

    @property
    def configured_mode(self) -> Mode:
        """The mode asked for (auto included); `current_mode` is what the coming steps run."""
        scheduler = self.psd_scheduler
        return scheduler.core.configured_mode if scheduler is not None else self.settings.mode  # type: ignore[no-any-return]

    @property
    def current_mode(self) -> tuple[Mode, int]:
        """(mode, k) of the coming steps: the chosen mode (the fixed one, or auto's latest decision; a step runs ar
        instead while the drafter is down); k is 0 without drafts."""
        scheduler = self.psd_scheduler
        if scheduler is None:
            return self.settings.mode, self.settings.num_speculative_tokens if self.settings.mode is Mode.VLLM_SD else 0
        mode = scheduler.core.chosen_mode
        return mode, 0 if mode is Mode.AR else int(scheduler.core.k)

    def auto_decisions(self) -> list[Decision]:
        """Auto mode's switches, oldest first (the last few hundred)."""
        scheduler = self.psd_scheduler
        return scheduler.core.stats.decisions() if scheduler is not None else []

    def predictions(self, num_running: int, ks: tuple[int, ...] | None = None) -> list[Prediction]:
        """The cost model's predicted output tokens per second of ar, sd and psd (each k) at `num_running`."""
        scheduler = self.psd_scheduler
        if scheduler is None:
            return []
        candidates = ks or scheduler.core.auto_settings.k_candidates
        return scheduler.core.cost_model.predict_all(num_running, ("ar", "sd", "psd"), candidates)  # type: ignore[no-any-return]

    def load(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        running, waiting = self.scheduler.get_request_counts()
        return int(running), int(waiting)

    def kv_cache_usage(self) -> float:
        return float(self.scheduler.get_kv_cache_usage())

    def shutdown(self) -> None:
        _LIVE_ENGINES.discard(id(self))
        if self.overlap is not None:
            self.overlap.shutdown()
        try:
            if _LIVE_ENGINES:
                # The engine core runs in this process, and its shutdown tears down vLLM's process-wide
                # distributed state (parallel groups): another engine still running here (bench and doctor run
                # several, the test suite shares some) would then fail its next step with "pipeline model parallel
                # group is not initialized". Leave that state to the last engine.
                with keep_distributed_state():
                    self._llm.engine_core.shutdown()
            else:
                self._llm.engine_core.shutdown()
        except Exception:  # shutting down: report, do not mask the caller's own error
            log.exception("engine shutdown failed")
