"""A model of one engine replica for the simulator: output tokens/s as a function of load, acceptance and k.

Calibrated from the engine benchmark's JSON (`minedraft bench --json`): plain decoding's step seconds grow linearly
with the batch, t_ar(c) = a0 + a1 c; a speculative step (psd, drafting hidden behind verification) verifies c (k+1)
tokens, t_spec(c, k) = b0 + b1 c (k+1), and yields L = 1 + k x acceptance tokens per request (acceptance as the
engine's metric defines it: accepted / drafted). A replica in `auto` mode runs whichever of ar and psd(k), k in the
allowed range, gives the most tokens/s at its load: that is what the engines' predicted-goodput gauge reports.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ReplicaModel:
    ar_step_seconds: float  # a0
    ar_step_seconds_per_request: float  # a1
    spec_step_seconds: float  # b0
    spec_step_seconds_per_token: float  # b1 (per verified token: request x (k+1))
    max_batch: int  # requests one replica decodes at once (the benchmark's largest concurrency)
    startup_seconds: float  # from scale-up to serving (pod start + model load)
    min_speculative_tokens: int = 1
    max_speculative_tokens: int = 5
    calibrated_from: tuple[str, ...] = ()

    def best(self, running: float, acceptance: float) -> tuple[float, str, int]:
        """(output tokens/s, mode, k) of the best way to decode `running` requests at this acceptance."""
        c = max(running, 1.0)
        best = (c / (self.ar_step_seconds + self.ar_step_seconds_per_request * c), "ar", 0)
        for k in range(self.min_speculative_tokens, self.max_speculative_tokens + 1):
            step = self.spec_step_seconds + self.spec_step_seconds_per_token * c * (k + 1)
            tps = c * (1.0 + k * acceptance) / step
            if tps > best[0]:
                best = (tps, "psd", k)
        if running < 1.0:
            return best[0] * running, best[1], best[2]
        return best

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "calibrated_from": list(self.calibrated_from)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReplicaModel:
        return cls(**{**data, "calibrated_from": tuple(data.get("calibrated_from", ()))})

    @classmethod
    def load(cls, path: Path) -> ReplicaModel:
        return cls.from_json(json.loads(path.read_text()))


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope


def calibrate(bench_files: list[Path], startup_seconds: float, spec_mode: str = "psd") -> ReplicaModel:
    """Fit the step-time lines to every (concurrency, mode) point of the benchmark files."""
    ar: list[tuple[float, float]] = []
    spec: list[tuple[float, float]] = []
    batches: list[int] = []
    ks: list[int] = []
    for path in bench_files:
        data = json.loads(path.read_text())
        k = int(data["config"]["num_speculative_tokens"])
        ks.append(k)
        for run in data["runs"]:
            c = int(run["concurrency"])
            batches.append(c)
            modes = run["modes"]
            if "ar" in modes:
                ar.append((c, c / modes["ar"]["output_tokens_per_s"]))
            if spec_mode in modes:
                m = modes[spec_mode]
                spec.append((c * (k + 1), c * m["mean_accepted_length"] / m["output_tokens_per_s"]))
    a0, a1 = _line(ar)
    b0, b1 = _line(spec)
    return ReplicaModel(ar_step_seconds=round(a0, 6), ar_step_seconds_per_request=round(a1, 7),
                        spec_step_seconds=round(b0, 6), spec_step_seconds_per_token=round(b1, 7),
                        max_batch=max(batches), startup_seconds=startup_seconds,
                        min_speculative_tokens=1, max_speculative_tokens=max(ks),
                        calibrated_from=tuple(p.name for p in bench_files))
