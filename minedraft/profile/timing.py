"""Timing one call: eagerly (any device), as a replayed CUDA graph, and two graphs concurrently on two streams.

Why the concurrent measurement cannot hang here (docs/gpu.md, "Why the two-stream measurement hung"): every graph
is captured by this one thread, one capture at a time, after warming the call up on a side stream (so cuBLAS
handles, workspaces and the allocator's blocks exist before capture) and after a device synchronize (so nothing
else is in flight). Only then are the captured graphs replayed on two streams, ordered by events alone; nothing
allocates, captures or synchronizes while both streams run, and the one synchronize comes after the last launch.
No second host thread exists, so CUDA's global capture mode never sees another thread's call during a capture.
"""

from __future__ import annotations

import math
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from minedraft.profile.settings import TimingSettings


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_eager(fn: Callable[[], Any], settings: TimingSettings, device: torch.device) -> float:
    """Median milliseconds per call over `repeats` blocks of calls made one after another (a CUDA device is
    synchronized per block); a block has `replays` calls, or more to last `min_block_ms`."""
    for _ in range(settings.warmup):
        fn()
    _sync(device)
    calls = settings.replays
    if settings.min_block_ms > 0:
        started = time.perf_counter()
        fn()
        _sync(device)
        one_ms = max((time.perf_counter() - started) * 1000.0, 1e-3)
        calls = max(calls, min(1000, math.ceil(settings.min_block_ms / one_ms)))
    per_call_ms = []
    for _ in range(settings.repeats):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        per_call_ms.append((time.perf_counter() - started) * 1000.0 / calls)
    return statistics.median(per_call_ms)


def _only_thread(what: str) -> None:
    """The design rests on a single host thread touching CUDA (see the module's docstring): refuse anything else."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(f"{what} must run on the process's main thread, the only one that touches CUDA")
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    if others:  # not ours (the worker starts none): say so, since a thread that touches CUDA could break a capture
        print(f"warning: {what} while other Python threads run: {others}", file=sys.stderr)


def capture(fn: Callable[[], Any], settings: TimingSettings) -> torch.cuda.CUDAGraph:
    """Warm up on a side stream, synchronize, capture one call. Called from the only thread that touches CUDA."""
    _only_thread("a CUDA graph capture")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(1, settings.warmup)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # The default ("global") capture mode is kept on purpose: with one thread, any capture-unsafe call is ours and
    # should fail loudly here rather than be tolerated.
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def time_graph(graph: torch.cuda.CUDAGraph, settings: TimingSettings) -> float:
    """Median milliseconds per replay over `repeats` blocks of `replays` back-to-back replays (CUDA events)."""
    for _ in range(settings.warmup):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(settings.repeats)]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        for _ in range(settings.replays):
            graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) / settings.replays for start, end in events)


def time_cuda_graph(fn: Callable[[], Any], settings: TimingSettings) -> float:
    graph = capture(fn, settings)
    try:
        return time_graph(graph, settings)
    finally:
        del graph


def time_two_streams(target: torch.cuda.CUDAGraph, drafter: torch.cuda.CUDAGraph,
                     settings: TimingSettings) -> dict[str, float]:
    """The two graphs alone and together on two streams of one GPU. Each iteration starts both streams from one
    event and joins them on the launching stream, so iterations do not overlap each other. Returns medians:
    `ms` (both done), `target_ms` / `drafter_ms` (each stream's finish, measured from the common start, while the
    other runs), `target_alone_ms` / `drafter_alone_ms` (the same graphs by themselves, same streams)."""
    _only_thread("the two-stream measurement")
    main = torch.cuda.current_stream()
    streams = {"target": torch.cuda.Stream(), "drafter": torch.cuda.Stream()}
    graphs = {"target": target, "drafter": drafter}
    iterations = settings.repeats * settings.replays

    def run(which: tuple[str, ...]) -> dict[str, list[float]]:
        # All events exist before the first launch: nothing is created or allocated while the streams run.
        events = [{name: torch.cuda.Event(enable_timing=True) for name in ("start", *which, "end")}
                  for _ in range(iterations)]
        torch.cuda.synchronize()
        for marks in events:
            marks["start"].record(main)
            for name in which:
                stream = streams[name]
                stream.wait_event(marks["start"])
                with torch.cuda.stream(stream):
                    graphs[name].replay()
                marks[name].record(stream)
            for name in which:
                main.wait_event(marks[name])
            marks["end"].record(main)
        torch.cuda.synchronize()  # the one host wait, after the last launch
        return {name: [marks["start"].elapsed_time(marks[name]) for marks in events] for name in (*which, "end")}

    for _ in range(settings.warmup):
        run(("target", "drafter"))
    target_alone = run(("target",))
    drafter_alone = run(("drafter",))
    together = run(("target", "drafter"))
    return {"ms": statistics.median(together["end"]),
            "target_ms": statistics.median(together["target"]),
            "drafter_ms": statistics.median(together["drafter"]),
            "target_alone_ms": statistics.median(target_alone["end"]),
            "drafter_alone_ms": statistics.median(drafter_alone["end"])}
