"""The engine's batch limit (`max_num_seqs`) sized from the KV cache its target GPU holds (opt-in:
`--max-num-seqs-from-kv TOKENS`).

When the drafter runs on a device of its own (psd, sd, auto), the memory a colocated drafter would take - its
weights, and its KV for every token, since vLLM's draft-model SD keeps both models' KV in one block pool - is KV
cache for the target; in vLLM's colocated SD (`--mode vllm-sd`) it is not. A fixed `--max-num-seqs` sized for the
colocated case leaves the freed memory unused; this sizes the limit from what the pool holds at a stated request
length instead (vLLM's accounting, minedraft.twin.capacity: the share of each GPU the engine may use, less weights
and a runtime reserve). Pure but for `gpu_memory_bytes` and `read_footprint`, which read NVML and a config file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from minedraft.engine.settings import SettingsError
from minedraft.twin.capacity import (
    DEFAULT_RUNTIME_RESERVE_BYTES,
    MemorySettings,
    ModelFootprint,
    RequestShape,
    estimated_params,
    kv_capacity,
)

# Never more than this many requests at once, whatever the memory (vLLM's CUDA-graph batch sizes stop at 512;
# beyond ~1024 decode steps are compute-bound and a larger batch only adds latency).
CEILING = 1024
BYTES_PER_DTYPE = {"bfloat16": 2, "float16": 2, "float32": 4}


def sized_max_num_seqs(memory_bytes_per_gpu: int, target: ModelFootprint, drafter: ModelFootprint | None,
                       colocated: bool, request_tokens: int, gpu_memory_utilization: float = 0.9,
                       tensor_parallel_size: int = 1, lookahead_tokens: int = 0, ceiling: int = CEILING,
                       runtime_reserve_bytes: int = DEFAULT_RUNTIME_RESERVE_BYTES) -> int:
    """The requests of `request_tokens` tokens (prompt + output) the target's KV pool holds at once, at least 1
    and at most `ceiling`. `colocated`: the drafter shares the target's GPUs (vLLM's SD); else it takes nothing
    there."""
    placement = "colocated" if colocated and drafter is not None else ("off-gpu" if drafter is not None else "none")
    capacity = kv_capacity(memory_bytes_per_gpu, target, drafter, placement,
                           RequestShape(max(0, request_tokens - 1), 1, lookahead_tokens),
                           MemorySettings(gpu_memory_utilization, runtime_reserve_bytes, tensor_parallel_size))
    return max(1, min(ceiling, capacity.max_concurrency))


def footprint_from_config(name: str, config: Any, dtype: str) -> ModelFootprint:
    """A Hugging Face config's weights and KV bytes per token in `dtype` (Llama/Qwen3-style decoders)."""
    c = getattr(config, "text_config", None) or config
    heads = int(c.num_attention_heads)
    head_dim = int(getattr(c, "head_dim", None) or int(c.hidden_size) // heads)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    shape = {"hidden": int(c.hidden_size), "layers": int(c.num_hidden_layers), "heads": heads,
             "kv_heads": kv_heads, "head_dim": head_dim, "inter": int(c.intermediate_size),
             "vocab": int(c.vocab_size)}
    size = BYTES_PER_DTYPE.get(dtype, 2)
    params = estimated_params(shape)
    if getattr(c, "tie_word_embeddings", False):
        params -= shape["vocab"] * shape["hidden"]
    return ModelFootprint(name, params * size, 2 * shape["layers"] * kv_heads * head_dim * size,
                          weight_source="from its config")


FLAG = "--max-num-seqs-from-kv"


def nvml_device(visible_index: int, env: Mapping[str, str] | None = None) -> int | str:
    """The NVML identity of visible GPU `visible_index`: NVML ignores CUDA_VISIBLE_DEVICES, so index i of the visible
    list is its i-th entry (a physical index, or a GPU/MIG UUID or UUID prefix) where it is set, else i itself."""
    inherited = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if inherited is None or inherited.strip() == "":  # as placement.detect_device reads it
        return visible_index
    entries = [d.strip() for d in inherited.split(",") if d.strip()]
    if not 0 <= visible_index < len(entries):
        raise SettingsError(FLAG, f"the target's GPU {visible_index} is not among CUDA_VISIBLE_DEVICES={inherited}")
    entry = entries[visible_index]
    return int(entry) if entry.isdigit() else entry


def _handle(nvml: Any, device: int | str) -> Any:
    if isinstance(device, int):
        return nvml.nvmlDeviceGetHandleByIndex(device)
    try:
        return nvml.nvmlDeviceGetHandleByUUID(device)
    except Exception:  # CUDA also takes a UUID's prefix; NVML only the whole UUID
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = nvml.nvmlDeviceGetUUID(handle)
            if (uuid.decode() if isinstance(uuid, bytes) else str(uuid)).startswith(device):
                return handle
        raise


def gpu_memory_bytes(index: int = 0, env: Mapping[str, str] | None = None) -> int | None:
    """The total memory of visible GPU `index` (mapped through CUDA_VISIBLE_DEVICES) through NVML (CUDA stays
    uninitialised); None without NVML or that GPU."""
    device = nvml_device(index, env)
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(_handle(pynvml, device)).total)
    except Exception:  # no NVML, no GPU: the caller keeps its fixed limit
        return None


def _footprint(role: str, model: str, dtype: str) -> ModelFootprint:
    """A model's footprint from its Hugging Face config; a config that cannot be read or sized is refused naming the
    flag that asked for it."""
    from transformers import AutoConfig

    try:
        return footprint_from_config(role, AutoConfig.from_pretrained(model), dtype)
    except (OSError, ValueError, AttributeError, TypeError, KeyError) as exc:
        raise SettingsError(FLAG, f"cannot size the batch from the {role}'s config ({model}): {exc}") from None


def resize(settings: Any, request_tokens: int, log: Any = None, ceiling: int = CEILING) -> Any:
    """`settings` (EngineSettings) with max_num_seqs sized from the target GPU's KV pool at `request_tokens` per
    request, at most `ceiling`; unchanged, and said through `log`, where there is no GPU to size it from."""
    index = settings.target_gpus[0] if settings.target_gpus else 0
    memory = gpu_memory_bytes(index)
    if memory is None:
        if log is not None:
            log(f"{FLAG}: no GPU memory to size from (NVML); keeping --max-num-seqs {settings.max_num_seqs}")
        return settings
    dtype = settings.dtype if settings.dtype in BYTES_PER_DTYPE else "bfloat16"
    target = _footprint("target", settings.model, dtype)
    drafter = _footprint("drafter", settings.drafter.model, dtype) if settings.drafter.model else None  # ar: none
    mode = getattr(settings.mode, "value", settings.mode)
    colocated = mode == "vllm-sd"
    # The KV slots a request holds for its drafts: the longest draft it may get (max_num_speculative_tokens alone is
    # None unless given, which only auto mode's command does).
    lookahead = 0 if mode == "ar" else settings.max_draft_tokens_per_request
    limit = sized_max_num_seqs(memory, target, drafter, colocated, request_tokens,
                               settings.gpu_memory_utilization or 0.9, settings.tensor_parallel_size,
                               lookahead_tokens=lookahead, ceiling=ceiling)
    if log is not None:
        log(f"{FLAG}: {limit} requests of {request_tokens} tokens fit the target's KV pool "
            f"(drafter {'on the target GPU' if colocated else 'off the target GPU'}; at most {ceiling})")
    return settings.with_changes(max_num_seqs=limit)
