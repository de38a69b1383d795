"""Measurements for the replica model from a deployment's own Prometheus history (`minedraft autoscale history`).

Per engine replica and evaluation step, Prometheus holds what the replica ran (mode and k), how many requests it
decoded, its output tokens/s over the last minute, the mean accepted length and the drafting seconds per step. Points
are grouped by (mode, k, requests decoding, rounded) and each group's medians become one measured run, in the shape
`minedraft doctor --json` prints (flat runs), which `minedraft autoscale calibrate --bench` reads. Only groups seen
at least `min_points` times count (a minute-rate right after a load change mixes two loads).

The binning is pure (`runs_from_points`); the fetching is a thin layer over Prometheus's range API.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from minedraft.operator.autoscale.observe import prometheus_api, selector

QUERY_TIMEOUT_SECONDS = 60.0
HISTORY_QUERIES: Mapping[str, str] = {
    "running": "minedraft_engine_running_requests{{{sel}}}",
    "tokens_per_second": "minedraft:engine_output_tokens_per_second:rate1m{{{sel}}}",
    "mean_accepted_length": "minedraft:engine_mean_accepted_length:rate1m{{{sel}}}",
    "draft_seconds_per_step": "minedraft:engine_draft_seconds_per_step:rate1m{{{sel}}}",
    "k": "minedraft_engine_num_speculative_tokens{{{sel}}}",
    "mode": "minedraft_engine_mode{{{sel}}} == 1",
}


@dataclass(frozen=True)
class Point:
    """One replica at one time."""

    mode: str
    k: int
    running: float
    tokens_per_second: float
    mean_accepted_length: float | None = None
    draft_seconds_per_step: float | None = None


def runs_from_points(points: Iterable[Point], min_points: int = 5) -> list[dict[str, Any]]:
    groups: dict[tuple[str, int, int], list[Point]] = {}
    for p in points:
        # Only the modes the replica model fits (replica_model.MODES): a lookahead point is left out, not counted as
        # psd's (the model prices lookahead as psd, but its speeds would bend psd's fitted half-step ratio).
        if p.running < 1 or p.tokens_per_second <= 0 or p.mode not in ("ar", "sd", "psd"):
            continue
        k = 0 if p.mode == "ar" else p.k
        groups.setdefault((p.mode, k, round(p.running)), []).append(p)
    runs = []
    for (mode, k, concurrency), group in sorted(groups.items(), key=lambda item: (item[0][2], item[0][0], item[0][1])):
        if len(group) < min_points:
            continue
        run: dict[str, Any] = {"mode": mode, "k": k, "concurrency": concurrency, "points": len(group),
                               "tokens_per_second": round(statistics.median(p.tokens_per_second for p in group), 3)}
        lengths = [p.mean_accepted_length for p in group if p.mean_accepted_length]
        run["mean_accepted_length"] = round(statistics.median(lengths), 4) if lengths and mode != "ar" else 1.0
        drafts = [p.draft_seconds_per_step for p in group if p.draft_seconds_per_step]
        if drafts and mode != "ar":
            run["draft_seconds_per_step"] = round(statistics.median(drafts), 6)
        runs.append(run)
    return runs


def points_from_matrices(results: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[Point]:
    """Join the range-query answers of HISTORY_QUERIES by (instance, timestamp)."""
    table: dict[tuple[str, float], dict[str, Any]] = {}
    for name, series in results.items():
        for s in series:
            instance = str(s["metric"].get("instance", ""))
            for stamp, value in s["values"]:
                row = table.setdefault((instance, float(stamp)), {})
                if name == "mode":
                    row["mode"] = str(s["metric"].get("mode", ""))
                else:
                    try:
                        row[name] = float(value)
                    except ValueError:
                        continue
    points = []
    for row in table.values():
        if "mode" in row and "running" in row and "tokens_per_second" in row:
            points.append(Point(mode=row["mode"], k=int(row.get("k", 0)), running=row["running"],
                                tokens_per_second=row["tokens_per_second"],
                                mean_accepted_length=row.get("mean_accepted_length"),
                                draft_seconds_per_step=row.get("draft_seconds_per_step")))
    return points


async def fetch(address: str, namespace: str, engine_service: str, start_seconds: float, end_seconds: float,
                step_seconds: float = 30.0) -> list[Point]:
    sel = selector(namespace, engine_service)
    async with aiohttp.ClientSession() as session:
        async def one(expr: str) -> list[dict[str, Any]]:
            return await prometheus_api(session, address, "query_range", {
                "query": expr, "start": str(start_seconds), "end": str(end_seconds), "step": str(step_seconds)},
                timeout_seconds=QUERY_TIMEOUT_SECONDS)

        names = list(HISTORY_QUERIES)
        answers = await asyncio.gather(*(one(HISTORY_QUERIES[n].format(sel=sel)) for n in names))
    return points_from_matrices(dict(zip(names, answers, strict=True)))
