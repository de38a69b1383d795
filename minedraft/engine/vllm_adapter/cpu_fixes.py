"""Corrections to vLLM 0.32's CPU backend that speculative sampling needs to be lossless.

vLLM's CPU stand-in for the rejection sampler's `expand_kernel` casts its output tensor to int64 before the C++
kernel fills it. For the float32 per-token temperatures (and top-p values) that cast makes a copy, the kernel
writes into the copy, and the real output keeps whatever memory `new_empty` returned. Target probabilities are then
computed at garbage temperatures, so at temperature > 0 speculative decoding on CPU (vLLM's own draft-model mode as
much as ours) samples from the wrong distribution. Greedy requests never reach this kernel.

We replace it through vLLM's supported override registry (`vllm.triton_utils.dispatcher.register_kernels`) with a
dtype-preserving version. GPU builds use the Triton kernel, which is correct, so nothing is changed there.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger(__name__)

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_batch_values(
    output: Any, input_val: Any, cu_num_tokens: Any, replace_from: Any, replace_to: Any,
    MAX_NUM_TOKENS: Any = None,  # the Triton kernel's parameter name, passed by keyword
) -> None:
    """output[tokens of request i] = input_val[i], with `replace_from` mapped to `replace_to`; any dtype."""
    import torch

    cumulative = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cumulative, prepend=cumulative.new_zeros(1))
    values = torch.where(
        input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val
    )
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()].copy_(expanded.to(output.dtype))


def apply_cpu_fixes() -> bool:
    """Install the corrected kernel when vLLM runs on the CPU platform; returns whether it did."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.triton_utils.dispatcher import register_kernels

    # Replacing the CPU platform's stand-in is the point: vLLM's "already registered. Overwriting." warning for it
    # would only alarm whoever reads the log, so it is held back for this one call.
    dispatcher_log = logging.getLogger("vllm.triton_utils.dispatcher")
    level = dispatcher_log.level
    dispatcher_log.setLevel(logging.ERROR)
    try:
        register_kernels({EXPAND_KERNEL: expand_batch_values})
    finally:
        dispatcher_log.setLevel(level)
    install_empty_safe_top_k()
    log.info("installed the dtype-preserving expand kernel for CPU speculative sampling")
    return True


class CpuFixesWorkerExtension:
    """Named in vLLM's `worker_extension_cls` so every worker process applies the correction.

    With tensor parallelism the target runs in worker processes of its own, where an in-process apply_cpu_fixes()
    in the engine's process never reaches. vLLM resolves (imports) this class in each worker right after the CPU
    platform registers its kernel stand-ins (WorkerWrapperBase.init_worker), so the import below is the hook: it runs
    after the stand-in it replaces, in the process that computes. (A `vllm.general_plugins` entry point runs before
    that registration and would be overwritten by it.) Its one method lets tests ask every worker.
    """

    def minedraft_cpu_fixes_installed(self) -> bool:
        return cpu_fixes_installed()


def cpu_fixes_installed() -> bool:
    """Whether this process's rejection sampler runs the corrected kernel (always true off the CPU platform)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return True
    from vllm.triton_utils import dispatcher

    entry = dispatcher._registry.get(EXPAND_KERNEL)
    return entry is not None and entry[1] is expand_batch_values


TOP_K_MODULE = "vllm.v1.sample.ops.topk_topp_sampler"


def install_empty_safe_top_k() -> None:
    """vLLM 0.32's CPU top-k (`apply_top_k_only`) calls `k.max()` on an empty tensor when the rejection sampler has
    no draft positions for the batch's non-greedy requests (a top-k request prefilling, or decoding without drafts,
    beside requests that carry drafts) and raises: the step is lost and those requests never finish. An empty batch
    needs no masking, so it is returned as is. Idempotent."""
    import importlib

    namespace = vars(importlib.import_module(TOP_K_MODULE))
    original = namespace["apply_top_k_only"]
    if getattr(original, "minedraft_empty_safe", False):
        return

    def apply_top_k_only(logits: Any, k: Any) -> Any:
        if logits.shape[0] == 0:
            return logits
        return original(logits, k)

    apply_top_k_only.minedraft_empty_safe = True  # type: ignore[attr-defined]
    namespace["apply_top_k_only"] = apply_top_k_only


# Runs when vLLM imports this module in a worker (see CpuFixesWorkerExtension); idempotent, no-op on GPUs.
if "vllm.v1.worker.worker_base" in sys.modules:
    apply_cpu_fixes()
