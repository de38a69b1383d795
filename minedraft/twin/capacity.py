"""What a GPU can hold and what a prompt costs: KV capacity per device and drafter placement, and prefill time.

Pure: plain numbers in, frozen dataclasses out; no clocks, no devices. The twin, `minedraft plan` and the autoscaler's
replica model read the same figures from here.

KV capacity is vLLM's accounting: the engine may use `gpu_memory_utilization` of each GPU's memory; from that it
subtracts the weights of every model on the GPU and a runtime reserve (activations at the peak of a prefill chunk,
CUDA graphs, non-torch allocations), and the rest is the KV block pool. Each request holds blocks for its whole
length (prompt + output + the draft slots a speculating engine reserves ahead) once it nears its end, so a replica
that never preempts holds at most pool / (per-request bytes) requests. A drafter placed on the target's GPU (vLLM's
colocated draft-model SD, or MineDraft's drafter sharing the GPU) takes its weights out of that memory and, because
its KV lives in the same block pool, adds its `kv_bytes_per_token` to every token the target stores; a drafter on
another device takes neither (its own device must hold its weights and KV: `drafter_device_concurrency`).

Prefill is priced from a measured `prefill_ms` shape of the curve file where there is one (a chunk of `tokens`
prompt tokens after `context` cached ones, batch 1). Older files have none: then a roofline estimate, labelled as
such, prices the prompt's FLOPs (2 x params per token plus attention over the prompt) at the rate the curves' most
compute-bound measured forward achieved on the same device.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from minedraft.twin.curves import CostCurves, CurveError, ModelCurves

GIB = 1024**3
MIB = 1024**2
# vLLM's default share of a GPU the engine may use.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# vLLM's KV block size (tokens): a request's KV is allocated in whole blocks.
BLOCK_TOKENS = 16
# Memory a target GPU keeps outside weights and KV: the activation peak of a prefill chunk, CUDA graphs' pools and
# non-torch allocations (NCCL, cuBLAS workspaces). An estimate, not measured: the engine's startup log reports the
# real figure ("model weights take ... ; non_torch_memory ... ; PyTorch activation peak memory ...").
DEFAULT_RUNTIME_RESERVE_BYTES = 2 * GIB

BYTES_PER_DTYPE = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "fp8": 1, "float8": 1}

# Where a mode's drafter lives, for capacity: "none" (plain decoding: no drafter loaded), "colocated" (on the
# target's GPU: weights and KV come out of the target's memory), "off-gpu" (its own device).
PLACEMENTS = ("none", "colocated", "off-gpu")

# Device memory as CUDA reports it (nvidia-smi's total, MiB) for the devices curve files name; public listings, not
# measured here. Matched case-insensitively against the curve file's `device` text, first match wins (H200 before
# H100, L40S before L4). A curve file's own `device_memory_bytes` takes precedence.
KNOWN_DEVICE_MEMORY_MIB: tuple[tuple[str, int], ...] = (
    ("H200", 143771),
    ("H100", 81559),
    ("A100", 81920),  # the 80 GB part; a 40 GB A100 needs device_memory_bytes
    ("L40S", 46068),
    ("L4", 23034),
    ("RTX 4090", 24564),
    ("A10", 23028),
    ("V100", 32768),  # the 32 GB part
)


@dataclass(frozen=True, slots=True)
class ModelFootprint:
    """What one model puts in GPU memory: its weights, and its KV cache per stored token."""

    name: str
    weight_bytes: int
    kv_bytes_per_token: int
    # Where weight_bytes came from: "params x dtype" or "estimated from config (...)".
    weight_source: str = "params x dtype"


@dataclass(frozen=True, slots=True)
class RequestShape:
    """The tokens one request stores at its longest."""

    prompt_tokens: int
    output_tokens: int
    # Draft slots a speculating engine reserves past the last accepted token (vLLM: num_lookahead_slots = k).
    lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0:
            raise ValueError(f"prompt_tokens: must be >= 0, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens: must be >= 1, got {self.output_tokens}")
        if self.lookahead_tokens < 0:
            raise ValueError(f"lookahead_tokens: must be >= 0, got {self.lookahead_tokens}")

    @property
    def tokens(self) -> int:
        """Tokens of KV the request holds at its end, in whole blocks."""
        raw = self.prompt_tokens + self.output_tokens + self.lookahead_tokens
        return BLOCK_TOKENS * math.ceil(raw / BLOCK_TOKENS)


@dataclass(frozen=True, slots=True)
class MemorySettings:
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    runtime_reserve_bytes: int = DEFAULT_RUNTIME_RESERVE_BYTES
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be within (0, 1], got {self.gpu_memory_utilization}")
        if self.runtime_reserve_bytes < 0:
            raise ValueError(f"runtime_reserve_bytes: must be >= 0, got {self.runtime_reserve_bytes}")
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError(f"tensor_parallel_size: must be between 1 and 64, got {self.tensor_parallel_size}")


@dataclass(frozen=True, slots=True)
class KvCapacity:
    """A replica's KV block pool and the requests of one shape it holds without preempting."""

    placement: str
    device_memory_bytes: int  # per GPU
    gpus: int  # the target's GPUs (tensor parallelism)
    usable_bytes: int  # gpu_memory_utilization of all of them
    weight_bytes: int  # the target's weights, plus a colocated drafter's
    reserve_bytes: int
    kv_pool_bytes: int
    kv_bytes_per_token: int  # the target's, plus a colocated drafter's
    kv_tokens: int  # tokens the pool holds (target tokens; a colocated drafter's ride along)
    request_tokens: int  # one request at its longest, in whole blocks
    max_concurrency: int

    def to_json(self) -> dict[str, object]:
        return {"placement": self.placement, "kv_pool_gib": round(self.kv_pool_bytes / GIB, 2),
                "kv_tokens": self.kv_tokens, "request_tokens": self.request_tokens,
                "max_concurrency": self.max_concurrency}


def kv_capacity(device_memory_bytes: int, target: ModelFootprint, drafter: ModelFootprint | None, placement: str,
                request: RequestShape, settings: MemorySettings = MemorySettings()) -> KvCapacity:
    """The KV pool of a replica whose target spans `settings.tensor_parallel_size` GPUs of `device_memory_bytes`
    each, with its drafter placed as `placement`, and the requests of shape `request` it holds at once.

    A colocated drafter is sharded like the target (vLLM's draft model runs at the target's tensor parallelism).
    `max_concurrency` is 0 when the weights do not fit."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement: expected one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if placement == "colocated" and drafter is None:
        raise ValueError("drafter: a colocated placement needs the drafter's footprint")
    if device_memory_bytes <= 0:
        raise ValueError(f"device_memory_bytes: must be positive, got {device_memory_bytes}")
    gpus = settings.tensor_parallel_size
    usable = int(gpus * device_memory_bytes * settings.gpu_memory_utilization)
    weights = target.weight_bytes
    per_token = target.kv_bytes_per_token
    if placement == "colocated" and drafter is not None:
        weights += drafter.weight_bytes
        per_token += drafter.kv_bytes_per_token
    reserve = gpus * settings.runtime_reserve_bytes
    pool = max(0, usable - weights - reserve)
    kv_tokens = pool // per_token
    return KvCapacity(placement=placement, device_memory_bytes=device_memory_bytes, gpus=gpus, usable_bytes=usable,
                      weight_bytes=weights, reserve_bytes=reserve, kv_pool_bytes=pool, kv_bytes_per_token=per_token,
                      kv_tokens=kv_tokens, request_tokens=request.tokens,
                      max_concurrency=kv_tokens // request.tokens)


def drafter_device_concurrency(device_memory_bytes: int, drafter: ModelFootprint, request: RequestShape,
                               gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                               window_tokens: int = 0,
                               runtime_reserve_bytes: int = DEFAULT_RUNTIME_RESERVE_BYTES) -> int:
    """Requests (over every replica it serves) a drafter on a device of its own holds KV for. `window_tokens` > 0:
    MineDraft's drafter window keeps at most that many positions (plus a few sinks) per request."""
    if device_memory_bytes <= 0:
        raise ValueError(f"device_memory_bytes: must be positive, got {device_memory_bytes}")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization: must be within (0, 1], got {gpu_memory_utilization}")
    pool = int(device_memory_bytes * gpu_memory_utilization) - drafter.weight_bytes - runtime_reserve_bytes
    tokens = request.tokens if window_tokens <= 0 else min(request.tokens,
                                                           BLOCK_TOKENS * math.ceil((window_tokens + 4) / BLOCK_TOKENS))
    return max(0, pool // (drafter.kv_bytes_per_token * tokens))


def placement_of(family: str, drafter_placement: str) -> str:
    """A mode family's drafter placement for capacity: plain decoding loads none; vLLM's draft-model SD puts it on
    the target's GPU; any of the engine's drafting modes (present or added later) follow the engine's drafter
    placement (the twin's Hardware.drafter_placement: "shared" is on the target's GPU, "own" on another device)."""
    if family in ("ar", "vllm-ar"):
        return "none"
    if family.startswith("vllm-sd"):
        return "colocated"
    return "colocated" if drafter_placement == "shared" else "off-gpu"


def dtype_bytes(dtype: str) -> int:
    found = BYTES_PER_DTYPE.get(dtype.lower().removeprefix("torch."))
    if found is None:
        raise CurveError("dtype", f"unknown dtype {dtype!r}; expected one of {', '.join(BYTES_PER_DTYPE)}")
    return found


def estimated_params(config: Mapping[str, int]) -> int:
    """A Llama/Qwen3-style decoder's parameters from its shape (untied LM head, as the profiler builds it)."""
    try:
        hidden, layers, heads = config["hidden"], config["layers"], config["heads"]
        kv_heads, head_dim, inter, vocab = config["kv_heads"], config["head_dim"], config["inter"], config["vocab"]
    except KeyError as exc:
        raise CurveError(f"config.{exc.args[0]}", "missing: needed to estimate the weights when params is null"
                         ) from None
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    per_layer = attention + 3 * hidden * inter + 2 * hidden + 2 * head_dim
    return 2 * vocab * hidden + layers * per_layer + hidden


def footprint(model: ModelCurves, dtype: str) -> ModelFootprint:
    """A curve file's model in memory: params (or, where null, the count its config implies) x the dtype's bytes."""
    size = dtype_bytes(dtype)
    if model.kv_bytes_per_token is None:
        raise CurveError(f"models.{model.name}.kv_bytes_per_token", "missing: needed for KV capacity")
    if model.params is not None:
        return ModelFootprint(model.name, model.params * size, model.kv_bytes_per_token)
    params = estimated_params(model.config)
    return ModelFootprint(model.name, params * size, model.kv_bytes_per_token,
                          weight_source=f"estimated from config ({params / 1e9:.2f}B params)")


def device_memory_bytes(curves: CostCurves, override: int | None = None) -> int:
    """The memory of one of the curve file's devices: `override`, else the file's `device_memory_bytes`, else the
    known-device table matched against its `device` text."""
    if override is not None:
        if override <= 0:
            raise ValueError(f"device_memory_bytes: must be positive, got {override}")
        return override
    if curves.device_memory_bytes is not None:
        return curves.device_memory_bytes
    return known_device_memory(curves.device)


def known_device_memory(device: str) -> int:
    for key, mib in KNOWN_DEVICE_MEMORY_MIB:
        if re.search(rf"\b{re.escape(key)}\b", device, re.IGNORECASE):
            return mib * MIB
    raise CurveError("device_memory_bytes", f"unknown memory for device {device!r}: add device_memory_bytes to the "
                                            f"curve file or give it on the command line")


def capacity_from_curves(curves: CostCurves, target: str, drafter: str | None, placement: str,
                         request: RequestShape, settings: MemorySettings = MemorySettings(),
                         memory_bytes: int | None = None) -> KvCapacity:
    """kv_capacity with the devices' memory and the models' footprints read from a curve file."""
    target_fp = footprint(curves.model(target, "target"), curves.dtype)
    drafter_fp = footprint(curves.model(drafter, "drafter"), curves.dtype) if drafter is not None else None
    return kv_capacity(device_memory_bytes(curves, memory_bytes), target_fp, drafter_fp, placement, request,
                       settings)


def mode_max_concurrency(curves: CostCurves, target: str, drafter: str | None, family: str, prompt_tokens: int,
                         output_tokens: int, *, drafter_placement: str = "own", k: int = 0,
                         gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                         tensor_parallel_size: int = 1, memory_bytes: int | None = None,
                         runtime_reserve_bytes: int = DEFAULT_RUNTIME_RESERVE_BYTES) -> KvCapacity:
    """The KV capacity of one replica running mode family `family` (ar, vllm-ar, sd, psd, vllm-sd, or a family added
    later: it follows the engine's drafter placement) on the curve file's device, for requests of `prompt_tokens` +
    `output_tokens`; a drafting family reserves `k` draft slots per request."""
    placement = placement_of(family, drafter_placement)
    drafting = placement != "none"
    request = RequestShape(prompt_tokens, output_tokens, lookahead_tokens=k if drafting else 0)
    settings = MemorySettings(gpu_memory_utilization, runtime_reserve_bytes, tensor_parallel_size)
    return capacity_from_curves(curves, target, drafter if placement == "colocated" else None, placement, request,
                                settings, memory_bytes)


# --- prefill -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefillTime:
    ms: float
    # "measured" (the curve file's prefill_ms shape, interpolated) or "estimate: ..." (a roofline, see the module).
    source: str
    extrapolated: bool = False


def prefill_ms(model: ModelCurves, prompt_tokens: int, context: int = 0,
               peak_flops: float | None = None, efficiency: float = 0.5) -> PrefillTime:
    """The time `model` takes to take in `prompt_tokens` prompt tokens after `context` cached ones (one request).

    From the curve file's `prefill_ms` shape where measured; otherwise a roofline estimate at the FLOP rate the
    model's most compute-bound measured forward achieved (batch x new_tokens largest); a model with no forward
    times (a drafter measured by draft loops only) needs `peak_flops` (the device's datasheet rate) and is priced
    at `efficiency` of it. Never below a one-token forward's time, where one is measured."""
    if prompt_tokens <= 0:
        return PrefillTime(0.0, "no prompt")
    if model.prefill is not None:
        ms, beyond = model.prefill.lookup(prompt_tokens, context)
        return PrefillTime(ms, "measured", beyond)
    flops = prompt_flops(model, prompt_tokens, context)
    if model.forward is not None:
        rate, where = achieved_flops_per_ms(model)
        ms = flops / rate
        floor = model.forward_ms(1, context, 1).ms
        return PrefillTime(max(ms, floor), f"estimate: roofline at the FLOP rate of its measured forward {where}")
    if peak_flops is None or peak_flops <= 0:
        raise CurveError(f"models.{model.name}.prefill_ms",
                         "no prefill or forward times measured: give the device's peak FLOP rate to estimate it")
    return PrefillTime(flops / (peak_flops * efficiency / 1000.0),
                       f"estimate: roofline at {efficiency:.0%} of a {peak_flops / 1e12:.0f} TFLOP/s peak")


def prompt_flops(model: ModelCurves, prompt_tokens: int, context: int = 0) -> float:
    """FLOPs of a prompt's forward: 2 x params per token plus causal attention (QK^T and PV) over the prompt and
    the cached context."""
    params = model.params if model.params is not None else estimated_params(model.config)
    layers = int(model.config.get("layers", 0))
    width = int(model.config.get("heads", 0)) * int(model.config.get("head_dim", 0))
    attended = prompt_tokens * (context + (prompt_tokens + 1) / 2)
    return 2.0 * params * prompt_tokens + 4.0 * layers * width * attended


def achieved_flops_per_ms(model: ModelCurves) -> tuple[float, str]:
    """The FLOP rate (per ms) of the model's most compute-bound measured forward, and where it was measured."""
    assert model.forward is not None
    best: tuple[int, int, int, float] | None = None
    for (context, new_tokens), cells in model.forward.cells.items():
        for batch, ms in cells.items():
            if best is None or batch * new_tokens > best[0] * best[2] or (
                    batch * new_tokens == best[0] * best[2] and context < best[1]):
                best = (batch, context, new_tokens, ms)
    assert best is not None
    batch, context, new_tokens, ms = best
    flops = batch * prompt_flops(model, new_tokens, context)
    return flops / ms, f"(batch {batch} x {new_tokens} tokens at context {context}: {flops / ms / 1e9:.0f} TFLOP/s)"
