"""Cost curves measured through the engine itself: the target's forward passes and the drafter's k-token loops as
the engine runs them (vLLM's kernels, the engine's drafter process), written in the `minedraft-cost-curves/v1`
format that `minedraft profile` writes with the project's own torch model.

The profiler times an eager torch decoder; on this CPU that is 1.7-4x what vLLM's kernels take per step for the
local pair, so a twin driven by its curves cannot agree with the engine. Here the engine runs closed-loop loads in
ar mode (one token per request per step) and in sd mode (k + 1 tokens per request, then one draft job of the whole
batch) at each batch of the grid, and every decode step's `StepRecord` is a measurement:

- forward_ms[batch, q]: the median `verify_seconds` of decode-only steps of `batch` requests with q tokens each
  (q = 1 from ar, q = k + 1 from sd);
- draft_loop_ms[batch, k]: the median `draft_seconds` of the draft jobs of `batch` requests and length k (the job's
  own size, `draft_job_requests`, not the requests verified), less each job's catch-up at the price below;
- the drafter's catch_up_ms_per_token: the price of a job's catch-up tokens (`draft_job_catch_up_tokens`: the
  tokens accepted since the drafter's last job for each request, newcomers' prompts), fitted by least squares within
  jobs of one size and length (the engine's own `CatchUpPrice`) from the time up to each job's first drafted token
  (the whole job where the drafter does not report it); left out when the jobs' tokens did not vary enough;
- step_overhead_ms: the median of the rest of a step (the engine's host work: scheduling, committing, sending the
  draft job, the output path), from consecutive decode steps: the time from one step's start to the next one's less
  its verification and its wait for drafts (what the engine's own cost model calls o(R));
- prefill_ms_per_token: the median, over steps that took prompts in, of their verification less their decoding part
  (the forward rows at its shape) per prompt token.

The records carry no context length: every point is filed at the context the loads run at (mean prompt tokens plus
half the output), one context level. `curves_from_records` is pure; `calibrate` starts the engine (vLLM).
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from minedraft.engine.control.cost_model import CatchUpPrice
from minedraft.engine.control.stats import StepRecord
from minedraft.engine.settings import EngineSettings, Mode
from minedraft.profile.architecture import Architecture
from minedraft.profile.curves import new_document

# A grid point needs at least this many steps of its exact shape (fewer are the ramp-up and drain of a load).
MIN_STEPS_PER_POINT = 5
# Consecutive steps further apart than this were separated by idle time (between loads), not host work.
MAX_STEP_GAP_SECONDS = 1.0


@dataclass(frozen=True)
class CalibrationSettings:
    k: int = 3
    batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    max_tokens: int = 32
    # Requests per load: max(min_requests, requests_per_batch * batch), as `minedraft bench` sizes its runs.
    requests_per_batch: int = 4
    min_requests: int = 8

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k: must be >= 1, got {self.k}")
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"batches: expected positive batch sizes, got {self.batches}")
        if self.max_tokens < 4:
            raise ValueError(f"max_tokens: must be >= 4, got {self.max_tokens}")

    def num_requests(self, batch: int) -> int:
        return max(self.min_requests, self.requests_per_batch * batch)


def _decode_only(record: StepRecord) -> bool:
    return record.num_prefill_requests == 0 and record.num_decode_requests > 0


def forward_points(records: Iterable[StepRecord]) -> dict[tuple[int, int], list[float]]:
    """Seconds of decode-only verifications by (requests, tokens per request); mixed draft lengths are skipped."""
    points: dict[tuple[int, int], list[float]] = {}
    for record in records:
        if not _decode_only(record) or record.num_scheduled_tokens % record.num_decode_requests:
            continue
        q = record.num_scheduled_tokens // record.num_decode_requests
        points.setdefault((record.num_decode_requests, q), []).append(record.verify_seconds)
    return points


def draft_points(records: Iterable[StepRecord], catch_up_s_per_token: float = 0.0
                 ) -> dict[tuple[int, int], list[float]]:
    """Seconds of whole draft jobs by (requests in the job, draft length), less their catch-up at the given price."""
    points: dict[tuple[int, int], list[float]] = {}
    for record in records:
        if record.draft_job_requests > 0 and record.draft_job_length > 0 and record.draft_seconds > 0:
            loop = record.draft_seconds - catch_up_s_per_token * record.draft_job_catch_up_tokens
            points.setdefault((record.draft_job_requests, record.draft_job_length), []).append(
                max(loop, 0.1 * record.draft_seconds))
    return points


def catch_up_price(records: Iterable[StepRecord]) -> float | None:
    """Seconds per catch-up token of the drafter, from the jobs the records verified (see CatchUpPrice), or None
    when their catch-up tokens did not vary enough within jobs of one size to tell."""
    price = CatchUpPrice(decay=1.0)
    for record in records:
        if record.draft_job_requests > 0 and record.draft_job_length > 0 and record.draft_seconds > 0:
            first = record.draft_first_token_seconds
            seconds = first if 0 < first <= record.draft_seconds else record.draft_seconds
            price.observe(record.draft_job_requests, record.draft_job_length, record.draft_job_catch_up_tokens,
                          seconds)
    return price.seconds_per_token()


def overhead_seconds(runs: Iterable[Sequence[StepRecord]]) -> list[float]:
    """Per pair of consecutive decode steps of one run: the first step's time not spent verifying or waiting."""
    return [value for values in overhead_points(runs).values() for value in values]


def overhead_points(runs: Iterable[Sequence[StepRecord]]) -> dict[int, list[float]]:
    """overhead_seconds by the first step's decoding requests (the engine's host work grows with them: committing,
    detokenizing and streaming each request's tokens)."""
    points: dict[int, list[float]] = {}
    for records in runs:
        for previous, record in itertools.pairwise(records):
            if not (_decode_only(previous) and _decode_only(record)):
                continue
            gap = record.started_at - previous.started_at
            if 0 < gap < MAX_STEP_GAP_SECONDS:
                points.setdefault(previous.num_decode_requests, []).append(
                    max(0.0, gap - previous.verify_seconds - previous.wait_seconds))
    return points


def _prefill_per_token(records: Iterable[StepRecord], decode_ms: dict[tuple[int, int], float],
                       q: int) -> list[float]:
    """Seconds per prompt token of the steps that took prompts in: their verification less their decoding part's."""
    values: list[float] = []
    for record in records:
        if record.num_prefill_requests == 0:
            continue
        decoding = record.num_decode_requests
        prompt_tokens = record.num_scheduled_tokens - decoding * q
        known = sorted((batch, ms) for (batch, qq), ms in decode_ms.items() if qq == q)
        if prompt_tokens <= 0 or (decoding and not (known and known[0][0] <= decoding <= known[-1][0])):
            continue
        rest = record.verify_seconds - (_between(known, decoding) / 1000.0 if decoding else 0.0)
        values.append(max(0.0, rest) / prompt_tokens)
    return values


def _between(points: list[tuple[int, float]], x: int) -> float:
    """Linear between the two measured batches around x (x within the measured range)."""
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y0
    return points[0][1]


def _least_contended(per_run: Iterable[dict[Any, list[float]]], min_steps: int) -> dict[Any, tuple[float, int]]:
    """Per key: the smallest of the per-run medians (runs with at least `min_steps` values), and all values' count.

    Each run is one load at one moment; on a machine shared with other work, interference only ever slows a step, so
    the least contended load's median is the engine's own cost (its median within the load drops outliers)."""
    best: dict[Any, tuple[float, int]] = {}
    for points in per_run:
        for key, values in points.items():
            if len(values) < min_steps:
                continue
            value = statistics.median(values)
            previous = best.get(key)
            best[key] = (min(value, previous[0]) if previous else value, len(values) + (previous[1] if previous else 0))
    return best


def curves_from_records(runs: Mapping[str, Sequence[Sequence[StepRecord]]], target: tuple[str, Architecture],
                        drafter: tuple[str, Architecture], context: int, k: int, device: str, measured: str,
                        notes: Sequence[str] = (), min_steps: int = MIN_STEPS_PER_POINT,
                        batches: Sequence[int] | None = None) -> dict[str, Any]:
    """A `minedraft-cost-curves/v1` document from the step records of the engine's runs, by mode ("ar", "sd"): a
    list of runs per mode, each the records of one load in step order.

    Forward times at q = 1 come from ar's steps and at q = k + 1 from sd's; draft loops from sd's jobs of length k;
    each the median of its steps within a load, the least of those over loads (_least_contended). The engine's host
    work per step goes into the document's `step_overhead_ms`, per mode and overall, and the prefill cost per prompt
    token into `prefill_ms_per_token`, alike; the drafter's price per catch-up token into its model's
    `catch_up_ms_per_token` (the draft loops then net of it). `batches`: keep only the grid's batch sizes (a load's
    ramp-up and drain pass through others for a few steps, whose drafts include newcomers' prompts)."""
    all_runs = [run for mode_runs in runs.values() for run in mode_runs]
    doc = new_document(device, "float32", "vLLM (the engine's own steps)", measured, list(notes),
                       [(target[0], "target", target[1]), (drafter[0], "drafter", drafter[1])])
    forward = doc["models"][target[0]]["forward_ms"]
    for (batch, q), (seconds, count) in sorted(_least_contended(map(forward_points, all_runs), min_steps).items()):
        if q in (1, k + 1) and (batches is None or batch in batches):
            forward.append({"batch": batch, "context": context, "new_tokens": q, "ms": round(seconds * 1000.0, 3),
                            "steps": count})
    loops = doc["models"][drafter[0]]["draft_loop_ms"]
    # Fitted over every job of the session (its variation comes from newcomers' prompts, rare in any one load).
    price = catch_up_price(record for run in all_runs for record in run)
    if price is not None:
        doc["models"][drafter[0]]["catch_up_ms_per_token"] = round(price * 1000.0, 5)
    loop_points = (draft_points(run, price or 0.0) for run in all_runs)
    for (batch, length), (seconds, count) in sorted(_least_contended(loop_points, min_steps).items()):
        if length == k and (batches is None or batch in batches):
            loops.append({"batch": batch, "context": context, "k": length, "ms": round(seconds * 1000.0, 3),
                          "steps": count})
    overhead: dict[str, Any] = {}
    for mode, mode_runs in [("all", all_runs), *runs.items()]:
        least = _least_contended(({mode: overhead_seconds([run])} for run in mode_runs), min_steps)
        if mode in least:
            overhead[mode] = round(least[mode][0] * 1000.0, 3)
    doc["step_overhead_ms"] = overhead
    # ... and by decoding requests per step, per mode: [{"batch", "ms"}] (what the twin interpolates).
    by_batch: dict[str, Any] = {}
    for mode, mode_runs in runs.items():
        least = _least_contended((overhead_points([run]) for run in mode_runs), min_steps)
        rows = [{"batch": b, "ms": round(v * 1000.0, 3)} for b, (v, _) in sorted(least.items())
                if batches is None or b in batches]
        if rows:
            by_batch[mode] = rows
    doc["step_overhead_ms_by_batch"] = by_batch
    # A step that takes prompts in costs what its decoding part costs (the forward rows above, interpolated in batch)
    # plus the prompts' tokens; steps whose decoding batch lies outside the rows are left out.
    decode_ms = {(r["batch"], r["new_tokens"]): r["ms"] for r in forward}
    prefill = _least_contended(({"prefill": _prefill_per_token(run, decode_ms, 1 if mode == "ar" else k + 1)}
                                for mode, mode_runs in runs.items() for run in mode_runs), min_steps)
    doc["prefill_ms_per_token"] = round(prefill["prefill"][0] * 1000.0, 4) if prefill else None
    return doc


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] calibrate: {message}", file=sys.stderr, flush=True)


def _set_mode(engine: Any, mode: Mode, k: int) -> None:
    engine.set_mode(mode, k)


@dataclass(frozen=True)
class Measured:
    """What one engine session measured: per calibration mode the step records of each load (the curves' source),
    and per (mode, requests) of the evaluation the output tokens/s of each round, as `minedraft bench` measures it
    (output tokens over the makespan of a closed-loop load)."""

    runs: dict[str, list[list[StepRecord]]]
    tokens_per_s: dict[tuple[str, int], list[float]]
    # Per (mode, requests): each round's step records, in the order of tokens_per_s.
    records: dict[tuple[str, int], list[list[StepRecord]]]


async def _load(engine: Any, mode: Mode, k: int, prompts: list[str], concurrency: int,
                max_tokens: int) -> tuple[list[StepRecord], float, float]:
    from minedraft.bench.workload import Workload, run_workload
    from minedraft.engine import calls

    await engine.call(partial(_set_mode, mode=mode, k=k))
    records = await engine.call(calls.step_records)
    first = records[-1].step if records else 0
    results, seconds = await run_workload(engine, Workload(prompts, concurrency, max_tokens))
    tokens = sum(len(r.token_ids) for r in results)
    since = await engine.call(partial(calls.step_records, since_step=first))
    return [r for r in since if r.step > first], tokens / seconds, seconds


async def _measure(base: EngineSettings, settings: CalibrationSettings, prompts: list[str],
                   evaluate: Sequence[int], rounds: int) -> Measured:
    from minedraft.bench.workload import Workload, run_workload
    from minedraft.engine.async_engine import AsyncEngine

    engine = await AsyncEngine.create(replace(base, mode=Mode.PSD, num_speculative_tokens=settings.k))
    measured = Measured({"ar": [], "sd": []}, {}, {})
    try:
        # A short warm-up (first compilations and allocations are not steady costs).
        await run_workload(engine, Workload(prompts[:2], 2, settings.max_tokens))
        # Rounds interleave the calibration's loads with the evaluation's, so that both see the machine alike.
        for round_index in range(rounds):
            for batch in settings.batches:
                chosen = [prompts[i % len(prompts)] for i in range(settings.num_requests(batch))]
                for mode in (Mode.AR, Mode.SD):
                    records, _, seconds = await _load(engine, mode, settings.k, chosen, batch, settings.max_tokens)
                    measured.runs[mode.value].append(records)
                    _log(f"round {round_index + 1}: calibration {mode.value} at {batch}: {len(records)} steps in "
                         f"{seconds:.1f} s")
            for concurrency in evaluate:
                chosen = [prompts[i % len(prompts)] for i in range(settings.num_requests(concurrency))]
                for mode in (Mode.AR, Mode.SD, Mode.PSD):
                    records, rate, _ = await _load(engine, mode, settings.k, chosen, concurrency, settings.max_tokens)
                    measured.tokens_per_s.setdefault((mode.value, concurrency), []).append(rate)
                    measured.records.setdefault((mode.value, concurrency), []).append(records)
                    _log(f"round {round_index + 1}: evaluation {mode.value} at {concurrency}: {rate:.0f} tok/s")
    finally:
        await engine.shutdown()
    return measured


def calibrate(base: EngineSettings, settings: CalibrationSettings, prompts: list[str], context: int,
              target: tuple[str, Architecture], drafter: tuple[str, Architecture], device: str,
              evaluate: Sequence[int] = (), rounds: int = 1) -> tuple[dict[str, Any], Measured]:
    """Runs the engine (`base`: models, cores, KV cache) over the grid and returns its cost-curve document, with the
    evaluation loads (ar, sd, psd at each of `evaluate`) measured in the same session, `rounds` times."""
    measured = asyncio.run(_measure(base, settings, prompts, evaluate, rounds))
    return document(base, settings, measured, context, target, drafter, device, rounds), measured


def document(base: EngineSettings, settings: CalibrationSettings, measured: Measured, context: int,
             target: tuple[str, Architecture], drafter: tuple[str, Architecture], device: str,
             rounds: int) -> dict[str, Any]:
    """The cost-curve document of a session's calibration loads."""
    notes = [f"ar and sd closed-loop loads of {settings.max_tokens} output tokens at batches "
             f"{', '.join(map(str, settings.batches))}, k = {settings.k}, {rounds} round(s); median of each shape's "
             "decode steps",
             "target cores " + ",".join(map(str, base.target_cpu_cores)) + "; drafter cores "
             + ",".join(map(str, base.drafter.cpu_cores)) + ("; the target never widens onto the drafter's cores"
                                                            if not base.lend_drafter_cores else "")]
    return curves_from_records(measured.runs, target, drafter, context, settings.k, device,
                               time.strftime("%Y-%m-%d") + ", minedraft.bench.calibrate", notes,
                               batches=settings.batches)
