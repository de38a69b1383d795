"""Run a profile: plan the measurements, hand them to worker processes group by group (one model, or one target +
drafter pair on two streams), restart a worker after a measurement it timed out on or died in, and assemble the
cost-curve document."""

from __future__ import annotations

import datetime as dt
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minedraft.profile import curves
from minedraft.profile.architecture import Architecture, ArchitectureError, resolve
from minedraft.profile.settings import TimingSettings
from minedraft.profile.shapes import SHAPE_PRESETS, Measurement, ShapeGrid, plan
from minedraft.profile.supervisor import run_child

WORKER_ARGV = (sys.executable, "-m", "minedraft.profile.worker")


@dataclass(frozen=True)
class ProfileSettings:
    target: str  # preset name, config path, or NAME=PATH
    drafters: tuple[str, ...]
    grid: ShapeGrid
    device: str = "cpu"  # cpu | cuda | cuda:N
    dtype: str = "float32"
    eager: bool = False  # on CUDA: no graphs (on a CPU always eager)
    concurrent: bool = True  # on CUDA with graphs: target and drafter on two streams
    timing: TimingSettings = field(default_factory=TimingSettings)
    setup_timeout_s: float = 300.0
    measurement_timeout_s: float = 60.0
    budget_s: float | None = None
    threads: int | None = None
    worker_argv: tuple[str, ...] = WORKER_ARGV
    command: str = ""
    # Measure the drafters only (a drafter device of its own: the target runs elsewhere); the target's entry keeps
    # its shape and no times. `minedraft plan --drafter-curves FILE` reads such a file beside the target's.
    drafter_only: bool = False

    @property
    def graphs(self) -> bool:
        return self.device.startswith("cuda") and not self.eager

    @property
    def execution(self) -> str:
        return "CUDA graphs" if self.graphs else f"eager ({self.device.split(':')[0]})"


def resolve_models(settings: ProfileSettings) -> list[tuple[str, str, Architecture]]:
    """(name, role, architecture) for the target and each drafter; names must differ."""
    models = [(*resolve(settings.target, "target"), "target")]
    models += [(*resolve(spec, "drafter"), "drafter") for spec in settings.drafters]
    names = [name for name, _, _ in models]
    for name in names:
        if names.count(name) > 1:
            raise ArchitectureError("drafter", f"two models are named {name!r}; name one NAME=SPEC")
    return [(name, role, arch) for name, arch, role in models]


def _groups(measurements: list[Measurement]) -> list[list[int]]:
    """Indices of measurements per worker process: each model's own, then each target + drafter pair."""
    keys: dict[tuple[str, str], list[int]] = {}
    for i, m in enumerate(measurements):
        keys.setdefault((m.model, m.drafter) if m.kind == "concurrent" else (m.model, ""), []).append(i)
    return list(keys.values())


def _notes(settings: ProfileSettings) -> list[str]:
    t = settings.timing
    how = (f"each shape captured as a CUDA graph and replayed: median of {t.repeats} x {t.replays} replays"
           if settings.graphs else f"eager: median of {t.repeats} blocks of at least {t.replays} calls "
           f"(and at least {t.min_block_ms:g} ms)")
    notes = [
        "forward_ms: one forward pass of `batch` requests, each adding `new_tokens` tokens after `context` cached "
        "tokens (verify at draft length k is new_tokens = k + 1); logits for every new position, argmax",
        "draft_loop_ms: a drafter's whole k-token draft for `batch` requests: one pass over k+1 accepted/bonus "
        "tokens, then k-1 one-token passes, each fed the previous argmax (no host sync)",
        "prefill_ms: one request's prompt chunk of `tokens` tokens after `context` cached tokens (batch 1): every "
        "position's keys and values into the cache, logits of the last position only",
        f"timing: {how}; every measurement under its own timeout in a separate process "
        f"({settings.measurement_timeout_s:g} s; setup {settings.setup_timeout_s:g} s)",
        "not modelled: RoPE, sampling and rejection, chunked-prefill scheduling; kernels unfused",
    ]
    if settings.graphs and settings.concurrent:
        notes.append("concurrent_ms: the target's verification (k+1 tokens) and the drafter's k-token draft loop, "
                     "each for `batch` requests, replayed as CUDA graphs on two streams of one GPU from a common "
                     "start: ms = both done, target_ms / drafter_ms = each finished, *_alone_ms = each by itself")
    return notes


def run_profile(settings: ProfileSettings, log: Callable[[str], None] = lambda line: None,
                checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Measure everything `settings` asks for; `checkpoint` gets the document after each worker process ends (so
    a run killed from outside still leaves what it measured)."""
    started = time.monotonic()
    deadline = None if settings.budget_s is None else started + settings.budget_s
    models = resolve_models(settings)
    archs = {name: arch for name, _, arch in models}
    drafters = [name for name, role, _ in models if role == "drafter"]
    measurements = plan(settings.grid, models[0][0], drafters,
                        concurrent=settings.graphs and settings.concurrent and not settings.drafter_only)
    if settings.drafter_only:
        measurements = [m for m in measurements if m.model in drafters]
    doc = curves.new_document("(not measured)", settings.dtype, settings.execution, "", _notes(settings), models)
    done = 0
    device_description: str | None = None
    torch_version = "?"
    log(f"profile: {len(measurements)} measurements of {', '.join(archs)} on {settings.device} "
        f"({settings.execution}, {settings.dtype})")

    def progress(m: Measurement, what: str) -> None:
        log(f"[{done}/{len(measurements)} {time.monotonic() - started:5.0f}s] {m.label()}: {what}")

    for group in _groups(measurements):
        pending = list(group)
        while pending:
            if deadline is not None and time.monotonic() >= deadline:
                for i in pending:
                    curves.add_timeout(doc, measurements[i], settings.budget_s or 0.0, "budget")
                    done += 1
                    progress(measurements[i], "skipped: the run's time budget is spent")
                break
            names = sorted({measurements[i].model for i in pending} | {measurements[i].drafter for i in pending} - {""})
            job = {"device": settings.device, "dtype": settings.dtype, "eager": not settings.graphs,
                   "threads": settings.threads, "timing": vars(settings.timing),
                   "models": {name: archs[name].to_json() for name in names},
                   "measurements": [{"id": i, "measurement": measurements[i].to_json()} for i in pending]}

            def on_event(event: dict[str, Any]) -> None:
                nonlocal done
                if event["event"] == "ready":
                    log(f"worker (pid {event.get('pid')}) ready on {event.get('device')} "
                        f"({time.monotonic() - started:.0f}s)")
                elif event["event"] in ("result", "error"):
                    done += 1
                    m = measurements[int(event["id"])]
                    progress(m, f"{event['ms']:.3f} ms" if event["event"] == "result" else f"error: {event['message']}")

            outcome = run_child(list(settings.worker_argv), job, settings.setup_timeout_s,
                                settings.measurement_timeout_s, deadline=deadline, on_event=on_event)
            if outcome.ready is not None and device_description is None:
                device_description = str(outcome.ready.get("device"))
                torch_version = str(outcome.ready.get("torch", "?"))
                _stamp(doc, device_description, torch_version, settings.command)
            for i, result in outcome.results.items():
                curves.add_result(doc, measurements[i], result)
            for i, message in outcome.errors.items():
                curves.add_error(doc, measurements[i], message)
            finished = set(outcome.results) | set(outcome.errors)
            pending = [i for i in pending if i not in finished]
            if not pending:
                break
            if outcome.ready is None:  # setup failed or hung: the group cannot be measured
                for i in pending:
                    _record_failure(doc, measurements[i], outcome.failure, outcome.during, outcome.exit_code,
                                    settings.setup_timeout_s)
                    done += 1
                    progress(measurements[i], f"not measured: worker setup {outcome.failure or 'failed'}")
                break
            if not outcome.failure:
                if finished:  # a clean exit after progress: the worker asked for a fresh process (CUDA error)
                    continue
                outcome.failure, outcome.during = "exit", "measurement"  # no progress: blame the next, never loop
            culprit = outcome.failed_id if outcome.failed_id in pending else pending[0]
            timeout_s = settings.measurement_timeout_s if outcome.during != "budget" else settings.budget_s or 0.0
            _record_failure(doc, measurements[culprit], outcome.failure, outcome.during, outcome.exit_code, timeout_s)
            done += 1
            progress(measurements[culprit], f"{outcome.failure} ({outcome.during}); restarting the worker"
                     if outcome.during != "budget" else "timeout (budget)")
            pending.remove(culprit)
        if checkpoint is not None:
            checkpoint(doc)
    _stamp(doc, device_description or f"{settings.device} (no worker became ready)", torch_version, settings.command)
    forwards = sum(len(m["forward_ms"]) for m in doc["models"].values())
    loops = sum(len(m.get("draft_loop_ms", [])) for m in doc["models"].values())
    log(f"profile: done in {time.monotonic() - started:.0f}s: {forwards} forwards, {loops} draft loops, "
        f"{len(doc.get('concurrent_ms', []))} concurrent, {len(doc.get('timeouts', []))} timeouts, "
        f"{len(doc.get('errors', []))} errors")
    return doc


def _stamp(doc: dict[str, Any], device: str, torch_version: str, command: str) -> None:
    doc["device"] = device
    doc["measured"] = (f"{dt.datetime.now(dt.UTC).strftime('%Y-%m-%d')}, torch {torch_version}, random weights, "
                       "dense per-request KV cache, SDPA attention (grouped query heads folded into the query "
                       "length), minedraft profile")
    if command:
        doc["command"] = command


def _record_failure(doc: dict[str, Any], m: Measurement, failure: str, during: str, exit_code: int | None,
                    timeout_s: float) -> None:
    if failure == "timeout":
        curves.add_timeout(doc, m, timeout_s, during)
    else:
        curves.add_error(doc, m, f"the worker exited with code {exit_code} during {during or 'the run'}")


def grid_from(name: str, batches: list[int] | None, contexts: list[int] | None, ks: list[int] | None) -> ShapeGrid:
    if name not in SHAPE_PRESETS:
        raise ValueError(f"shapes: {name!r} is not one of {', '.join(SHAPE_PRESETS)}")
    return SHAPE_PRESETS[name].with_overrides(batches, contexts, ks)
