"""Cost-curve files of other shapes, in the same v1 format, so nothing about auto or the twin is tuned to one file:
a roofline device (weights and KV read at a bandwidth, or the arithmetic at a rate, whichever is slower, plus a
fixed launch cost per layer pass), and any file with its drafter slowed down (eager execution: the drafter's
forwards launch-bound, 5-7x slower than with CUDA graphs on the H200).

These are models, not measurements; files made here say so in their `measured` field."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from minedraft.twin.curves import FORMAT

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXTS = (1024, 4096)
NEW_TOKENS = (1, 4, 6)
DRAFT_KS = (3, 5)


@dataclass(frozen=True)
class Roofline:
    name: str
    bandwidth_bytes_per_s: float
    flops_per_s: float
    # Per forward (kernel launches, synchronisation): what a tiny batch costs beyond its bytes.
    fixed_ms: float = 0.5


@dataclass(frozen=True)
class ModelShape:
    name: str
    role: str
    params: int
    layers: int
    kv_bytes_per_token: int
    bytes_per_param: int = 2

    def forward_ms(self, device: Roofline, batch: int, context: int, new_tokens: int) -> float:
        bytes_read = self.params * self.bytes_per_param + batch * (context + new_tokens) * self.kv_bytes_per_token
        memory_s = bytes_read / device.bandwidth_bytes_per_s
        compute_s = 2.0 * self.params * batch * new_tokens / device.flops_per_s
        return device.fixed_ms + 1000.0 * max(memory_s, compute_s)

    def draft_loop_ms(self, device: Roofline, batch: int, context: int, k: int) -> float:
        return (self.forward_ms(device, batch, context, k + 1)
                + sum(self.forward_ms(device, batch, context + k + 1 + i, 1) for i in range(k - 1)))


QWEN3_32B = ModelShape("qwen3-32b", "target", 32_762_118_144, 64, 262_144)
QWEN3_1_7B = ModelShape("qwen3-1.7b", "drafter", 2_031_737_856, 28, 114_688)
# An 80 GB previous-generation GPU, roughly (effective bandwidth and bf16 rate, not data-sheet peaks).
A100_LIKE = Roofline("A100-like roofline (1.6 TB/s, 250 TFLOP/s effective)", 1.6e12, 250e12, fixed_ms=0.6)


def roofline_curves(device: Roofline, target: ModelShape = QWEN3_32B,
                    drafters: tuple[ModelShape, ...] = (QWEN3_1_7B,)) -> dict[str, Any]:
    models: dict[str, Any] = {}
    for model in (target, *drafters):
        entry: dict[str, Any] = {
            "role": model.role, "params": model.params, "config": {"layers": model.layers},
            "kv_bytes_per_token": model.kv_bytes_per_token,
            "forward_ms": [{"batch": b, "context": c, "new_tokens": q,
                            "ms": round(model.forward_ms(device, b, c, q), 3)}
                           for c in CONTEXTS for b in BATCHES for q in NEW_TOKENS],
        }
        if model.role == "drafter":
            entry["draft_loop_ms"] = [{"batch": b, "context": c, "k": k,
                                       "ms": round(model.draft_loop_ms(device, b, c, k), 3)}
                                      for c in CONTEXTS for b in BATCHES for k in DRAFT_KS]
        models[model.name] = entry
    return {"format": FORMAT, "device": device.name, "dtype": "bfloat16", "execution": "roofline model",
            "measured": "not measured: a roofline model (minedraft.twin.synthetic)", "models": models}


def slow_drafter(curves: dict[str, Any], factor: float, execution: str = "eager drafter") -> dict[str, Any]:
    """The same file with every drafter time multiplied by `factor` (eager drafting is 5-7x slower)."""
    out = copy.deepcopy(curves)
    for model in out["models"].values():
        if model.get("role") != "drafter":
            continue
        for key in ("forward_ms", "draft_loop_ms"):
            for row in model.get(key, []):
                row["ms"] = round(row["ms"] * factor, 3)
    out["execution"] = f"{out.get('execution', '')}; {execution} (drafter times x{factor:g}, modelled)"
    out["measured"] = f"derived: {out.get('measured', '')}; drafter x{factor:g}"
    return out


def flatter_target(curves: dict[str, Any], factor: float) -> dict[str, Any]:
    """The same file with the target's verify curve flattened: each forward's time above the cheapest one at its
    context (one request, one token) multiplied by `factor` (< 1: a more memory-bound target, whose verification
    grows more slowly with batch and draft length, as on a GPU with more compute per byte)."""
    out = copy.deepcopy(curves)
    for model in out["models"].values():
        if model.get("role") != "target":
            continue
        rows = model.get("forward_ms", [])
        floor: dict[Any, float] = {}
        for row in rows:
            floor[row.get("context")] = min(floor.get(row.get("context"), row["ms"]), row["ms"])
        for row in rows:
            base = floor[row.get("context")]
            row["ms"] = round(base + factor * (row["ms"] - base), 3)
    out["execution"] = f"{out.get('execution', '')}; target growth x{factor:g} (modelled)"
    out["measured"] = f"derived: {out.get('measured', '')}; target's time above its floor x{factor:g}"
    return out
