"""Capacity planning from a twin sweep: for a demand in requests per second, which mode and k to run, how many
replicas, and the tokens per second each GPU then serves. Pure over sweep results."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from minedraft.twin.pricing import Deployment, Layout, PriceTable, cheapest, price_deployment
from minedraft.twin.run import RunResult
from minedraft.twin.sweep import LoadResult, _family


@dataclass(frozen=True)
class Band:
    duration_s: float | None
    requests_per_s: float


@dataclass(frozen=True)
class Choice:
    mode: str  # a label: ar, vllm-ar (plain vLLM), sd-k3, psd-k5, psd-async-k5, vllm-sd-k3, auto
    replicas: int
    gpus_per_replica: int
    concurrency_per_replica: float
    replica_tokens_per_s: float
    tokens_per_s_per_gpu: float

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "replicas": self.replicas, "gpus": self.replicas * self.gpus_per_replica,
                "concurrency_per_replica": round(self.concurrency_per_replica, 1),
                "replica_tokens_per_s": round(self.replica_tokens_per_s, 1),
                "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 1)}


def _curve(loads: Sequence[LoadResult], label: str, max_tpot_ms: float | None) -> list[tuple[int, RunResult]]:
    points = []
    for load in loads:
        run = load.auto if label == "auto" else load.runs.get(label)
        if run is None:
            continue
        tpot = run.summary()["tpot_ms_p50"]
        if max_tpot_ms is not None and isinstance(tpot, float) and tpot > max_tpot_ms:
            continue
        points.append((load.concurrency, run))
    return points


def choose(loads: Sequence[LoadResult], label: str, demand_tokens_per_s: float,
           max_tpot_ms: float | None = None) -> Choice | None:
    """The fewest replicas of `label` that serve the demand (each at a load the sweep measured, within the TPOT
    limit), and the concurrency each then holds (interpolated between measured loads)."""
    points = _curve(loads, label, max_tpot_ms)
    if not points or demand_tokens_per_s <= 0:
        return None
    capacity = max(run.tokens_per_s for _, run in points)
    replicas = max(1, math.ceil(demand_tokens_per_s / capacity - 1e-9))
    per_replica = demand_tokens_per_s / replicas
    gpus = points[0][1].gpus
    concurrency = float(points[-1][0])
    previous: tuple[int, float] = (0, 0.0)
    for c, run in points:
        if run.tokens_per_s >= per_replica:
            c0, r0 = previous
            concurrency = c0 + (c - c0) * (per_replica - r0) / (run.tokens_per_s - r0) if run.tokens_per_s > r0 else c
            break
        previous = (c, run.tokens_per_s)
    return Choice(label, replicas, gpus, concurrency, per_replica, demand_tokens_per_s / (replicas * gpus))


def plan_band(loads: Sequence[LoadResult], band: Band, output_tokens: int,
              max_tpot_ms: float | None = None) -> dict[str, Any]:
    demand = band.requests_per_s * output_tokens
    labels = list(loads[0].runs) + (["auto"] if loads[0].auto is not None else [])
    choices = {label: choose(loads, label, demand, max_tpot_ms) for label in labels}
    feasible = {label: c for label, c in choices.items() if c is not None}
    best = None
    if feasible:
        # Fewest GPUs; among those, the most tokens per second a replica could still take (headroom).
        best = min((c for label, c in feasible.items() if label != "auto"),
                   key=lambda c: (c.replicas * c.gpus_per_replica, c.concurrency_per_replica), default=None)

    def best_of(family: str) -> dict[str, Any] | None:
        options = [c for label, c in feasible.items() if label != "auto" and _family(label) == family]
        if not options:
            return None
        return min(options, key=lambda c: (c.replicas * c.gpus_per_replica, c.concurrency_per_replica)).to_json()

    return {
        "requests_per_s": band.requests_per_s, "duration_s": band.duration_s,
        "demand_tokens_per_s": round(demand, 1),
        "run": best.to_json() if best else None,
        "auto": feasible["auto"].to_json() if "auto" in feasible else None,
        "by_family": {family: best_of(family) for family in ("ar", "sd", "psd", "vllm-sd", *_extra_families(labels))},
    }


def _extra_families(labels: Sequence[str]) -> list[str]:
    """Families added after the first interface (plain vLLM, psd with async steps), where the sweep ran them."""
    present = {_family(label) for label in labels}
    return [family for family in ("vllm-ar", "psd-async") if family in present]


def parse_trace(text: str) -> list[Band]:
    """Lines of `duration_s,requests_per_s` (blank lines and # comments ignored)."""
    bands: list[Band] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = [p.strip() for p in line.split(",")]
        try:
            duration, rate = float(parts[0]), float(parts[1])
        except (ValueError, IndexError):
            raise ValueError(f"trace line {number}: expected `duration_s,requests_per_s`, got {line!r}") from None
        if duration <= 0 or rate <= 0:
            raise ValueError(f"trace line {number}: duration and rate must be positive")
        bands.append(Band(duration, rate))
    if not bands:
        raise ValueError("trace: no bands")
    return bands


# --- cost per token ---------------------------------------------------------------------------------------------


def tpot_at(loads: Sequence[LoadResult], label: str, concurrency: float) -> float | None:
    """p50 time per output token of `label` at the first measured load holding at least `concurrency` requests
    (the next load up: not flattering)."""
    for load in loads:
        run = load.auto if label == "auto" else load.runs.get(label)
        if run is not None and load.concurrency >= concurrency - 1e-9:
            tpot = run.summary()["tpot_ms_p50"]
            return tpot if isinstance(tpot, float) else None
    return None


def price_band(loads: Sequence[LoadResult], band: Band, output_tokens: int, max_tpot_ms: float | None,
               layout: Callable[[str], Layout], placement: Callable[[str], str],
               max_concurrency: Callable[[str], int], prices: PriceTable) -> dict[str, Any]:
    """Every mode (its cheapest k) serving the band's demand within the TPOT limit, priced; and the cheapest.

    Modes are whatever the sweep ran (labels family-kK): a family added later is priced without change here."""
    demand = band.requests_per_s * output_tokens
    labels = [label for label in loads[0].runs] if loads else []
    deployments: dict[str, Deployment] = {}
    for label in labels:
        choice = choose(loads, label, demand, max_tpot_ms)
        if choice is None:
            continue
        deployment = price_deployment(
            label, placement(label), layout(label), choice.replicas, max_concurrency(label),
            choice.concurrency_per_replica, demand, tpot_at(loads, label, choice.concurrency_per_replica), prices)
        family = _family(label)
        best = deployments.get(family)
        if best is None or cheapest([best, deployment]) is deployment:
            deployments[family] = deployment
    recommended = cheapest(list(deployments.values()))
    return {"requests_per_s": band.requests_per_s, "demand_tokens_per_s": round(demand, 1),
            "max_tpot_ms": max_tpot_ms,
            "deployments": {family: d.to_json() for family, d in deployments.items()},
            "recommended": recommended.to_json() if recommended else None}
