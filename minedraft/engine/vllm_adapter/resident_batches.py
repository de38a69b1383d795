"""Two persistent batches in the target's model runner, so PSD's alternating sub-batches stay resident.

vLLM V1's model runner keeps one persistent `InputBatch` (token ids, block tables, sampling state per request) and
updates it incrementally: at the start of each step (`_update_states`) it removes every request that is not scheduled
in the step and re-adds it, copying its whole context, when it is next scheduled. PSD verifies sub-batch A, then B,
then A: with one persistent batch every request is removed and re-added every other step, O(context) each time
(vLLM's own comment warns about "alternating between two distinct sets of requests").

The scheduler side has the same pattern: vLLM's scheduler re-sends the full token list of every request that was
not scheduled in the previous step, for a path that is off here (`skip_token_resend`).

The runner here keeps two persistent batches and, at the start of each step, makes current the one that already holds
most of the step's requests (`choose_resident_batch`, a pure choice from request ids). The other batch keeps its
requests as they are until their turn. A request scheduled in a step always ends up in the current batch (vLLM's own
path adds it if it is not there), so it is first removed from the other one: each request lives in at most one batch,
and its entry is the one written the last time it was scheduled. Requests that did not run since are unchanged in the
runner (their tokens, blocks and sampling state change only when scheduled, or on preemption, which vLLM's path
handles through `resumed_req_ids`). Finished requests are removed from both. ar and sd schedule every request every
step: the same batch stays current and nothing changes from vLLM's behaviour.

It is installed per engine after the engine has started (the KV cache is sized and the input batch has its final
block sizes) by `collective_rpc` on every worker, tensor-parallel ranks included, through the worker extension named
in vLLM's `worker_extension_cls`: the runner object's class is swapped for a subclass that overrides
`_update_states`. It can be switched off and on at run time (benchmarks compare both in one run).

On GPUs the second batch's block-table and slot-mapping device tensors are the first batch's: they are rewritten
from the host copies at every step before any kernel reads them, and full CUDA graphs captured at start-up hold the
first batch's addresses, so both batches must feed the same ones. Sampling tensors are not shared (each batch copies
its own to the device only when its contents change).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from minedraft.engine.vllm_adapter.cpu_fixes import CpuFixesWorkerExtension

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResidentBatchChoice:
    """Which persistent batch a step runs in, and which requests leave the other one first."""

    current: int
    # Requests in the other batch that are scheduled in this step (they move to the current batch) or finished.
    evict_from_other: frozenset[str]


def choose_resident_batch(
    scheduled: Collection[str],
    finished: Collection[str],
    residents: Sequence[Collection[str]],
    current: int,
    resident_sub_batches: bool = True,
) -> ResidentBatchChoice:
    """The batch that makes the step cheapest becomes current: fewest requests added to it (the scheduled ones it does
    not hold, each a copy of its context) plus removed from a batch (its residents not scheduled, which vLLM's path
    removes, and the scheduled ones the other batch holds). That is the batch holding most of the step's requests;
    when neither holds any (the first steps) it is the emptier one, so the first two sub-batches land in different
    batches. Ties keep `current`, so ar's single batch never flips. With `resident_sub_batches` off it is always batch
    0: vLLM's own behaviour (the other batch only drains)."""
    if len(residents) != 2:
        raise ValueError(f"residents: expected two batches, got {len(residents)}")
    if not 0 <= current <= 1:
        raise ValueError(f"current: expected 0 or 1, got {current}")
    scheduled_set = frozenset(scheduled)
    finished_set = frozenset(finished)
    if resident_sub_batches:
        costs = []
        for index, batch in enumerate(residents):
            other = residents[1 - index]
            held = sum(1 for request_id in scheduled_set if request_id in batch)
            added = len(scheduled_set) - held
            unscheduled = sum(1 for request_id in batch if request_id not in scheduled_set
                              and request_id not in finished_set)
            moved_out = sum(1 for request_id in scheduled_set if request_id in other)
            costs.append(added + unscheduled + moved_out)
        chosen = current if costs[current] <= costs[1 - current] else 1 - current
    else:
        chosen = 0
    other = residents[1 - chosen]
    evict = frozenset(r for r in scheduled_set | finished_set if r in other)
    return ResidentBatchChoice(chosen, evict)


def skip_token_resend(scheduler: Any) -> None:
    """Before vLLM's `Scheduler.schedule()`: count every running request as scheduled in the previous step.

    vLLM's scheduler sends the whole token list of each request that was not scheduled in the previous step
    (`CachedRequestData.all_token_ids`, a copy per request, pickled to every tensor-parallel worker). Only the model
    runner's async-scheduling path reads it, and async scheduling is off with our scheduler; with alternating
    sub-batches it was a copy of half the running contexts every step. Requests resumed from preemption are not in
    `running` and still get theirs."""
    if scheduler.scheduler_config.async_scheduling or getattr(scheduler, "use_v2_model_runner", False):
        return
    scheduler.prev_step_scheduled_req_ids.update(request.request_id for request in scheduler.running)


# -- the model runner (vLLM 0.32 internals; imported only inside worker processes) -------------------------------


def _new_input_batch_like(runner: Any) -> Any:
    """A second persistent batch built as vLLM builds the runner's own (after the KV cache fixed its block sizes),
    with logits processors of its own (they keep per-row state)."""
    from vllm.v1.sample.logits_processor import build_logitsprocs
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import PIN_MEMORY

    first = runner.input_batch
    custom = runner.model_config.logits_processors
    batch = InputBatch(
        max_num_reqs=first.max_num_reqs,
        max_model_len=first.max_model_len,
        max_num_batched_tokens=first.max_num_batched_tokens,
        device=first.device,
        vocab_size=first.vocab_size,
        block_sizes=list(runner._init_block_sizes),
        max_num_blocks_per_req=list(runner._init_max_num_blocks),
        num_spec_tokens=runner.num_spec_tokens,
        logitsprocs=build_logitsprocs(runner.vllm_config, runner.device, PIN_MEMORY, runner.is_pooling_model,
                                      tuple(custom) if custom is not None else ()),
        logitsprocs_need_output_token_ids=first.logitsprocs_need_output_token_ids,
        is_pooling_model=runner.is_pooling_model,
        cp_kv_cache_interleave_size=runner.parallel_config.cp_kv_cache_interleave_size,
        reasoning_config=runner.vllm_config.reasoning_config,
        use_replayssm=runner.cache_config.use_replayssm,
        slot_mapping_modes=list(runner._init_slot_mapping_modes),
    )
    if hasattr(runner, "_postprocess_tensors"):
        # The CPU runner points every "device" tensor of its batch at the host copy; do the same for this one.
        runner.input_batch = batch
        try:
            runner._postprocess_tensors()
        finally:
            runner.input_batch = first
    else:
        for mine, theirs in zip(batch.block_table.block_tables, first.block_table.block_tables, strict=True):
            mine.block_table.gpu = theirs.block_table.gpu
            mine.slot_mapping.gpu = theirs.slot_mapping.gpu
    return batch


class ResidentBatchesRunner:
    """Mixed in front of the runner's own class (see install)."""

    minedraft_batches: list[Any]
    minedraft_current: int
    minedraft_resident: bool
    input_batch: Any

    def _update_states(self, scheduler_output: Any) -> Any:
        batches = self.minedraft_batches
        choice = choose_resident_batch(
            scheduler_output.num_scheduled_tokens.keys(), scheduler_output.finished_req_ids,
            [batch.req_id_to_index for batch in batches], self.minedraft_current, self.minedraft_resident)
        other = batches[1 - choice.current]
        if choice.evict_from_other:
            for request_id in choice.evict_from_other:
                other.remove_request(request_id)
            # vLLM leaves a batch consistent (no holes, logits processors told) within each step: do the same here.
            other.condense()
            other.refresh_metadata()
        self.minedraft_current = choice.current
        self.input_batch = batches[choice.current]
        return super()._update_states(scheduler_output)  # type: ignore[misc]


_SUBCLASSES: dict[type, type] = {}


def install(runner: Any, enabled: bool) -> None:
    """Give `runner` its second persistent batch (once) and switch resident sub-batches on or off."""
    if getattr(runner, "use_async_scheduling", False):
        # The async path keeps the previous step's sampled tokens indexed by the current batch's rows.
        raise ValueError("resident_sub_batches: not supported with async scheduling")
    if not isinstance(runner, ResidentBatchesRunner):
        base = type(runner)
        if base not in _SUBCLASSES:
            _SUBCLASSES[base] = type(f"Resident{base.__name__}", (ResidentBatchesRunner, base), {})
        second = _new_input_batch_like(runner)
        runner.minedraft_batches = [runner.input_batch, second]
        runner.minedraft_current = 0
        runner.__class__ = _SUBCLASSES[base]
    runner.minedraft_resident = enabled


class MineDraftWorkerExtension(CpuFixesWorkerExtension):
    """vLLM's `worker_extension_cls` for every engine: the CPU kernel correction (importing this module installs it in
    the worker process) and resident sub-batches, reached in every worker through `collective_rpc`."""

    model_runner: Any

    def minedraft_set_resident_sub_batches(self, enabled: bool) -> bool:
        install(self.model_runner, enabled)
        return enabled

    def minedraft_set_reproducible_seeds(self, enabled: bool) -> bool:
        """Key seeded sampling by (seed, output position) in this worker's runner (keyed_sampling.py), or not."""
        from minedraft.engine.vllm_adapter import keyed_sampling

        return keyed_sampling.install(self.model_runner, enabled)

    def minedraft_resident_batch_sizes(self) -> list[int]:
        """Requests held by each persistent batch (0 and 1; one entry when not installed)."""
        batches = getattr(self.model_runner, "minedraft_batches", [self.model_runner.input_batch])
        return [batch.num_reqs for batch in batches]
