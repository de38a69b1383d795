"""The prepared GPU run's stages (scripts/gpu_session.sh): torch only, random weights, no vLLM, no network.

Each stage is one process (`python -m minedraft.profile.session STAGE --out DIR`), bounded from outside by the
script's `timeout`, and writes DIR/STAGE.json as it goes (a stage killed part-way leaves what it measured);
`summary` gathers them into summary.json and summary.md. `--dry-run` runs every stage on the CPU at tiny shapes
(CI checks the plumbing; its numbers mean nothing).

Stages, in order (docs/gpu.md, "A prepared GPU run"):
  curves       the trimmed cost curves, by `python -m minedraft.profile` (its own per-measurement timeouts)
  async-step   a captured graph replayed from a second thread beside 2.5-5 ms host bursts: outputs equal to a
               one-thread replay, memory growth, the GPU's idle gap per step from CUDA events
  drafter-job  a drafter job's phases: admission (host lists to device tensors), the first pass over the accepted
               tokens, the one-token steps, sampling (argmax and the copy to the host)
  keyed        the keyed race at 32-256 rows x 151,936 vocabulary: the one-pass kernel against the torch reference
               race, time and peak memory, winners equal
  window       a windowed drafter's shapes (its ring of sinks + window + margin) eager, against the graph loop over
               the whole context
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STAGES = ("curves", "async-step", "drafter-job", "keyed", "window")
# Seconds each stage may run (the script's `timeout`; a stage also stops starting work past most of it). The sum with
# the device check and the summary stays under 9 minutes: see docs/gpu.md.
STAGE_LIMITS_S = {"check": 30, "curves": 200, "async-step": 60, "drafter-job": 50, "keyed": 40, "window": 50,
                  "summary": 15}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Stage:
    """One stage's results, rewritten to DIR/NAME.json after every measurement."""

    def __init__(self, out: Path, name: str, dry_run: bool):
        self.path = out / f"{name}.json"
        self.started = time.monotonic()
        self.doc: dict[str, Any] = {"stage": name, "dry_run": dry_run, "started": _now(), "status": "running",
                                    "results": [], "errors": []}
        self.write()

    def add(self, result: dict[str, Any]) -> None:
        self.doc["results"].append(result)
        print(f"[{self.doc['stage']}] {json.dumps(result)}", file=sys.stderr, flush=True)
        self.write()

    def error(self, what: str, exc: BaseException) -> None:
        self.doc["errors"].append({"what": what, "error": f"{type(exc).__name__}: {exc}"[:500]})
        print(f"[{self.doc['stage']}] {what}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        self.write()

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def finish(self, **fields: Any) -> None:
        self.doc.update(fields, status="done", seconds=round(self.elapsed_s(), 1))
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1) + "\n")
        tmp.replace(self.path)


# -- devices and models --------------------------------------------------------------------------------------------

def _device(dry_run: bool) -> Any:
    import torch

    if dry_run:
        torch.set_num_threads(1)
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --dry-run on a CPU)")
    return torch.device("cuda")


def _dtype(device: Any) -> Any:
    import torch

    return torch.bfloat16 if device.type == "cuda" else torch.float32


def tiny_architecture() -> Any:
    from minedraft.profile.architecture import Architecture

    return Architecture(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, inter=128, vocab=512,
                        model_type="qwen3", tied_embeddings=True)


def quarter_target() -> Any:
    """A quarter of Qwen3-32B's layers: what one GPU reads per step at TP = 4 (the all-reduces left out)."""
    from dataclasses import replace

    from minedraft.profile.architecture import PRESETS

    return replace(PRESETS["qwen3-32b"], layers=PRESETS["qwen3-32b"].layers // 4)


def _drafter_architecture(dry_run: bool) -> Any:
    from minedraft.profile.architecture import PRESETS

    return tiny_architecture() if dry_run else PRESETS["qwen3-1.7b"]


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _capture(fn: Callable[[], Any], device: Any) -> Callable[[], None]:
    """A replay function: a CUDA graph of `fn` on CUDA (warmed up on a side stream first, captured by this thread
    alone), `fn` itself on a CPU."""
    import torch

    if device.type != "cuda":
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def _memory(device: Any) -> dict[str, float | None]:
    import torch

    if device.type != "cuda":
        import resource

        return {"allocated_mib": None, "reserved_mib": None,
                "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    return {"allocated_mib": torch.cuda.memory_allocated() / 2**20,
            "reserved_mib": torch.cuda.memory_reserved() / 2**20}


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)

    return {"p50": at(0.5), "p90": at(0.9), "max": round(ordered[-1], 4), "n": len(ordered)}


# -- stage: curves --------------------------------------------------------------------------------------------------

def stage_curves(out: Path, dry_run: bool) -> None:
    """The H200 file's grid trimmed to the shapes that decide: the target at 1 and 4 new tokens (k = 3) and the
    1.7B drafter's k = 3 loop, batch 16-128 at context 1024 and 16-32 at 4096 (64 and 128 at 4096 do not fit an
    80 GB device beside the 32B weights). Two runs of the profiler, each with its own budget."""
    stage = Stage(out, "curves", dry_run)
    limit = STAGE_LIMITS_S["curves"]
    if dry_run:
        runs = [("tiny", ["--shapes", "tiny", "--device", "cpu", "--threads", "1", "--target", "pair-v1-target",
                          "--drafter", "pair-v1-draft", "--repeats", "1", "--replays", "1", "--warmup", "0",
                          "--min-block-ms", "0", "--timeout-s", "60", "--setup-timeout-s", "60",
                          "--budget-s", "60"], 90)]
    else:
        common = ["--device", "cuda", "--dtype", "bfloat16", "--shapes", "gpu", "--ks", "3", "--target", "qwen3-32b",
                  "--drafter", "qwen3-1.7b", "--no-concurrent", "--timeout-s", "30", "--setup-timeout-s", "60"]
        runs = [("context-1024", [*common, "--batches", "16,32,64,128", "--contexts", "1024", "--budget-s", "110"],
                 130),
                ("context-4096", [*common, "--batches", "16,32", "--contexts", "4096", "--budget-s", "40"], 60)]
    for name, args, seconds in runs:
        path = out / f"curves-{name}.json"
        argv = [sys.executable, "-m", "minedraft.profile", *args, "--output", str(path)]
        seconds = min(seconds, max(5, int(limit - stage.elapsed_s() - 5)))
        started = time.monotonic()
        child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _, stderr = child.communicate(timeout=seconds)
            code: int | str = child.returncode
        except subprocess.TimeoutExpired:
            # SIGTERM first: the profiler then kills its measuring worker (a session of its own, holding the GPU).
            child.terminate()
            try:
                _, stderr = child.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                child.kill()
                _, stderr = child.communicate()
            code = "timeout"
        tail = (stderr or "")[-2000:]
        result: dict[str, Any] = {"run": name, "exit": code, "seconds": round(time.monotonic() - started, 1),
                                  "file": path.name, "command": " ".join(argv[1:])}
        if path.exists():
            doc = json.loads(path.read_text())
            result["curves"] = {model: {"forward_ms": entry["forward_ms"],
                                        "draft_loop_ms": entry.get("draft_loop_ms", [])}
                                for model, entry in doc["models"].items()}
            result["timeouts"] = len(doc.get("timeouts", []))
            result["errors"] = len(doc.get("errors", []))
        else:
            result["stderr_tail"] = tail
        stage.add(result)
    stage.finish()


# -- stage: async-step ----------------------------------------------------------------------------------------------

def _burn(ms: float) -> None:
    """Host work that holds the GIL (pure Python), as the engine thread's scheduling and output processing do."""
    end = time.perf_counter() + ms / 1000.0
    x = 0
    while time.perf_counter() < end:
        for i in range(200):
            x += i * i


def stage_async_step(out: Path, dry_run: bool) -> None:
    """The engine's async-step pattern on one device. A captured forward (a quarter of the 32B target's layers at
    batch 32 verifying k = 3: the per-GPU work of a TP = 4 verify) is replayed by a model thread, step after step,
    each step's inputs handed over by the main thread (the engine thread) after a host burst of 2.5-5 ms that holds
    the GIL. Variants: `sync` (one thread: burst, then the step, as synchronous steps run), `alone` (the model
    thread with no bursts beside it), `bursts` (the async pattern), `bursts-switch-0.5ms` (the same with the
    interpreter's GIL switch interval cut from 5 ms to 0.5 ms), and `bursts-own-stream` (the model thread on a
    stream of its own, as the engine's model thread runs). Per variant: the GPU's idle gap between one step's end
    and the next one's start (CUDA events; host clock on a CPU), outputs equal to a one-thread replay of the same
    inputs, and memory before and after."""
    import torch

    from minedraft.profile.model import RandomDecoder

    stage = Stage(out, "async-step", dry_run)
    device = _device(dry_run)
    arch = tiny_architecture() if dry_run else quarter_target()
    batch, context, new_tokens, steps = (4, 32, 4, 12) if dry_run else (32, 1024, 4, 150)
    model = RandomDecoder(arch, _dtype(device), device)
    cache = model.new_cache(batch, context + new_tokens)
    tokens = model.new_tokens(batch, new_tokens)
    mask = model.mask(new_tokens, context)
    output = torch.empty((batch, new_tokens), dtype=torch.int64, device=device)

    def forward() -> None:
        output.copy_(model.forward(tokens, cache, context, mask))

    replay = _capture(forward, device)
    rng = random.Random(0)
    host_inputs = [torch.randint(0, arch.vocab, (batch, new_tokens)) for _ in range(steps)]
    if device.type == "cuda":
        host_inputs = [t.pin_memory() for t in host_inputs]
    bursts_ms = [rng.uniform(2.5, 5.0) for _ in range(steps)]

    def one_step(i: int) -> tuple[Any, Any, torch.Tensor]:
        tokens.copy_(host_inputs[i], non_blocking=True)
        start = _mark(device)
        replay()
        end = _mark(device)
        return start, end, output.to("cpu", copy=True)  # the runner reads its sampled tokens back every step

    reference = [one_step(i)[2] for i in range(steps)]
    stage.add({"shape": {"arch_layers": arch.layers, "hidden": arch.hidden, "batch": batch, "context": context,
                         "new_tokens": new_tokens, "steps": steps}, "step_ms": _step_ms(one_step, device, steps)})

    def run_variant(name: str, threaded: bool, bursts: bool, switch_s: float | None, own_stream: bool) -> None:
        previous_switch = sys.getswitchinterval()
        if switch_s is not None:
            sys.setswitchinterval(switch_s)
        before = _memory(device)
        marks: list[tuple[Any, Any]] = []
        outputs: list[torch.Tensor] = []
        started = time.perf_counter()
        try:
            if not threaded:
                for i in range(steps):
                    if bursts:
                        _burn(bursts_ms[i])
                    start, end, got = one_step(i)
                    marks.append((start, end))
                    outputs.append(got)
            else:
                handed: queue.Queue[int | None] = queue.Queue()
                failure: list[BaseException] = []

                def model_thread() -> None:
                    try:
                        stream = torch.cuda.Stream() if own_stream and device.type == "cuda" else None
                        context_manager = torch.cuda.stream(stream) if stream is not None else _nothing()
                        with context_manager:
                            while (i := handed.get()) is not None:
                                start, end, got = one_step(i)
                                marks.append((start, end))
                                outputs.append(got)
                    except BaseException as exc:  # reported by the main thread
                        failure.append(exc)

                worker = threading.Thread(target=model_thread, name="model", daemon=True)
                worker.start()
                handed.put(0)
                for i in range(1, steps):
                    if bursts:
                        _burn(bursts_ms[i])  # step i's scheduling, while step i - 1 runs
                    handed.put(i)
                handed.put(None)
                worker.join(timeout=60)
                if worker.is_alive():
                    raise TimeoutError("the model thread did not finish in 60 s")
                if failure:
                    raise failure[0]
            _sync(device)
        finally:
            sys.setswitchinterval(previous_switch)
        wall_ms = (time.perf_counter() - started) * 1000.0
        gaps = [_between(marks[i][1], marks[i + 1][0], device) for i in range(len(marks) - 1)]
        equal = len(outputs) == steps and all(torch.equal(a, b) for a, b in zip(outputs, reference, strict=True))
        stage.add({"variant": name, "idle_gap_ms": _quantiles(gaps), "outputs_equal": equal,
                   "wall_ms_per_step": round(wall_ms / steps, 3), "memory_before": before,
                   "memory_after": _memory(device),
                   "max_reserved_mib": (torch.cuda.max_memory_reserved() / 2**20 if device.type == "cuda" else None)})

    variants = [("sync", False, True, None, False), ("alone", True, False, None, False),
                ("bursts", True, True, None, False), ("bursts-switch-0.5ms", True, True, 0.0005, False),
                ("bursts-own-stream", True, True, None, True)]
    for variant in variants:
        if stage.elapsed_s() > STAGE_LIMITS_S["async-step"] * 0.8:
            stage.error(variant[0], TimeoutError("skipped: the stage's time is nearly spent"))
            continue
        try:
            run_variant(*variant)
        except Exception as exc:  # recorded; the other variants still run
            stage.error(variant[0], exc)
    stage.finish()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _mark(device: Any) -> Any:
    """A point in the device's time: a recorded CUDA event, or the host clock on a CPU."""
    import torch

    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _between(start: Any, end: Any, device: Any) -> float:
    if device.type != "cuda":
        return (end - start) * 1000.0
    return float(start.elapsed_time(end))


def _step_ms(one_step: Callable[[int], tuple[Any, Any, Any]], device: Any, steps: int) -> float:
    times = []
    for i in range(min(steps, 20)):
        start, end, _ = one_step(i)
        _sync(device)
        times.append(_between(start, end, device))
    return round(statistics.median(times), 4)


# -- stage: drafter-job ---------------------------------------------------------------------------------------------

def stage_drafter_job(out: Path, dry_run: bool) -> None:
    """What a drafter job costs end to end, in its phases (the cost model's and the twin's drafting price):
    admission (the job's token lists and positions from Python lists to device tensors), the first pass over each
    request's k + 1 accepted/bonus tokens, the k - 1 one-token steps (CUDA graphs on CUDA, as vLLM's drafter runs
    its decode steps), sampling (argmax on the device and the drafts' copy to the host). Host wall time of the whole
    job beside the device phases (CUDA events)."""
    import torch

    from minedraft.profile.model import RandomDecoder

    stage = Stage(out, "drafter-job", dry_run)
    device = _device(dry_run)
    arch = _drafter_architecture(dry_run)
    k, context = 3, (32 if dry_run else 1024)
    batches = (2, 4) if dry_run else (16, 32, 64)
    jobs = 5 if dry_run else 30
    model = RandomDecoder(arch, _dtype(device), device)
    for batch in batches:
        if stage.elapsed_s() > STAGE_LIMITS_S["drafter-job"] * 0.7:
            stage.error(f"batch {batch}", TimeoutError("skipped: the stage's time is nearly spent"))
            continue
        try:
            stage.add(_drafter_job(model, device, batch, context, k, jobs))
        except Exception as exc:
            stage.error(f"batch {batch}", exc)
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
    stage.finish(model={"layers": arch.layers, "hidden": arch.hidden, "vocab": arch.vocab})


def _drafter_job(model: Any, device: Any, batch: int, context: int, k: int, jobs: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    cache = model.new_cache(batch, context + 2 * k)
    first_tokens = model.new_tokens(batch, k + 1)
    first_mask = model.mask(k + 1, context)
    step_tokens = [model.new_tokens(batch, 1) for _ in range(k - 1)]
    logits_first = torch.empty((batch, model.arch.vocab), dtype=model.dtype, device=device)
    logits_steps = [torch.empty_like(logits_first) for _ in range(k - 1)]

    def first() -> None:
        hidden = model.hidden_states(first_tokens, cache, context, first_mask)
        logits_first.copy_(F.linear(hidden[:, -1], model.lm_head))

    def make_step(j: int) -> Callable[[], None]:
        def step() -> None:
            hidden = model.hidden_states(step_tokens[j], cache, context + k + 1 + j, None)
            logits_steps[j].copy_(F.linear(hidden[:, -1], model.lm_head))
        return step

    first_replay = _capture(first, device)
    step_replays = [_capture(make_step(j), device) for j in range(k - 1)]
    phases: dict[str, list[float]] = {"admission_host_ms": [], "admission_ms": [], "first_forward_ms": [],
                                      "steps_ms": [], "sampling_ms": [], "job_wall_ms": []}
    rng = random.Random(batch)
    for _ in range(jobs + 2):  # two warm-up jobs
        lists = [[rng.randrange(model.arch.vocab) for _ in range(k + 1)] for _ in range(batch)]
        positions = [context + rng.randrange(4) for _ in range(batch)]
        wall = time.perf_counter()
        mark0 = _mark(device)
        host = torch.tensor(lists, dtype=torch.int64)
        where = torch.tensor(positions, dtype=torch.int64)
        if device.type == "cuda":
            host, where = host.pin_memory(), where.pin_memory()
        first_tokens.copy_(host, non_blocking=True)
        where.to(device, non_blocking=True)
        admission_host = (time.perf_counter() - wall) * 1000.0
        mark1 = _mark(device)
        first_replay()
        mark2 = _mark(device)
        drafts = [logits_first.argmax(dim=-1)]
        for j, replay in enumerate(step_replays):
            step_tokens[j].copy_(drafts[-1].view(batch, 1))
            replay()
            drafts.append(logits_steps[j].argmax(dim=-1))
        mark3 = _mark(device)
        on_host = torch.stack(drafts, dim=1).cpu()
        mark4 = _mark(device)
        _sync(device)
        job_wall = (time.perf_counter() - wall) * 1000.0
        assert on_host.shape == (batch, k)
        phases["admission_host_ms"].append(admission_host)
        phases["admission_ms"].append(_between(mark0, mark1, device))
        phases["first_forward_ms"].append(_between(mark1, mark2, device))
        phases["steps_ms"].append(_between(mark2, mark3, device))
        phases["sampling_ms"].append(_between(mark3, mark4, device))
        phases["job_wall_ms"].append(job_wall)
    medians = {name: round(statistics.median(values[2:]), 4) for name, values in phases.items()}
    return {"batch": batch, "context": context, "k": k, "jobs": jobs, **medians,
            "job_wall_p90_ms": _quantiles(phases["job_wall_ms"][2:]).get("p90")}


# -- stage: keyed ---------------------------------------------------------------------------------------------------

def stage_keyed(out: Path, dry_run: bool) -> None:
    """The keyed race at 32-256 rows x 151,936 vocabulary (fp32 logits, random 32-bit keys): the one-pass kernel
    (Triton on CUDA; on a CPU dry run its torch form) against the reference race (`race_scores(...).argmax`), time
    per call (median of 10, CUDA events), the peak memory each allocates beyond its input, winners equal."""
    import torch

    from minedraft.engine.vllm_adapter import keyed_race

    stage = Stage(out, "keyed", dry_run)
    device = _device(dry_run)
    vocab = 1031 if dry_run else 151_936
    if device.type == "cuda":
        if not keyed_race.triton_available():
            stage.error("kernel", RuntimeError("Triton is not importable here"))
            stage.finish()
            return
        kernel: Callable[[Any, Any], Any] = keyed_race.triton_winners
        kernel_name = "triton"
    else:
        kernel, kernel_name = (lambda logits, keys: keyed_race.single_pass_winners(logits, keys)), "single-pass torch"
    for rows in (32, 64, 128, 256):
        if stage.elapsed_s() > STAGE_LIMITS_S["keyed"] * 0.7:
            stage.error(f"rows {rows}", TimeoutError("skipped: the stage's time is nearly spent"))
            continue
        try:
            generator = torch.Generator(device=device).manual_seed(rows)
            logits = torch.randn(rows, vocab, device=device, generator=generator) * 4.0
            keys = torch.randint(0, 2**32, (rows,), dtype=torch.int64, device=device, generator=generator)
            result: dict[str, Any] = {"rows": rows, "vocab": vocab, "kernel": kernel_name}
            winners = {}
            for name, fn in (("kernel", kernel),
                             ("reference", lambda x, y: keyed_race.race_scores(x, y).argmax(dim=-1))):
                ms, peak_mib, winners[name] = _time_and_peak(fn, logits, keys, device, repeats=3 if dry_run else 10)
                result[f"{name}_ms"], result[f"{name}_peak_mib"] = ms, peak_mib
            result["equal"] = bool(torch.equal(winners["kernel"], winners["reference"]))
            result["speedup"] = round(result["reference_ms"] / max(result["kernel_ms"], 1e-6), 2)
            stage.add(result)
        except Exception as exc:
            stage.error(f"rows {rows}", exc)
    stage.finish()


def _time_and_peak(fn: Callable[[Any, Any], Any], logits: Any, keys: Any, device: Any,
                   repeats: int) -> tuple[float, float | None, Any]:
    import torch

    result = fn(logits, keys)  # warm-up (compiles the kernel)
    _sync(device)
    peak: float | None = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        result = fn(logits, keys)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    times = []
    for _ in range(repeats):
        start = _mark(device)
        fn(logits, keys)
        end = _mark(device)
        _sync(device)
        times.append(_between(start, end, device))
    return round(statistics.median(times), 4), None if peak is None else round(peak, 2), result


# -- stage: window --------------------------------------------------------------------------------------------------

def stage_window(out: Path, dry_run: bool) -> None:
    """A windowed drafter against the graph loop. The engine's windowed torch drafter (torch_window.py) reads at
    most 4 sinks + a 512-token window (+ a 16-position rollback margin) whatever the context, and runs eagerly; it
    cannot be built here (it loads a model through transformers, absent on the device machine), so its shapes are
    measured with the profiler's decoder: the k = 3 draft loop eager over the ring's 532 positions, against the same
    loop as a CUDA graph over the whole context (what vLLM's drafter runs), and eager over the whole context."""
    import torch

    from minedraft.profile.model import RandomDecoder

    stage = Stage(out, "window", dry_run)
    device = _device(dry_run)
    arch = _drafter_architecture(dry_run)
    k = 3
    ring = 36 if dry_run else 4 + 512 + 16
    contexts = (128,) if dry_run else (4096, 8192)
    batches = (2,) if dry_run else (8, 32)
    model = RandomDecoder(arch, _dtype(device), device)
    for batch in batches:
        for context in contexts:
            if stage.elapsed_s() > STAGE_LIMITS_S["window"] * 0.7:
                stage.error(f"batch {batch} context {context}",
                            TimeoutError("skipped: the stage's time is nearly spent"))
                continue
            try:
                result: dict[str, Any] = {"batch": batch, "context": context, "ring": ring, "k": k}
                for name, positions, graph in (("graph_full_ms", context, True), ("eager_full_ms", context, False),
                                               ("eager_window_ms", ring, False), ("graph_window_ms", ring, True)):
                    if graph and device.type != "cuda":
                        continue
                    result[name] = _draft_loop_ms(model, device, batch, positions, k, graph)
                if "graph_full_ms" in result:
                    result["eager_window_over_graph_full"] = round(
                        result["eager_window_ms"] / result["graph_full_ms"], 3)
                stage.add(result)
            except Exception as exc:
                stage.error(f"batch {batch} context {context}", exc)
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    stage.finish()


def _draft_loop_ms(model: Any, device: Any, batch: int, context: int, k: int, graph: bool) -> float:
    cache = model.new_cache(batch, context + 2 * k)
    tokens = model.new_tokens(batch, k + 1)
    mask = model.mask(k + 1, context)

    def loop() -> None:
        model.draft_loop(tokens, cache, context, k, mask)

    run = _capture(loop, device) if graph else loop
    run()
    _sync(device)
    times = []
    for _ in range(5):
        start = _mark(device)
        run()
        end = _mark(device)
        _sync(device)
        times.append(_between(start, end, device))
    return round(statistics.median(times), 4)


# -- summary --------------------------------------------------------------------------------------------------------

def summarize(out: Path) -> dict[str, Any]:
    """Every stage's file into one document, with each stage's status (missing: it never started, or was killed
    before writing; running: killed by its limit)."""
    stages = {}
    for name in ("check", *STAGES):
        path = out / f"{name}.json"
        if not path.exists():
            stages[name] = {"status": "missing"}
            continue
        stages[name] = json.loads(path.read_text())
    return {"format": "minedraft-gpu-session/v1", "written": _now(), "limits_s": STAGE_LIMITS_S, "stages": stages}


def summary_markdown(doc: dict[str, Any]) -> str:
    lines = ["# GPU session", "", f"written {doc['written']}", ""]
    check = doc["stages"].get("check", {})
    if check.get("device"):
        lines += [f"device: {check['device']}", ""]
    lines += ["| stage | status | seconds | results | errors |", "|---|---|---|---|---|"]
    for name, stage in doc["stages"].items():
        lines.append(f"| {name} | {stage.get('status')} | {stage.get('seconds', '')} | "
                     f"{len(stage.get('results', []))} | {len(stage.get('errors', []))} |")
    for name in STAGES:
        stage = doc["stages"].get(name, {})
        if not stage.get("results"):
            continue
        lines += ["", f"## {name}", ""]
        for result in stage["results"]:
            shown = {key: value for key, value in result.items() if key not in ("curves", "command")}
            lines.append(f"- {json.dumps(shown)}")
        for error in stage.get("errors", []):
            lines.append(f"- error: {error['what']}: {error['error']}")
    return "\n".join(lines) + "\n"


def stage_check(out: Path, dry_run: bool) -> None:
    import torch

    stage = Stage(out, "check", dry_run)
    device = _device(dry_run)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU (dry run)"
    info: dict[str, Any] = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        info.update(free_gib=round(free / 2**30, 1), total_gib=round(total / 2**30, 1))
    stage.add(info)
    stage.finish(device=name)


RUNNERS: dict[str, Callable[[Path, bool], None]] = {
    "check": stage_check, "curves": stage_curves, "async-step": stage_async_step, "drafter-job": stage_drafter_job,
    "keyed": stage_keyed, "window": stage_window}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minedraft.profile.session",
                                     description="one stage of scripts/gpu_session.sh")
    parser.add_argument("stage", choices=[*RUNNERS, "summary", "limits"])
    parser.add_argument("--out", required=True, type=Path, help="the session's results directory")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU at tiny shapes")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage == "limits":
        print(" ".join(f"{name}={seconds}" for name, seconds in STAGE_LIMITS_S.items()))
        return 0
    if args.stage == "summary":
        doc = summarize(args.out)
        (args.out / "summary.json").write_text(json.dumps(doc, indent=1) + "\n")
        (args.out / "summary.md").write_text(summary_markdown(doc))
        print(summary_markdown(doc))
        return 0 if all(stage.get("status") == "done" for stage in doc["stages"].values()) else 1
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    RUNNERS[args.stage](args.out, args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
