"""Devices a deployment can put its models on, and a drafter's costs on a device nobody measured. Pure.

Each entry is a data-sheet figure (memory as CUDA reports it, peak memory bandwidth, dense bf16/fp16 tensor FLOP/s),
not a measurement. A drafter measured on one device (the curve file's) is carried to another by a roofline,
labelled as an estimate wherever it is shown: each measured shape's bytes (weights once per pass, plus the KV its
passes read) and FLOPs are timed at both devices' rates, at the share of data-sheet bandwidth the reference reached
(`BANDWIDTH_EFFICIENCY`: the H200 file's target reached 3.3 of 4.8 TB/s), and what the reference's time holds
beyond its roofline (kernel launches and small-kernel inefficiency: most of a small drafter's loop) is kept, scaled
by `overhead_scale` (1 on a GPU with CUDA graphs; larger on a CPU, which runs eagerly).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from minedraft.twin.capacity import KNOWN_DEVICE_MEMORY_MIB, MIB, estimated_params
from minedraft.twin.curves import CostCurves, CurveError, ModelCurves, _Grid

# The share of data-sheet bandwidth a decode forward reaches (the H200 file: 3.3 of 4.8 TB/s at small batch).
BANDWIDTH_EFFICIENCY = 0.7
# The share of data-sheet FLOP/s a compute-bound forward reaches (the H200 file's batch-128 verify: ~520 of 989).
FLOPS_EFFICIENCY = 0.5


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    peak_flops: float  # dense bf16 (fp16 where the device has no bf16)
    # What the reference's unexplained time (launches, small kernels) becomes on this device.
    overhead_scale: float = 1.0
    note: str = ""

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "memory_gib": round(self.memory_bytes / 1024**3, 1),
                "bandwidth_tb_per_s": self.bandwidth_bytes_per_s / 1e12, "peak_tflops": self.peak_flops / 1e12,
                "note": self.note}


def _mib(key: str) -> int:
    return dict(KNOWN_DEVICE_MEMORY_MIB)[key] * MIB


# Data-sheet figures (public listings; not measured by the project).
DEVICES: dict[str, DeviceSpec] = {spec.name: spec for spec in (
    DeviceSpec("H200", _mib("H200"), 4.8e12, 989e12),
    DeviceSpec("H100", _mib("H100"), 3.35e12, 989e12, note="SXM"),
    DeviceSpec("A100", _mib("A100"), 2.04e12, 312e12, note="80 GB SXM"),
    DeviceSpec("L40S", _mib("L40S"), 0.864e12, 362e12),
    DeviceSpec("L4", _mib("L4"), 0.300e12, 121e12),
    DeviceSpec("RTX 4090", _mib("RTX 4090"), 1.008e12, 165e12, note="fp16 tensor FLOP/s with fp32 accumulation"),
    DeviceSpec("A10", _mib("A10"), 0.600e12, 125e12),
    DeviceSpec("V100", _mib("V100"), 0.900e12, 125e12, note="32 GB; no bf16: the drafter runs in fp16"),
    # One 32-core Xeon socket with AMX and 8 DDR5-4800 channels; eager execution (no CUDA graphs): its per-kernel
    # overhead taken as 5x a GPU's with graphs, the docs' eager-vs-graphs drafting ratio. A rough estimate.
    DeviceSpec("CPU", 256 * 1024**3, 0.307e12, 60e12, overhead_scale=5.0,
               note="one 32-core Xeon socket with AMX, 8 x DDR5-4800; eager: rough estimate"),
)}


def device_spec(name: str) -> DeviceSpec:
    """A device by name (case-insensitive; "rtx4090" and "RTX 4090" alike), or the first whose name a longer
    description contains ("NVIDIA H200 (141 GB HBM3e, one GPU)")."""
    wanted = re.sub(r"[\s_-]", "", name).lower()
    for key, spec in DEVICES.items():
        if re.sub(r"\s", "", key).lower() == wanted:
            return spec
    for key, spec in DEVICES.items():
        if re.search(rf"\b{re.escape(key)}\b", name, re.IGNORECASE):
            return spec
    raise CurveError("drafter_device", f"unknown device {name!r}; known: {', '.join(DEVICES)}")


def curves_device(curves: CostCurves) -> DeviceSpec:
    """The device a curve file was measured on (its memory from the file where given)."""
    spec = device_spec(curves.device)
    if curves.device_memory_bytes is not None:
        return dataclasses.replace(spec, memory_bytes=curves.device_memory_bytes)
    return spec


@dataclass(frozen=True, slots=True)
class _Roofline:
    weight_bytes: float
    kv_bytes_per_token: float
    params: float
    layers: int
    attention_width: int

    def bytes_and_flops(self, batch: int, context: int, passes: int, tokens: int) -> tuple[float, float]:
        """`passes` forwards over `batch` requests at `context`, `tokens` new tokens per request over all passes."""
        kv = passes * batch * context * self.kv_bytes_per_token
        flops = 2.0 * self.params * batch * tokens + 4.0 * self.layers * self.attention_width * batch * tokens * context
        return passes * self.weight_bytes + kv, flops


def _seconds(spec: DeviceSpec, nbytes: float, flops: float) -> float:
    return max(nbytes / (spec.bandwidth_bytes_per_s * BANDWIDTH_EFFICIENCY),
               flops / (spec.peak_flops * FLOPS_EFFICIENCY))


def move_model(model: ModelCurves, dtype_bytes: int, reference: DeviceSpec, device: DeviceSpec) -> ModelCurves:
    """`model`'s curves carried from `reference` (where they were measured) to `device` by the roofline above.
    Every measured shape maps to the same shape; nothing is invented beyond the grid."""
    if reference == device:
        return model
    params = float(model.params if model.params is not None else estimated_params(model.config))
    if model.kv_bytes_per_token is None:
        raise CurveError(f"models.{model.name}.kv_bytes_per_token", "missing: needed to move it to another device")
    roof = _Roofline(params * dtype_bytes, float(model.kv_bytes_per_token), params, model.layers,
                     int(model.config.get("heads", 0)) * int(model.config.get("head_dim", 0)))

    def moved(ms: float, nbytes: float, flops: float) -> float:
        ref_s = _seconds(reference, nbytes, flops)
        other_s = max(0.0, ms / 1000.0 - ref_s) * device.overhead_scale / reference.overhead_scale
        return 1000.0 * (_seconds(device, nbytes, flops) + other_s)

    forward = loop = None
    if model.forward is not None:
        forward = _Grid(model.forward.name, {
            (context, q): {b: moved(ms, *roof.bytes_and_flops(b, context, 1, q)) for b, ms in cells.items()}
            for (context, q), cells in model.forward.cells.items()})
    if model.draft_loop is not None:
        # A k-token draft: one pass over k + 1 tokens, then k - 1 one-token passes.
        loop = _Grid(model.draft_loop.name, {
            (context, k): {b: moved(ms, *roof.bytes_and_flops(b, context, k, 2 * k)) for b, ms in cells.items()}
            for (context, k), cells in model.draft_loop.cells.items()})
    catch_up = model.catch_up_ms_per_token
    if catch_up is not None:  # prompt-like work: compute-bound, scales with FLOP/s
        catch_up *= reference.peak_flops / device.peak_flops
    return dataclasses.replace(model, forward=forward, draft_loop=loop, catch_up_ms_per_token=catch_up,
                               prefill=None)
