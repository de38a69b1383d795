"""What a deployment costs per token: a price table of device-hours, and a deployment's replicas, devices by kind,
tokens per second per target GPU, per GPU and per dollar, and dollars per million output tokens. Pure.

The default prices are EXAMPLES (rounded on-demand cloud list prices of late 2025, USD per device-hour), there to
make the arithmetic concrete; a user's own table (`--prices FILE`) replaces them:

    {"format": "minedraft-prices/v1", "usd_per_hour": {"H200": 3.80, "L40S": 0.99, ...}, "source": "our contract"}
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minedraft.twin.curves import CurveError
from minedraft.twin.devices import device_spec

PRICES_FORMAT = "minedraft-prices/v1"
EXAMPLE_PRICES_SOURCE = "example prices (rounded on-demand cloud list prices, late 2025): not a quote; edit for yours"
EXAMPLE_USD_PER_HOUR: dict[str, float] = {
    "H200": 3.80, "H100": 2.99, "A100": 1.79, "L40S": 0.99, "L4": 0.60, "RTX 4090": 0.40, "A10": 0.75,
    "V100": 0.55, "CPU": 1.20,
}


@dataclass(frozen=True, slots=True)
class PriceTable:
    usd_per_hour: Mapping[str, float]
    source: str = EXAMPLE_PRICES_SOURCE

    def price(self, device: str) -> float:
        """USD per hour of `device` (a table key, or a known device's name or description)."""
        if device in self.usd_per_hour:
            return self.usd_per_hour[device]
        try:
            name = device_spec(device).name
        except CurveError:
            name = device
        if name in self.usd_per_hour:
            return self.usd_per_hour[name]
        raise CurveError("prices", f"no price for {device!r} in {self.source}; it prices "
                                   f"{', '.join(self.usd_per_hour)}")


EXAMPLE_PRICES = PriceTable(EXAMPLE_USD_PER_HOUR)


def parse_prices(data: Any, source: str = "<prices>") -> PriceTable:
    if not isinstance(data, dict):
        raise CurveError("prices", f"expected a JSON object, got {type(data).__name__}")
    if data.get("format") != PRICES_FORMAT:
        raise CurveError("prices.format", f"expected {PRICES_FORMAT!r}, got {data.get('format')!r}")
    table = data.get("usd_per_hour")
    if not isinstance(table, dict) or not table:
        raise CurveError("prices.usd_per_hour", "expected an object of device name -> USD per hour")
    prices: dict[str, float] = {}
    for name, value in table.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
            raise CurveError(f"prices.usd_per_hour.{name}", f"expected a finite number >= 0, got {value!r}")
        prices[str(name)] = float(value)
    return PriceTable(prices, str(data.get("source") or source))


def load_prices(path: str | Path) -> PriceTable:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise CurveError("prices", f"cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise CurveError("prices", f"{path} is not JSON: {exc}") from None
    return parse_prices(data, str(path))


@dataclass(frozen=True, slots=True)
class Layout:
    """One replica's devices: the target's GPUs and the drafter devices it holds (a share when several replicas
    share one drafter device)."""

    target_device: str
    target_gpus: int
    drafter_device: str | None = None
    drafter_devices: float = 0.0

    def devices(self, replicas: int) -> dict[str, float]:
        out: dict[str, float] = {self.target_device: float(self.target_gpus * replicas)}
        if self.drafter_device is not None and self.drafter_devices > 0:
            # Whole devices: a share of a drafter device is rounded up over the replicas.
            wanted = math.ceil(self.drafter_devices * replicas - 1e-9)
            out[self.drafter_device] = out.get(self.drafter_device, 0.0) + wanted
        return out


@dataclass(frozen=True, slots=True)
class Deployment:
    """One mode and placement serving a demand."""

    mode: str
    placement: str  # none, colocated, off-gpu
    layout: Layout
    replicas: int
    max_concurrency: int  # per replica: what its KV cache holds
    concurrency_per_replica: float
    tokens_per_s: float  # the demand served, output tokens
    tpot_ms_p50: float | None
    usd_per_hour: float
    devices_by_kind: dict[str, float] = field(default_factory=dict)

    @property
    def gpus(self) -> float:
        return sum(self.devices_by_kind.values())

    @property
    def target_gpus(self) -> int:
        return self.layout.target_gpus * self.replicas

    @property
    def usd_per_million_tokens(self) -> float:
        return self.usd_per_hour / (self.tokens_per_s * 3600.0) * 1e6 if self.tokens_per_s > 0 else math.inf

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "placement": self.placement, "drafter_device": self.layout.drafter_device,
            "replicas": self.replicas, "gpus_by_kind": {k: round(v, 2) for k, v in self.devices_by_kind.items()},
            "max_concurrency": self.max_concurrency,
            "concurrency_per_replica": round(self.concurrency_per_replica, 1),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "tokens_per_s_per_target_gpu": round(self.tokens_per_s / self.target_gpus, 1),
            "tokens_per_s_per_gpu": round(self.tokens_per_s / self.gpus, 1),
            "tokens_per_s_per_usd_hour": round(self.tokens_per_s / self.usd_per_hour, 2) if self.usd_per_hour else None,
            "usd_per_hour": round(self.usd_per_hour, 2),
            "usd_per_million_tokens": round(self.usd_per_million_tokens, 4),
            "tpot_ms_p50": self.tpot_ms_p50,
        }


def price_deployment(mode: str, placement: str, layout: Layout, replicas: int, max_concurrency: int,
                     concurrency_per_replica: float, tokens_per_s: float, tpot_ms_p50: float | None,
                     prices: PriceTable) -> Deployment:
    devices = layout.devices(replicas)
    usd = sum(count * prices.price(kind) for kind, count in devices.items())
    return Deployment(mode, placement, layout, replicas, max_concurrency, concurrency_per_replica, tokens_per_s,
                      tpot_ms_p50, usd, devices)


def cheapest(deployments: list[Deployment]) -> Deployment | None:
    """The deployment with the lowest USD per million tokens (ties: fewer devices, then lower TPOT)."""
    if not deployments:
        return None
    return min(deployments, key=lambda d: (round(d.usd_per_million_tokens, 9), d.gpus,
                                           d.tpot_ms_p50 if d.tpot_ms_p50 is not None else math.inf))
