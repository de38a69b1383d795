"""PSD's alternating sub-batches stay resident in the target's model runner (two persistent batches), losslessly.

vLLM's single persistent batch removes every request left out of a step and re-adds it (copying its whole context)
when next scheduled: with PSD that is half the running requests every step. These tests count the re-adds through
vLLM's own `InputBatch.add_request` in this process (the in-process engine's runner), with resident sub-batches on
and, on the same engine, off: the off run shows the count can see the churn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from minedraft.engine.requests import SamplingSettings

from .device_checks import assert_greedy_matches
from .driver import reference

pytestmark = pytest.mark.engine


def _runner(engine: Any) -> Any:
    return engine._llm.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


@contextlib.contextmanager
def _counting_batch_adds() -> Iterator[list[int]]:
    """[requests added to any persistent batch] while open (vLLM's InputBatch, every batch of every runner here)."""
    from vllm.v1.worker.gpu_input_batch import InputBatch

    count = [0]
    original = InputBatch.add_request

    def add_request(self: Any, request: Any) -> Any:
        count[0] += 1
        return original(self, request)

    InputBatch.add_request = add_request  # type: ignore[method-assign]
    try:
        yield count
    finally:
        InputBatch.add_request = original  # type: ignore[method-assign]


def _residents(engine: Any) -> list[set[str]]:
    """Each persistent batch's requests, by the ids the engine was given (vLLM adds a suffix of its own)."""
    runner = _runner(engine)
    return [{request_id.rsplit("-", 1)[0] for request_id in batch.req_id_to_index}
            for batch in runner.minedraft_batches]


@contextlib.contextmanager
def _counting_resent_tokens(engine: Any) -> Iterator[list[int]]:
    """[tokens vLLM's scheduler re-sent as whole contexts (`all_token_ids`)] in the step outputs while open."""
    scheduler = engine.scheduler
    count = [0]
    schedule = scheduler.schedule

    def counted(*args: Any, **kwargs: Any) -> Any:
        output = schedule(*args, **kwargs)
        count[0] += sum(len(t) for t in output.scheduled_cached_reqs.all_token_ids.values())
        return output

    scheduler.schedule = counted
    try:
        yield count
    finally:
        del scheduler.schedule


def _steady_adds(engine: Any, prompts: list[list[int]], sampling: SamplingSettings, tag: str) -> tuple[
        int, int, int, list[list[int]]]:
    """(re-adds and re-sent tokens in steady decode steps, steady steps, outputs): steady = every request past its
    prefill, none finished yet, so the set of running requests does not change and nothing needs adding. The first
    two such steps are left out: all requests prefill in one step, so one sub-batch lands in the other batch in its
    first turn."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, sampling)
    outputs: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(len(prompts))}
    started: set[str] = set()
    finished = False
    settled = 0
    steady_steps = steady_adds = steady_resent = 0
    with _counting_batch_adds() as adds, _counting_resent_tokens(engine) as resent:
        while engine.has_unfinished_requests():
            before, resent_before = adds[0], resent[0]
            steady = len(started) == len(prompts) and not finished
            for delta in engine.step():
                outputs[delta.request_id] += delta.token_ids
                started.add(delta.request_id)
                finished = finished or delta.finished
            settled += steady
            if steady and not finished and settled > 2:
                steady_steps += 1
                steady_adds += adds[0] - before
                steady_resent += resent[0] - resent_before
    return steady_adds, steady_resent, steady_steps, [outputs[f"{tag}-{i}"] for i in range(len(prompts))]


def test_steady_psd_decoding_does_not_re_add_requests_every_step(psd, ar_engine, pair_dir):
    from minedraft.bench.workload import bench_prompts

    prompts = [ar_engine.encode_prompt(t) for t in bench_prompts(pair_dir, 8, chars=200)]
    sampling = SamplingSettings(max_tokens=40, ignore_eos=True)
    expected = reference(ar_engine, prompts, sampling)
    try:
        psd.set_resident_sub_batches(False)
        churn_adds, churn_resent, churn_steps, churn_outputs = _steady_adds(psd, prompts, sampling, "churn")
    finally:
        psd.set_resident_sub_batches(True)
    adds, resent, steps, outputs = _steady_adds(psd, prompts, sampling, "resident")
    assert churn_steps >= 4 and steps >= 4, "too few steady steps to compare"
    # One persistent batch: each step re-adds the sub-batch left out of the previous one (4 of 8 requests).
    assert churn_adds >= 2 * churn_steps, f"vLLM's own path re-added only {churn_adds} in {churn_steps} steps"
    # Two: a request is added only when it changes sub-batch (none do while the running set is unchanged) or when
    # a late draft lets it decode beside the other sub-batch.
    assert adds <= steps // 4, f"{adds} requests re-added in {steps} steady steps"
    # The scheduler side: vLLM re-sends the whole context of each request that sat out the previous step.
    assert churn_resent > 0 and resent == 0, (churn_resent, resent)
    print(f"steady steps: one persistent batch re-added {churn_adds} in {churn_steps} (re-sent {churn_resent} tokens), "
          f"two {adds} in {steps} (re-sent {resent})")
    assert_greedy_matches(churn_outputs, expected, "psd, one persistent batch")
    assert_greedy_matches(outputs, expected, "psd, resident sub-batches")


def test_moves_between_sub_batches_aborts_and_finishes_stay_lossless(psd, ar_engine, pair_dir):
    from minedraft.bench.workload import bench_prompts

    count = 10
    prompts = [ar_engine.encode_prompt(t) for t in bench_prompts(pair_dir, count, chars=160)]
    longest = SamplingSettings(max_tokens=60, ignore_eos=True)
    expected = reference(ar_engine, prompts, longest)
    # Staggered arrivals and lengths: finishes unbalance the sub-batches and rebalancing moves requests between them.
    lengths = [6 + 6 * i for i in range(count)]  # up to the reference's 60
    abort_after = {3: 10, 6: 14}
    arrivals = {i: 2 * (i % 4) for i in range(count)}
    outputs: dict[int, list[int]] = {i: [] for i in range(count)}
    seen_in: dict[str, set[int]] = {}
    finished: set[int] = set()
    aborted: set[int] = set()
    step = 0
    while step == 0 or psd.has_unfinished_requests() or len(finished | aborted) < count:
        for i, at in arrivals.items():
            if at == step:
                psd.add_request(f"move-{i}", prompts[i], SamplingSettings(max_tokens=lengths[i], ignore_eos=True))
        # vLLM tells the runner about finishes and aborts in the next step: by its end they have left both batches.
        alive = {f"move-{i}" for i, at in arrivals.items() if at <= step and i not in finished | aborted}
        for delta in psd.step():
            i = int(delta.request_id.split("-")[1])
            outputs[i] += delta.token_ids
            if delta.finished:
                finished.add(i)
            elif i in abort_after and len(outputs[i]) >= abort_after[i] and i not in aborted:
                psd.abort([delta.request_id])
                aborted.add(i)
        residents = _residents(psd)
        assert not residents[0] & residents[1], f"step {step}: requests in both persistent batches"
        assert residents[0] | residents[1] <= alive, f"step {step}: finished requests still resident"
        for index, batch in enumerate(residents):
            for request_id in batch:
                seen_in.setdefault(request_id, set()).add(index)
        step += 1
        assert step < 3000, "the engine did not finish"
    moved = [request_id for request_id, batches in seen_in.items() if len(batches) == 2]
    assert moved, "no request changed persistent batch: the test proves nothing"
    assert len(seen_in) == count
    for i in range(count):
        assert outputs[i] == expected[i][: len(outputs[i])], f"request {i} diverged from the target alone"
        if i not in aborted:
            assert len(outputs[i]) == lengths[i]
    # One worker, two persistent batches, holding what the runner itself says it holds.
    assert psd.resident_batch_sizes() == [[len(batch) for batch in _residents(psd)]]
    assert len(psd.resident_batch_sizes()[0]) == 2
