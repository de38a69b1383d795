"""The autoscaling simulator's replica model from a cost-curve file, through the twin (`minedraft autoscale simulate
--curves FILE`): one model of a replica for `minedraft plan` and the autoscaler's simulator.

Every figure comes from the twin's public functions: the capacity per load and acceptance is what `minedraft plan`
reports for the engine's auto mode (the same parser and defaults, prefill priced at the workload's prompt length);
the KV cache's tokens are plan's (`capacity.by_family.auto`); the prefill time per prompt token is
`twin.capacity.prefill_ms` at that prompt length; the start-up is an estimate from the weights' bytes
(`twin.capacity.footprint`) and a disk bandwidth, labelled as such.

The simulator prices prefill apart (a replica prefilling is not decoding: decoding at D tok/s while each request's
O output tokens bring P prompt tokens at p s each gives T = D / (1 + D P p / O)), so the table holds the decode rate
D that gives plan's T back at the workload's lengths, D = T / (1 - T P p / O): at those lengths the simulator and
plan agree by construction, and at other prompt lengths (a growing-prompt trace) the time share moves with P.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from minedraft.operator.autoscale.replica_model import TableReplicaModel
from minedraft.twin.capacity import footprint, prefill_ms
from minedraft.twin.cli import add_arguments, run_plan
from minedraft.twin.curves import load_curves, pick_model

DEFAULT_LOADS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# 0.1 apart where acceptance usually lies: auto's best mode changes between 0.6 and 0.8 (psd, lookahead), and a
# capacity interpolated across that switch was 5% off plan's at 0.7.
DEFAULT_ACCEPTANCES = (0.2, 0.4, 0.6, 0.7, 0.8, 0.9)
# Start-up of a GPU pod before its weights load: scheduling, the image (cached on the node), CUDA graph capture and
# warm-up. An estimate, not measured.
DEFAULT_FIXED_STARTUP_SECONDS = 60.0
# Read bandwidth of the volume the weights load from (a network volume; a local NVMe is 2-3x faster). An estimate.
DEFAULT_DISK_GB_PER_SECOND = 1.0


@dataclass(frozen=True)
class TwinModelSettings:
    curves: str
    target: str | None = None
    drafter: str | None = None
    loads: tuple[int, ...] = DEFAULT_LOADS
    acceptances: tuple[float, ...] = DEFAULT_ACCEPTANCES
    prompt_tokens: int = 1024
    output_tokens: int = 256
    max_batch: int = 256  # the engine's --max-num-seqs
    fixed_startup_seconds: float = DEFAULT_FIXED_STARTUP_SECONDS
    disk_gb_per_second: float = DEFAULT_DISK_GB_PER_SECOND
    # Further `minedraft plan` flags as deployed (e.g. ["-tp", "2", "--drafter-placement", "shared"]).
    plan_flags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.loads or min(self.loads) < 1:
            raise ValueError(f"loads: positive integers, got {self.loads}")
        if not self.acceptances or not all(0.0 <= a <= 1.0 for a in self.acceptances):
            raise ValueError(f"acceptances: within [0, 1], got {self.acceptances}")
        if self.disk_gb_per_second <= 0 or self.fixed_startup_seconds < 0:
            raise ValueError("disk_gb_per_second: must be positive; fixed_startup_seconds: must be >= 0")


def plan_arguments(settings: TwinModelSettings, concurrencies: Sequence[int], acceptance: float,
                   prefill: bool = False) -> argparse.Namespace:
    """The arguments `minedraft plan` would parse for these figures (its own parser: the same defaults)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--curves", settings.curves, "--concurrency", ",".join(str(c) for c in concurrencies),
            "--acceptance", f"{acceptance:g}", "--prompt-tokens", str(settings.prompt_tokens),
            "--output-tokens", str(settings.output_tokens), "--json"]
    argv += ["--target", settings.target] if settings.target else []
    argv += ["--drafter", settings.drafter] if settings.drafter else []
    argv += [] if prefill else ["--prefill-ms-per-token", "0"]
    return parser.parse_args([*argv, *settings.plan_flags])


def auto_tokens_per_second(result: dict[str, object]) -> list[tuple[int, float, str, int]]:
    """(load, tokens/s, mode, k) of the auto entry at each load of a `minedraft plan --json` result."""
    out = []
    for load in result["loads"]:  # type: ignore[attr-defined]
        auto = load["modes"]["auto"]
        out.append((int(load["concurrency"]), float(auto["tokens_per_s"]), str(auto.get("mode", "ar")),
                    int(auto.get("k") or 0)))
    return out


def replica_model_from_curves(settings: TwinModelSettings, progress: bool = True) -> TableReplicaModel:
    loads = tuple(c for c in settings.loads if c <= settings.max_batch) or (1,)
    rows: list[tuple[float, ...]] = []
    choices: list[tuple[tuple[str, int], ...]] = []
    capacity: dict[str, object] = {}
    plan_prefill_ms_per_token: float | None = None
    for acceptance in sorted(settings.acceptances):
        if progress:
            print(f"autoscale: the twin at acceptance {acceptance:g}, loads {', '.join(map(str, loads))}",
                  file=sys.stderr, flush=True)
        result = run_plan(plan_arguments(settings, loads, acceptance, prefill=True))
        points = auto_tokens_per_second(result)
        plan_prefill = result.get("prefill") or {}
        plan_prefill_ms_per_token = float(plan_prefill.get("ms_per_token", 0.0))  # type: ignore[attr-defined]
        prefill_share = plan_prefill_ms_per_token / 1000.0 * settings.prompt_tokens / max(settings.output_tokens, 1)
        rows.append(tuple(tps / max(1.0 - tps * prefill_share, 1e-6) for _, tps, _, _ in points))
        choices.append(tuple((mode, k) for _, _, mode, k in points))
        capacity = dict(result.get("capacity") or {})  # type: ignore[call-overload]
    curves = load_curves(settings.curves)
    target = pick_model(curves, "target", settings.target)
    drafter = pick_model(curves, "drafter", settings.drafter)
    by_family = capacity.get("by_family") or {}
    auto = by_family.get("auto") if isinstance(by_family, dict) else None
    kv_tokens = float(auto["kv_tokens"]) if isinstance(auto, dict) and auto.get("kv_tokens") else None
    prefill = prefill_ms(curves.model(target, "target"), settings.prompt_tokens)
    weights = footprint(curves.model(target, "target"), curves.dtype).weight_bytes + footprint(
        curves.model(drafter, "drafter"), curves.dtype).weight_bytes
    load_seconds = weights / (settings.disk_gb_per_second * 1e9)
    startup = settings.fixed_startup_seconds + load_seconds
    assumptions = (
        f"decode capacity: minedraft plan (the twin) on {settings.curves}, the auto entry at each load and acceptance, "
        f"{settings.prompt_tokens} + {settings.output_tokens}-token requests, with the prefill's time share taken "
        "out (the simulator prices prefill apart and gives plan's figure back at these lengths)",
        f"kv_capacity_tokens {kv_tokens:.0f}: minedraft plan's KV pool for auto" if kv_tokens is not None
        else "kv_capacity_tokens: none (plan ran without a KV limit)",
        f"prefill_seconds_per_token {prefill.ms / max(settings.prompt_tokens, 1):.4f} ms: "
        f"{prefill.source} ({settings.prompt_tokens}-token prompt)",
        f"startup_seconds {startup:.0f}: an estimate, not measured: {settings.fixed_startup_seconds:.0f} s "
        f"(scheduling, cached image, CUDA graphs) + {weights / 1e9:.1f} GB of weights ({target} + {drafter}) at "
        f"{settings.disk_gb_per_second:g} GB/s",
    )
    return TableReplicaModel(
        loads=tuple(float(c) for c in loads), acceptances=tuple(sorted(settings.acceptances)),
        tokens_per_second=tuple(rows), choices=tuple(choices), max_batch=settings.max_batch,
        startup_seconds=round(startup, 1), kv_capacity_tokens=kv_tokens,
        # plan's own figure (the one its tokens/s paid), which is the twin's prefill_ms at this prompt length.
        prefill_seconds_per_token=(plan_prefill_ms_per_token if plan_prefill_ms_per_token is not None
                                   else prefill.ms / max(settings.prompt_tokens, 1)) / 1000.0, assumptions=assumptions,
        source=f"{curves.device}: {target} + {drafter}", prompt_tokens=settings.prompt_tokens,
        output_tokens=settings.output_tokens)
