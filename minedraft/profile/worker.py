"""The measuring process: `python -m minedraft.profile.worker`, a job (JSON) on stdin, events (JSON lines) on stdout.

    {"event": "ready", "device": "..."}                      models built, measuring starts
    {"event": "start", "id": N}                              measurement N begins (its timeout runs from here)
    {"event": "result", "id": N, "ms": ..., ...}             measurement N done
    {"event": "error", "id": N, "message": "..."}            measurement N failed (out of memory, ...); next one

It is killed from outside when a measurement outlives its timeout (minedraft.profile.supervisor); a hang here can
therefore cost one measurement, never the run.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from minedraft.profile.architecture import Architecture
from minedraft.profile.model import DTYPES, RandomDecoder
from minedraft.profile.shapes import Measurement, cache_tokens
from minedraft.profile.timing import TimingSettings, capture, time_cuda_graph, time_eager, time_two_streams


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB, one GPU)"
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    threads = torch.get_num_threads()
    return f"CPU: {model}, {threads} torch thread{'' if threads == 1 else 's'}"


class Worker:
    def __init__(self, job: dict[str, Any]):
        self.device = torch.device(job["device"])
        if self.device.type == "cuda":
            # Streams, events, graphs and synchronizes below act on the current device: make it this one.
            torch.cuda.set_device(self.device)
        self.dtype = DTYPES[job["dtype"]]
        self.eager = bool(job.get("eager")) or self.device.type != "cuda"
        self.timing = TimingSettings(**job.get("timing", {}))
        self.models = {name: RandomDecoder(Architecture.from_json(arch), self.dtype, self.device, seed=i)
                       for i, (name, arch) in enumerate(sorted(job["models"].items()))}

    def measure(self, m: Measurement) -> dict[str, float]:
        if m.kind == "concurrent":
            return self._concurrent(m)
        model = self.models[m.model]
        cache = model.new_cache(m.batch, cache_tokens(m.context, m.tokens, m.kind))
        num = m.tokens if m.kind in ("forward", "prefill") else m.tokens + 1
        tokens = model.new_tokens(m.batch, num)
        mask = model.mask(num, m.context)
        if m.kind == "forward":
            def fn() -> torch.Tensor:
                return model.forward(tokens, cache, m.context, mask)
        elif m.kind == "prefill":
            def fn() -> torch.Tensor:
                return model.prefill(tokens, cache, m.context, mask)
        else:
            def fn() -> torch.Tensor:
                return model.draft_loop(tokens, cache, m.context, m.tokens, mask)
        if self.eager:
            return {"ms": time_eager(fn, self.timing, self.device)}
        return {"ms": time_cuda_graph(fn, self.timing)}

    def _concurrent(self, m: Measurement) -> dict[str, float]:
        """A verification of the target (k + 1 tokens) and a k-token draft loop of the drafter, each for `batch`
        requests (PSD's two sub-batches), both captured first, one after the other, then replayed on two streams."""
        target, drafter = self.models[m.model], self.models[m.drafter]
        num = m.tokens + 1
        t_cache = target.new_cache(m.batch, cache_tokens(m.context, num, "forward"))
        d_cache = drafter.new_cache(m.batch, cache_tokens(m.context, m.tokens, "draft_loop"))
        t_tokens, d_tokens = target.new_tokens(m.batch, num), drafter.new_tokens(m.batch, num)
        t_mask, d_mask = target.mask(num, m.context), drafter.mask(num, m.context)
        t_graph = capture(lambda: target.forward(t_tokens, t_cache, m.context, t_mask), self.timing)
        d_graph = capture(lambda: drafter.draft_loop(d_tokens, d_cache, m.context, m.tokens, d_mask), self.timing)
        return time_two_streams(t_graph, d_graph, self.timing)

    def release(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def main() -> int:
    job = json.loads(sys.stdin.read())
    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    torch.set_flush_denormal(True)
    with torch.inference_mode():
        worker = Worker(job)
        emit("ready", device=describe_device(worker.device), torch=torch.__version__, pid=os.getpid())
        for item in job["measurements"]:
            m = Measurement.from_json(item["measurement"])
            emit("start", id=item["id"])
            try:
                emit("result", id=item["id"], **worker.measure(m))
            except Exception as exc:  # one measurement's failure (out of memory, ...) is reported, not fatal
                traceback.print_exc(file=sys.stderr)
                emit("error", id=item["id"], message=f"{type(exc).__name__}: {exc}")
                if worker.device.type == "cuda":
                    # A failure inside a capture can leave the CUDA context unusable for what follows: end here
                    # (cleanly) and let the supervisor hand the rest to a fresh process.
                    return 0
            worker.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
