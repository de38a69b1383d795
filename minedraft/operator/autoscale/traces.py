"""The committed traces (step, ramp, diurnal day, burst, acceptance collapse; square waves of three periods, prompts
growing 16x, a slow acceptance drift), generated deterministically.

Rates are sized to the calibrated replica model (one replica of the local pair serves ~2,000 output tokens/s at its
full batch of 32), so each trace moves between a few and ~10 replicas within the bounds 1..20.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

PROMPT_TOKENS = 256
OUTPUT_TOKENS = 128
SLO_TTFT_SECONDS = 2.5  # the recording rules' TTFT SLO (99% within 2.5 s)


def _row(t: float, rps: float, acceptance: float, output_tokens: int = OUTPUT_TOKENS,
         prompt_tokens: int = PROMPT_TOKENS) -> dict[str, Any]:
    return {"t": t, "arrival_rps": round(rps, 3), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "acceptance_rate": round(acceptance, 3)}


def _config(duration: float, description: str, event: float | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {"slo_ttft_seconds": SLO_TTFT_SECONDS, "min_replicas": 1, "max_replicas": 20,
                              "duration_seconds": duration, "description": description}
    if event is not None:
        config["event_seconds"] = event
    return {"config": config}


def make_traces(seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    rng = random.Random(seed)
    traces: dict[str, list[dict[str, Any]]] = {}
    traces["step"] = [_config(2400, "20 req/s, a step to 80 req/s at 10 min, back to 20 at 25 min", 600),
                      _row(0, 20, 0.6), _row(600, 80, 0.6), _row(1500, 20, 0.6)]
    ramp = [_config(3600, "10 -> 100 req/s over 40 min, back to 10 over 20 min")]
    for t in range(0, 3600, 30):
        rps = 10 + 90 * t / 2400 if t <= 2400 else 100 - 90 * (t - 2400) / 1200
        ramp.append(_row(t, rps, 0.6))
    traces["ramp"] = ramp
    diurnal = [_config(86400, "a day: 10 req/s at night, 90 at the 14:00 peak, +-10% noise every 5 min; "
                              "acceptance higher in working hours (code) than at night (chat)")]
    for t in range(0, 86400, 300):
        phase = math.cos(2 * math.pi * (t - 14 * 3600) / 86400)  # 1 at 14:00
        rps = (50 + 40 * phase) * (1 + rng.uniform(-0.1, 0.1))
        diurnal.append(_row(t, rps, 0.6 + 0.15 * phase))
    traces["diurnal"] = diurnal
    burst = [_config(3000, "30 req/s with three 60 s bursts to 90 req/s (at 10, 25 and 40 min)", 600)]
    for start in (0, 600, 660, 1500, 1560, 2400, 2460):
        burst.append(_row(start, 90 if start in (600, 1500, 2400) else 30, 0.6))
    traces["burst"] = burst
    traces["acceptance-collapse"] = [
        _config(2700, "90 req/s throughout; acceptance 0.9 collapses to 0.1 at 15 min (a new kind of prompt), "
                      "recovers at 30 min", 900),
        _row(0, 90, 0.9), _row(900, 90, 0.1), _row(1800, 90, 0.9)]
    # A load that alternates between low and high: the policy must follow it without removing what it just added.
    for period in (240, 600, 1200):
        square = [_config(3600, f"15 and 60 req/s alternating every {period // 2} s (a square wave of period "
                                f"{period} s)", period // 2)]
        square += [_row(t, 60 if (t // (period // 2)) % 2 else 15, 0.6) for t in range(0, 3600, period // 2)]
        traces[f"square-{period}s"] = square
    # Prompts grow 16x (384 -> 6144 tokens) at a constant rate of arrivals: the KV cache and prefill, not the output
    # tokens/s, become the limit (each request needs 10x the KV by the end, and 16x the prefill).
    growing = [_config(3600, "4 req/s throughout; prompts grow from 384 to 6144 tokens over the hour (16x), "
                             "256 output tokens")]
    growing += [_row(t, 4, 0.6, 256, round(384 + (6144 - 384) * t / 3540)) for t in range(0, 3600, 60)]
    traces["growing-prompts"] = growing
    # Acceptance drifts from 0.8 to 0.3 over 40 minutes and back over 20 at a steady 60 req/s: capacity falls slowly.
    drift = [_config(3600, "60 req/s throughout; acceptance drifts from 0.8 to 0.3 over 40 min, back to 0.8 over "
                           "20 min")]
    for t in range(0, 3600, 60):
        acceptance = 0.8 - 0.5 * t / 2400 if t <= 2400 else 0.3 + 0.5 * (t - 2400) / 1200
        drift.append(_row(t, 60, acceptance))
    traces["acceptance-drift"] = drift
    return traces


def write_traces(out_dir: Path, seed: int = 0) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, lines in make_traces(seed).items():
        path = out_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        paths.append(path)
    return paths
