"""A closed-loop load: keep C requests in flight until N are done; time every token of every request."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from minedraft.engine.requests import SamplingSettings
from minedraft.engine.serving import ServingEngine


@dataclass(frozen=True)
class Workload:
    prompts: list[str]
    concurrency: int
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None


@dataclass(frozen=True)
class Trace:
    """Load that changes over time: closed-loop phases run back to back (e.g. 1, then 32, then 4 in flight)."""

    phases: list[Workload]

    @classmethod
    def parse(cls, spec: str, prompts: list[str], max_tokens: int) -> Trace:
        """`C:N,C:N,...`: N requests at concurrency C per phase, prompts taken in order (wrapping around)."""
        phases: list[Workload] = []
        offset = 0
        for part in spec.split(","):
            try:
                concurrency, count = (int(v) for v in part.split(":"))
            except ValueError:
                raise ValueError(f"trace: expected C:N pairs separated by commas, got {part!r}") from None
            if concurrency < 1 or count < 1:
                raise ValueError(f"trace: concurrency and request count must be positive in {part!r}")
            chosen = [prompts[(offset + i) % len(prompts)] for i in range(count)]
            offset += count
            phases.append(Workload(chosen, concurrency, max_tokens))
        return cls(phases)

    @property
    def label(self) -> str:
        return ",".join(f"{p.concurrency}:{len(p.prompts)}" for p in self.phases)


@dataclass(frozen=True)
class RequestResult:
    index: int
    token_ids: list[int]
    ttft_seconds: float
    e2e_seconds: float
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def tpot_seconds(self) -> float:
        """Time per output token after the first."""
        n = len(self.token_ids)
        return (self.e2e_seconds - self.ttft_seconds) / (n - 1) if n > 1 else 0.0


def bench_prompts(pair_dir: Path, count: int, chars: int = 240, stride: int = 90) -> list[str]:
    """Deterministic prompts cut from the pair's held-out text (code the models never trained on)."""
    from minedraft.models.check import load_heldout

    snippets = load_heldout(pair_dir)
    prompts: list[str] = []
    offset = 0
    while len(prompts) < count:
        for snippet in snippets:
            piece = snippet[offset : offset + chars]
            if len(piece) == chars:
                prompts.append(piece)
                if len(prompts) == count:
                    break
        offset += stride
        if offset + chars > max(len(s) for s in snippets):
            offset = 0
            chars -= 7  # keep later rounds distinct rather than repeating prompts
    return prompts


async def run_workload(engine: ServingEngine, workload: Workload) -> tuple[list[RequestResult], float]:
    """Returns per-request results (in prompt order) and the makespan in seconds."""
    semaphore = asyncio.Semaphore(workload.concurrency)
    results: list[RequestResult | None] = [None] * len(workload.prompts)

    async def one(index: int, prompt: str) -> None:
        async with semaphore:
            sampling = SamplingSettings(
                max_tokens=workload.max_tokens,
                temperature=workload.temperature,
                seed=None if workload.seed is None else workload.seed + index,
                ignore_eos=True,
            )
            started = time.perf_counter()
            first: float | None = None
            token_ids: list[int] = []
            drafted = accepted = 0
            async for delta in engine.generate(prompt, sampling):
                if delta.token_ids and first is None:
                    first = time.perf_counter()
                token_ids.extend(delta.token_ids)
                if delta.finished:
                    drafted, accepted = delta.num_draft_tokens, delta.num_accepted_tokens
            ended = time.perf_counter()
            results[index] = RequestResult(
                index, token_ids, (first or ended) - started, ended - started, drafted, accepted
            )

    started = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(workload.prompts)))
    makespan = time.perf_counter() - started
    return [r for r in results if r is not None], makespan


async def run_trace(engine: ServingEngine, trace: Trace) -> tuple[list[RequestResult], float]:
    results: list[RequestResult] = []
    makespan = 0.0
    for phase in trace.phases:
        phase_results, phase_seconds = await run_workload(engine, phase)
        offset = len(results)
        results.extend(RequestResult(offset + r.index, r.token_ids, r.ttft_seconds, r.e2e_seconds,
                                     r.num_draft_tokens, r.num_accepted_tokens) for r in phase_results)
        makespan += phase_seconds
    return results, makespan


def result_to_dict(result: RequestResult) -> dict[str, Any]:
    data = asdict(result)
    data["tpot_seconds"] = result.tpot_seconds
    return data
