"""What `minedraft plan` knows about a deployment beyond step costs: the KV capacity each mode holds, prefill priced
from the curves, the drafter's device (its costs carried there by a labelled roofline when it is not the curve
file's), and the prices of the devices. Modes are taken by family from the sweep's labels, so a mode added to the
twin later is held, placed and priced by the same rules (see capacity.placement_of) without change here.

Imports nothing of the replica loop at module level: the CLI's parser is built without zmq.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from minedraft.twin.capacity import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_RUNTIME_RESERVE_BYTES,
    GIB,
    KvCapacity,
    PrefillTime,
    RequestShape,
    drafter_device_concurrency,
    dtype_bytes,
    footprint,
    mode_max_concurrency,
    placement_of,
    prefill_ms,
)
from minedraft.twin.costs import AcceptanceModel, Hardware, StepCosts
from minedraft.twin.curves import CostCurves, CurveError, ModelCurves
from minedraft.twin.devices import FLOPS_EFFICIENCY, DeviceSpec, curves_device, device_spec, move_model
from minedraft.twin.pricing import EXAMPLE_PRICES, Layout, PriceTable

if TYPE_CHECKING:
    from minedraft.twin.plan import Band
    from minedraft.twin.sweep import LoadResult, SweepSettings

Sweep = Callable[..., list["LoadResult"]]

# Host work a step adds at TP > 1, from the engine's code path: vLLM's synchronous EngineCore.step makes three
# round trips to the tensor-parallel workers through the multiprocess executor's message queue - execute_model,
# sample_tokens, and post_step's take_draft_token_ids, whose reply (the in-worker NullProposer's empty drafts) the
# PSD scheduler discards, since MineDraft attaches the drafter's tokens itself. At TP = 1 all three are calls in the
# engine's own process. The price of one round trip is an estimate (not measured on a GPU): `rpc_round_trip_ms`.
TP_ROUND_TRIPS_PER_STEP = 3
DEFAULT_RPC_ROUND_TRIP_MS = 0.2


def family_of(label: str) -> str:
    """sd-k3 -> sd, vllm-sd-k3 -> vllm-sd, psd-async-k5 -> psd-async, ar -> ar (as the sweep's labels)."""
    if label.startswith("vllm-sd"):
        return "vllm-sd"
    return label.split("-k")[0]


@dataclass(frozen=True)
class DeploymentModel:
    costs: StepCosts  # the curve file's devices: plain modes, vLLM's colocated SD, and a drafter on the same kind
    engine_costs: StepCosts  # the engine's drafting modes: the drafter on its own device (moved there when asked)
    target_device: DeviceSpec
    drafter_device: DeviceSpec | None  # the engine's drafter's own device (placement own); None when shared
    # Which models' costs are a roofline estimate carried from the curve file's device ("target", "drafter").
    estimated: tuple[str, ...]
    measured_on: str
    request: RequestShape
    gpu_memory_utilization: float
    runtime_reserve_bytes: int
    memory_bytes: int | None  # one target GPU; None: unknown (no KV limit)
    kv_limited: bool
    prices: PriceTable
    prefill: PrefillTime | None
    target: str
    drafter: str
    curves: CostCurves

    # -- capacity ----------------------------------------------------------------------------------------------

    def placement(self, label: str) -> str:
        return placement_of(family_of(label), self.costs.hardware.drafter_placement)

    def capacity(self, family: str, k: int = 0) -> KvCapacity | None:
        if self.memory_bytes is None:
            return None
        return mode_max_concurrency(
            self.curves, self.target, self.drafter, family, self.request.prompt_tokens, self.request.output_tokens,
            drafter_placement=self.costs.hardware.drafter_placement, k=k,
            gpu_memory_utilization=self.gpu_memory_utilization,
            tensor_parallel_size=self.costs.hardware.tensor_parallel_size, memory_bytes=self.memory_bytes,
            runtime_reserve_bytes=self.runtime_reserve_bytes)

    def drafter_device_limit(self) -> int | None:
        """Requests the engine's drafter device holds KV for (placement own); None where it has no device."""
        if self.drafter_device is None:
            return None
        fp = footprint(self.curves.model(self.drafter, "drafter"), self.curves.dtype)
        return drafter_device_concurrency(self.drafter_device.memory_bytes, fp, self.request,
                                          window_tokens=self.costs.hardware.drafter_window_tokens,
                                          runtime_reserve_bytes=self.runtime_reserve_bytes)

    def max_concurrency(self, family: str, k: int = 0) -> int | None:
        """The requests one replica of `family` holds at once: its target's KV pool and, off the GPU, the
        drafter device's."""
        capacity = self.capacity(family, k)
        if capacity is None:
            return None
        limit = capacity.max_concurrency
        if capacity.placement == "off-gpu":
            drafter_limit = self.drafter_device_limit()
            if drafter_limit is not None:
                limit = min(limit, drafter_limit)
        return limit

    def kv_limit(self, family: str, k: int) -> int:
        found = self.max_concurrency(family, k) if self.kv_limited else None
        return 2**31 if found is None else max(1, found)

    # -- devices and prices ------------------------------------------------------------------------------------

    def layout(self, label: str) -> Layout:
        tp = self.costs.hardware.tensor_parallel_size
        placement = self.placement(label)
        if placement != "off-gpu":
            return Layout(self.target_device.name, tp)
        drafter = self.drafter_device or self.target_device
        return Layout(self.target_device.name, tp, drafter.name, 1.0)

    # -- running -----------------------------------------------------------------------------------------------

    def sweep(self, acceptance: AcceptanceModel, settings: SweepSettings, sweep: Sweep) -> list[LoadResult]:
        """The sweep, each family on its own costs (the engine's drafting families on the drafter's device) and
        each held to its KV capacity."""
        settings = dataclasses.replace(settings, kv_limit=self.kv_limit)
        if self.engine_costs is self.costs:
            return sweep(self.costs, acceptance, settings)
        engine = tuple(f for f in settings.families if placement_of(f, "own") == "off-gpu")
        others = tuple(f for f in settings.families if f not in engine)
        if not engine and not settings.with_auto and not settings.with_auto_async:
            return sweep(self.costs, acceptance, settings, progress=None)
        # Auto holds the engine's drafter device: it runs on the engine's costs.
        loads = sweep(self.engine_costs, acceptance, dataclasses.replace(settings, families=engine), progress=None)
        if others:
            rest = sweep(self.costs, acceptance, dataclasses.replace(settings, families=others, with_auto=False,
                                                                     with_auto_async=False), progress=None)
            for load, extra in zip(loads, rest, strict=True):
                load.runs.update(extra.runs)
        return loads

    def annotate(self, result: dict[str, Any]) -> None:
        """Adds to `plan`'s JSON: each mode's max_concurrency in every load, and what capacity, prefill and the
        drafter's device rest on."""
        for load in result["loads"]:
            for label, mode in load["modes"].items():
                k = int(mode.get("k") or 0) if label.startswith("auto") else _k_of(label)
                mode["max_concurrency"] = self.max_concurrency(family_of(label), k)
        families = sorted({family_of(label) for load in result["loads"] for label in load["modes"]})
        result["capacity"] = {
            "request_tokens": self.request.tokens, "gpu_memory_utilization": self.gpu_memory_utilization,
            "runtime_reserve_gib": round(self.runtime_reserve_bytes / GIB, 2),
            "device_memory_gib": None if self.memory_bytes is None else round(self.memory_bytes / GIB, 2),
            "kv_limited": self.kv_limited and self.memory_bytes is not None,
            "drafter_device_max_concurrency": self.drafter_device_limit(),
            "by_family": {f: _capacity_json(self.capacity(f), self.max_concurrency(f)) for f in families},
        }
        result["prefill"] = (None if self.prefill is None else
                             {"prompt_tokens": self.request.prompt_tokens, "ms": round(self.prefill.ms, 2),
                              "ms_per_token": round(self.costs.hardware.prefill_ms_per_token, 5),
                              "source": self.prefill.source})
        def source(role: str) -> str:
            return (f"estimate: roofline from the curves measured on {self.measured_on}" if role in self.estimated
                    else "measured (the curve file)")

        result["devices"] = {
            "target": {"device": self.target_device.name, "costs": source("target")},
            "drafter": {"device": (self.drafter_device or self.target_device).name,
                        "placement": self.costs.hardware.drafter_placement, "costs": source("drafter")}}
        result["prices"] = {"source": self.prices.source, "usd_per_hour": dict(self.prices.usd_per_hour)}

    def price_band(self, loads: Sequence[LoadResult], band: Band, output_tokens: int,
                   max_tpot_ms: float | None) -> dict[str, Any]:
        from minedraft.twin.plan import price_band

        def held(label: str) -> int:
            found = self.max_concurrency(family_of(label), _k_of(label))
            return -1 if found is None else found

        try:
            priced = price_band(loads, band, output_tokens, max_tpot_ms, self.layout, self.placement, held,
                                self.prices)
        except CurveError as exc:  # a device the price table does not know: everything else still holds
            return {"deployments": {}, "recommended": None, "unpriced": str(exc)}
        return {"deployments": priced["deployments"], "recommended": priced["recommended"]}


def _k_of(label: str) -> int:
    tail = label.rsplit("-k", 1)
    return int(tail[1]) if len(tail) == 2 and tail[1].isdigit() else 0


def _capacity_json(capacity: KvCapacity | None, held: int | None) -> dict[str, Any] | None:
    if capacity is None:
        return None
    return {**capacity.to_json(), "max_concurrency": held}


def deployment_model(curves: CostCurves, target: str, drafter: str, hardware: Hardware, *,
                     prompt_tokens: int, output_tokens: int, prefill_ms_per_token: float | None = None,
                     gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                     device_memory_gib: float | None = None,
                     runtime_reserve_bytes: int = DEFAULT_RUNTIME_RESERVE_BYTES, kv_limited: bool = True,
                     target_device: str | None = None, drafter_device: str | None = None,
                     prices: PriceTable = EXAMPLE_PRICES, drafter_curves: CostCurves | None = None,
                     rpc_round_trip_ms: float = DEFAULT_RPC_ROUND_TRIP_MS) -> DeploymentModel:
    """`target_device` / `drafter_device`: devices other than the curve file's, their costs carried there by the
    roofline (devices.move_model); vLLM's colocated drafter runs on the target's device. `drafter_curves`: the
    drafter measured on its own device (`minedraft profile --drafter-only`): the engine's drafter costs and device
    are that file's, measured, not estimated."""
    try:
        reference: DeviceSpec | None = curves_device(curves)
    except CurveError:
        reference = None
    if device_memory_gib is not None and device_memory_gib <= 0:
        raise CurveError("device_memory_gib", f"must be positive, got {device_memory_gib}")
    own = hardware.drafter_placement == "own"
    if drafter_device is not None and not own:
        raise CurveError("drafter_device", "a drafter device needs --drafter-placement own (shared: the target's GPU)")
    target_spec = device_spec(target_device) if target_device is not None else reference
    drafter_spec = device_spec(drafter_device) if drafter_device is not None else target_spec

    def on(model: ModelCurves, device: DeviceSpec | None) -> ModelCurves:
        if device is None or (reference is not None and device.name == reference.name):
            return model
        if reference is None:
            raise CurveError("drafter_device" if model.role == "drafter" else "target_device",
                             f"the curve file's device {curves.device!r} is not one the roofline knows: its costs "
                             "cannot be carried to another device")
        return move_model(model, dtype_bytes(curves.dtype), reference, device)

    if rpc_round_trip_ms < 0:
        raise CurveError("rpc_round_trip_ms", f"must be >= 0, got {rpc_round_trip_ms}")
    hardware = with_tp_host_work(hardware, rpc_round_trip_ms)
    target_model = on(curves.model(target, "target"), target_spec)
    drafter_model = curves.model(drafter, "drafter")
    colocated_drafter = on(drafter_model, target_spec)
    engine_drafter = on(drafter_model, drafter_spec) if own else colocated_drafter
    if drafter_curves is not None:
        if not own:
            raise CurveError("drafter_curves", "a drafter measured on its own device needs --drafter-placement own")
        if drafter_device is not None:
            raise CurveError("drafter_curves", "give the drafter's device by --drafter-device or by its measured "
                                               "curves, not both")
        engine_drafter = drafter_curves.model(drafter, "drafter")
        try:
            drafter_spec = curves_device(drafter_curves)
        except CurveError:  # a device the table does not know: its name as the file gives it (priced if listed)
            drafter_spec = DeviceSpec(drafter_curves.device, drafter_curves.device_memory_bytes or 0, 0.0, 0.0)
    memory = (int(device_memory_gib * GIB) if device_memory_gib is not None else
              curves.device_memory_bytes if curves.device_memory_bytes is not None and target_spec == reference else
              target_spec.memory_bytes if target_spec is not None and target_spec.name != "CPU" else None)
    target_spec = target_spec or DeviceSpec(curves.device, memory or 0, 0.0, 0.0)
    if memory is not None:
        target_spec = dataclasses.replace(target_spec, memory_bytes=memory)
    # Prefill: priced per prompt token at the workload's prompt length (per TP group: sharded like a forward).
    prefill: PrefillTime | None = None
    try:
        prefill = prefill_ms(target_model, prompt_tokens) if prefill_ms_per_token is None else None
    except CurveError:  # neither measured nor estimable (no params or shape in the file): left out, and said so
        prefill = None
    if prefill is not None:
        tp = hardware.tensor_parallel_size
        group_ms = prefill.ms if tp == 1 else (prefill.ms / tp
                                               + target_model.layers * hardware.all_reduce_us_per_layer / 1000.0)
        hardware = dataclasses.replace(hardware, prefill_ms_per_token=group_ms / prompt_tokens)
    costs = StepCosts(target_model, colocated_drafter, hardware)
    engine_costs = costs
    if engine_drafter is not colocated_drafter:
        drafter_hw = hardware
        if prefill is not None:  # its prompts, on its own device: measured there, or a roofline at its peak
            try:
                drafter_prefill = prefill_ms(engine_drafter, prompt_tokens,
                                             peak_flops=drafter_spec.peak_flops if drafter_spec else None,
                                             efficiency=FLOPS_EFFICIENCY)
                drafter_hw = dataclasses.replace(hardware,
                                                 drafter_prefill_ms_per_token=drafter_prefill.ms / prompt_tokens)
            except CurveError:  # not estimable: the target's price scaled by size (StepCosts' default)
                pass
        engine_costs = StepCosts(target_model, engine_drafter, drafter_hw)
    estimated = {name for name, model in (("target", target_model), ("drafter", engine_drafter))
                 if model is not curves.models[target if name == "target" else drafter]
                 and (drafter_curves is None or name == "target")}
    request = RequestShape(prompt_tokens, output_tokens)
    return DeploymentModel(costs, engine_costs, target_spec, drafter_spec if own else None,
                           tuple(sorted(estimated)), reference.name if reference else curves.device, request,
                           gpu_memory_utilization, runtime_reserve_bytes, memory, kv_limited, prices, prefill,
                           target, drafter, curves)


def with_tp_host_work(hardware: Hardware, rpc_round_trip_ms: float = DEFAULT_RPC_ROUND_TRIP_MS) -> Hardware:
    """`hardware` with each step's host work at TP > 1 raised by the round trips its code path makes to the
    tensor-parallel workers (TP_ROUND_TRIPS_PER_STEP, one of them discarded); unchanged at TP = 1."""
    if hardware.tensor_parallel_size == 1 or rpc_round_trip_ms == 0:
        return hardware
    extra = TP_ROUND_TRIPS_PER_STEP * rpc_round_trip_ms

    def raised(table: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
        return tuple((requests, ms + extra) for requests, ms in table)

    return dataclasses.replace(
        hardware, step_overhead_ms=hardware.step_overhead_ms + extra,
        drafting_step_overhead_ms=(None if hardware.drafting_step_overhead_ms is None
                                   else hardware.drafting_step_overhead_ms + extra),
        step_overhead_ms_by_batch=raised(hardware.step_overhead_ms_by_batch),
        drafting_step_overhead_ms_by_batch=raised(hardware.drafting_step_overhead_ms_by_batch))
