"""What a step and a draft cost on a stated hardware layout, from cost curves; and the acceptance model.

Tensor parallelism is a stated model, not a measurement: a target forward over TP GPUs takes the single-GPU time
divided by TP plus `all_reduce_us_per_layer` for each of the target's layers (two all-reduces per layer, attention
and MLP, given together). The drafter runs on a GPU of its own (`drafter_placement="own"`: sd leaves it idle while
the target verifies, psd overlaps the two) or on the target's first GPU (`"shared"`): then drafting and verifying
that overlap in time contend for the device, and `shared_contention` of the overlap is added to both (1.0: the two
serialise, what two memory-bound kernels sharing HBM bandwidth do; 0.0: perfect overlap). vLLM's colocated SD
(`vllm-sd`) drafts on the target's GPUs with the target's tensor parallelism, in sequence with verification.
A drafter window (`drafter_window_tokens`, MineDraft's `--drafter-window`) caps the context the drafter's KV reads
see at the window plus its attention sinks; vLLM's colocated drafter has none.

Host work per step (`step_overhead_ms`: scheduling, planning, input preparation, output processing) is a separate,
stated cost: the curves hold forward passes only. The engine's synchronous steps (ar, sd, psd, auto) pay it in
series with the step's forward pass. vLLM's own modes, plain decoding (`vllm-ar`) and colocated SD (`vllm-sd`), run
with async scheduling (Model Runner V2 on GPUs), which prepares step n+1 while step n computes: there a step costs
max(host, device) instead of the sum (`vllm_async_scheduling`; vLLM turns async scheduling off on CPUs). The
engine's psd with async steps (`--async-psd-steps`) hides it the same way, where the engine runs them.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from minedraft.twin.curves import CostCurves, CurveError, ModelCurves

# The fixed-mode families the twin can run (auto runs besides them). `vllm-ar`: plain decoding in vLLM itself (no
# MineDraft: async scheduling hides the host work); `psd-async`: the engine's psd with --async-psd-steps;
# `lookahead`: the whole batch verified while the drafter pre-drafts the next round's likely outcomes.
FIXED_FAMILIES = ("ar", "vllm-ar", "sd", "psd", "psd-async", "lookahead", "vllm-sd")
# What `minedraft plan` runs unless told otherwise (the engine's defaults: psd steps synchronous).
DEFAULT_FAMILIES = ("ar", "vllm-ar", "sd", "psd", "lookahead", "vllm-sd")
# Families without a draft length.
PLAIN_FAMILIES = ("ar", "vllm-ar")
# Host work per step on a GPU when none is given: the middle of the 1.7-3.3 ms estimated from the engine's code for
# a TP = 1 step (vLLM's schedule and update, PSD planning, input preparation, output processing). Not measured.
DEFAULT_GPU_HOST_MS_PER_STEP = 2.5

DRAFTER_PLACEMENTS = ("own", "shared")
# Attention-sink tokens a windowed drafter keeps besides its window (the torch drafter's default).
DRAFTER_SINK_TOKENS = 4
# Positions whose conditional acceptance is tabulated once (longer drafts compute theirs on demand).
MAX_POSITIONS = 32


@dataclass(frozen=True)
class Hardware:
    tensor_parallel_size: int = 1
    # Added per target layer to a forward at TP > 1 (both all-reduces of the layer; NVLink, small messages).
    all_reduce_us_per_layer: float = 25.0
    drafter_placement: str = "own"
    shared_contention: float = 1.0
    # The engine's own work per step (scheduling, sampling, bookkeeping), beyond the forward pass. Not in the curves.
    # The engine's synchronous steps pay it after the forward; vLLM's async scheduling hides it (see the docstring).
    step_overhead_ms: float = 0.0
    # The same for steps of a drafting mode (sd, psd: they also send a draft job and store drafts), when measured
    # apart (the engine's own steps on this CPU: 0.44 ms in ar, 0.66 in sd); None: step_overhead_ms.
    drafting_step_overhead_ms: float | None = None
    # The same as measured by decoding requests per step, ((requests, ms), ...) sorted by requests, interpolated
    # linearly in requests and held flat beyond the ends; when given they replace the constants above (the engine's
    # host work grows with the requests it commits and streams: 0.4 ms at 1 request, 2-2.7 ms at 16 on this CPU).
    step_overhead_ms_by_batch: tuple[tuple[float, float], ...] = ()
    drafting_step_overhead_ms_by_batch: tuple[tuple[float, float], ...] = ()
    # Prefill: the curves hold no prefill measurements. 0 leaves it out (prompts are free, TTFT is queueing and
    # the first step); a value charges each new prompt token this much target time in the step that takes it in.
    prefill_ms_per_token: float = 0.0
    # The drafter's own prefill price per token on its device (a newcomer's prompt it takes in); None: the target's
    # prefill_ms_per_token scaled by the models' parameter ratio (a target's price at TP > 1 is per TP group, which
    # understates a drafter on one GPU: give it its own then).
    drafter_prefill_ms_per_token: float | None = None
    # MineDraft's drafter window: 0 reads the whole context; W > 0 reads at most W + DRAFTER_SINK_TOKENS positions.
    drafter_window_tokens: int = 0
    # vLLM's colocated drafter at TP > 1: True divides its draft loop by TP (plus all-reduces), as for the target;
    # False keeps its one-GPU time (a small drafter's loop is largely launch-bound, which TP does not shorten).
    colocated_draft_scales_with_tp: bool = True
    # vLLM's own modes (vllm-ar, vllm-sd) schedule the next step while the current one computes (async scheduling,
    # on by default on GPUs in vLLM 0.32, draft-model SD included): their host work hides behind the device's.
    # False: they pay it in series like the engine's steps (vLLM turns async scheduling off on CPUs).
    vllm_async_scheduling: bool = True
    # The spread of the drafter's time for one job shape: multipliers of a job's time (curve loop plus catch-up), one
    # drawn per job, uniformly among these (seeded). Empty: every job takes exactly its curves' time. The curves
    # hold each shape's least contended median; a drafter whose cores are shared (this CPU under load: its jobs of
    # one shape took 0.5-3x their median) has jobs past the wait budget, abandoned, and the next queued behind them.
    drafter_time_spread: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError(f"tensor_parallel_size: must be between 1 and 64, got {self.tensor_parallel_size}")
        if self.all_reduce_us_per_layer < 0:
            raise ValueError(f"all_reduce_us_per_layer: must be >= 0, got {self.all_reduce_us_per_layer}")
        if self.drafter_placement not in DRAFTER_PLACEMENTS:
            raise ValueError(f"drafter_placement: expected one of {', '.join(DRAFTER_PLACEMENTS)}, "
                             f"got {self.drafter_placement!r}")
        if not 0.0 <= self.shared_contention <= 1.0:
            raise ValueError(f"shared_contention: must be within [0, 1], got {self.shared_contention}")
        for name in ("step_overhead_ms", "drafting_step_overhead_ms", "prefill_ms_per_token",
                     "drafter_prefill_ms_per_token"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name}: must be >= 0, got {value}")
        if self.drafter_window_tokens < 0:
            raise ValueError(f"drafter_window_tokens: must be >= 0 (0: no window), got {self.drafter_window_tokens}")
        if any(not 0.0 < factor < float("inf") for factor in self.drafter_time_spread):
            raise ValueError(f"drafter_time_spread: multipliers must be positive and finite, got "
                             f"{self.drafter_time_spread}")


@dataclass(frozen=True)
class StepCosts:
    """Milliseconds of the target's forwards and the drafter's loops under a hardware layout."""

    target: ModelCurves
    drafter: ModelCurves
    hardware: Hardware

    @classmethod
    def from_curves(cls, curves: CostCurves, target: str, drafter: str, hardware: Hardware) -> StepCosts:
        return cls(curves.model(target, "target"), curves.model(drafter, "drafter"), hardware)

    def _tp(self, single_ms: float, layers: int) -> float:
        tp = self.hardware.tensor_parallel_size
        if tp == 1:
            return single_ms
        return single_ms / tp + layers * self.hardware.all_reduce_us_per_layer / 1000.0

    def step_overhead_ms(self, requests: float, drafting: bool) -> float:
        """The engine's own work in a step of `requests` requests (beyond the forward pass)."""
        hardware = self.hardware
        table = hardware.drafting_step_overhead_ms_by_batch if drafting else ()
        table = table or hardware.step_overhead_ms_by_batch
        if table:
            return _interpolate(table, requests)
        if drafting and hardware.drafting_step_overhead_ms is not None:
            return hardware.drafting_step_overhead_ms
        return hardware.step_overhead_ms

    @staticmethod
    def step_period_s(device_s: float, host_s: float, hidden: bool) -> float:
        """A step's wall time from its device time and its host work: in series (the engine's synchronous steps)
        or, `hidden`, overlapped with the device's (async scheduling: the host prepares the next step meanwhile)."""
        return max(device_s, host_s) if hidden else device_s + host_s

    def verify_ms(self, batch: float, context: float, new_tokens: float) -> float:
        if batch <= 0:
            return 0.0
        return self._tp(self.target.forward_ms(batch, context, new_tokens).ms, self.target.layers)

    def draft_ms(self, batch: float, context: float, k: int, colocated: bool = False) -> float:
        """A whole k-token draft loop for `batch` requests. `colocated`: vLLM's SD, on the target's GPUs with its
        tensor parallelism (each of the k passes pays the all-reduces)."""
        if batch <= 0 or k <= 0:
            return 0.0
        single = self.drafter.draft_loop_ms(batch, self.drafter_context(context, colocated), k).ms
        if not colocated or self.hardware.tensor_parallel_size == 1 or not self.hardware.colocated_draft_scales_with_tp:
            return single
        tp = self.hardware.tensor_parallel_size
        return single / tp + k * self.drafter.layers * self.hardware.all_reduce_us_per_layer / 1000.0

    def drafter_context(self, context: float, colocated: bool = False) -> float:
        """The context a draft step's KV reads see: capped by MineDraft's window (vLLM's colocated drafter has none)."""
        window = self.hardware.drafter_window_tokens
        if window and not colocated:
            return min(context, window + DRAFTER_SINK_TOKENS)
        return context

    def drafter_prefill_ms(self, tokens: int) -> float:
        """Prompt tokens the drafter takes in: at its own price when given, else the target's per-token prefill cost
        scaled by parameter count."""
        if tokens <= 0:
            return 0.0
        if self.hardware.drafter_prefill_ms_per_token is not None:
            return tokens * self.hardware.drafter_prefill_ms_per_token
        if not self.hardware.prefill_ms_per_token:
            return 0.0
        if self.target.params and self.drafter.params:
            share = self.drafter.params / self.target.params
        else:  # parameters unknown: the ratio of their one-token forwards is a (generous) stand-in
            share = self.drafter.draft_loop_ms(1, 1024, 1).ms / self.target.forward_ms(1, 1024, 2).ms
        return tokens * self.hardware.prefill_ms_per_token * share

    def gpus(self, mode: str) -> int:
        """GPUs one replica holds in this mode: the target's, plus the drafter's own unless it shares or it is ar."""
        tp = self.hardware.tensor_parallel_size
        if mode in PLAIN_FAMILIES or mode.startswith("vllm-sd") or self.hardware.drafter_placement == "shared":
            return tp
        return tp + 1

    def extrapolations(self, batch: float, context: float, ks: Sequence[int]) -> set[str]:
        flags: set[str] = set()
        for k in ks:
            flags |= self.target.forward_ms(batch, context, k + 1).extrapolated
            flags |= self.drafter.draft_loop_ms(batch, self.drafter_context(context), k).extrapolated
        return flags


def _interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise linear through (x, y) points sorted by x, flat beyond the ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return points[-1][1]


@dataclass(frozen=True)
class AcceptanceModel:
    """Per-position acceptance as the engine reports it (`acceptance_per_position`): survival[i] is the share of
    drafts reaching position i that are accepted through position i. Beyond the given positions the last
    conditional rate continues (as the engine's cost model extrapolates)."""

    survival: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.survival:
            raise ValueError("acceptance: give at least one per-position rate")
        previous = 1.0
        for i, value in enumerate(self.survival):
            if not 0.0 <= value <= 1.0 or math.isnan(value):
                raise ValueError(f"acceptance[{i}]: must be within [0, 1], got {value}")
            if value > previous + 1e-9:
                raise ValueError(f"acceptance[{i}]: {value} exceeds position {i - 1}'s {previous}: a position is "
                                 "accepted only if every earlier one is")
            previous = value

    @classmethod
    def constant(cls, rate: float, positions: int = 8) -> AcceptanceModel:
        """Every position accepted with the same conditional probability `rate`."""
        return cls(tuple(rate ** (i + 1) for i in range(positions)))

    @classmethod
    def parse(cls, text: str) -> AcceptanceModel:
        """`0.8` (constant conditional rate) or `0.85,0.7,0.6` (the engine's per-position survival rates)."""
        try:
            values = [float(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise CurveError("acceptance", f"expected a rate or comma-separated rates, got {text!r}") from None
        try:
            return cls.constant(values[0]) if len(values) == 1 else cls(tuple(values))
        except (ValueError, IndexError) as exc:
            raise CurveError("acceptance", str(exc) or f"no rates in {text!r}") from None

    def at(self, i: int) -> float:
        if i < len(self.survival):
            return self.survival[i]
        s = list(self.survival)
        conditional = s[-1] / s[-2] if len(s) >= 2 and s[-2] > 0 else s[0]
        value = s[-1]
        for _ in range(i - len(s) + 1):
            value *= conditional
        return value

    def _conditional(self, i: int) -> float:
        before = 1.0 if i == 0 else self.at(i - 1)
        return self.at(i) / before if before > 0 else 0.0

    def conditional(self, i: int) -> float:
        """P(position i accepted | every earlier one accepted)."""
        table = self._conditionals
        return table[i] if i < len(table) else self._conditional(i)

    @functools.cached_property
    def _conditionals(self) -> tuple[float, ...]:
        return tuple(self._conditional(i) for i in range(MAX_POSITIONS))

    def expected_accepted_length(self, k: int) -> float:
        return 1.0 + sum(self.at(i) for i in range(k))

    def sample(self, drafted: int, rng: random.Random) -> int:
        accepted = 0
        table = self._conditionals
        while accepted < drafted and rng.random() < (table[accepted] if accepted < MAX_POSITIONS
                                                      else self._conditional(accepted)):
            accepted += 1
        return accepted
