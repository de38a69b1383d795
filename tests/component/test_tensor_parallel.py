"""Tensor parallelism on this CPU (vLLM's multiprocess executor, one worker per core): psd, sd and ar stay lossless.

One TP = 2 engine serves every test here: its ar mode (no drafts at all) is the target alone at TP = 2, so psd and
sd are compared with it on the same workers. The CPU kernel correction must be live in each worker process (it was
installed only in-process before), which the temperature-1 test depends on and the first test checks directly.
"""

from __future__ import annotations

import pytest

from minedraft.engine.requests import SamplingSettings
from minedraft.engine.settings import Mode

from .conftest import engine_settings
from .device_checks import assert_greedy_matches
from .driver import Planned, drive
from .patience import drafts_missing, wait_for_drafts

pytestmark = pytest.mark.engine

GREEDY = SamplingSettings(max_tokens=32)


@pytest.fixture(scope="module")
def tp_engine(pair_dir):
    from minedraft.engine.core import Engine

    engine = Engine(engine_settings(pair_dir, Mode.PSD, tensor_parallel_size=2, target_cpu_cores=(),
                                    max_num_speculative_tokens=3))
    assert engine.wait_for_drafter(300), "drafter did not start"
    # Two TP ranks and the drafter on two cores: drafts arrive late often; the tests are about what they compute.
    yield wait_for_drafts(engine)
    engine.shutdown()


@pytest.fixture(scope="module")
def tp_prompts(pair_dir, tp_engine) -> list[list[int]]:
    from minedraft.bench.workload import bench_prompts

    return [tp_engine.encode_prompt(t) for t in bench_prompts(pair_dir, 8, chars=160)]


def run_mode(engine, mode: Mode, prompts: list[list[int]], sampling: SamplingSettings, tag: str) -> list[list[int]]:
    engine.set_mode(mode, None if mode is Mode.AR else 3, 0)
    run = drive(engine, [Planned(f"{tag}-{i}", p, sampling) for i, p in enumerate(prompts)])
    return [run.completions[f"{tag}-{i}"].token_ids for i in range(len(prompts))]


@pytest.fixture(scope="module")
def tp_references(tp_engine, tp_prompts) -> list[list[int]]:
    return run_mode(tp_engine, Mode.AR, tp_prompts, GREEDY, "ref")


def test_every_worker_runs_the_corrected_cpu_kernel(tp_engine):
    installed = tp_engine._llm.collective_rpc("minedraft_cpu_fixes_installed")
    assert installed == [True, True], f"CPU kernel correction per worker: {installed}"


@pytest.mark.parametrize("mode", [Mode.PSD, Mode.SD])
def test_greedy_output_equals_ar_at_tp2(tp_engine, tp_prompts, tp_references, mode):
    before = tp_engine.totals()
    outputs = run_mode(tp_engine, mode, tp_prompts, GREEDY, f"g-{mode.value}")
    assert_greedy_matches(outputs, tp_references, f"{mode.value} at TP=2")
    after = tp_engine.totals()
    assert after.accepted_tokens > before.accepted_tokens, drafts_missing(tp_engine, before, after)


def test_drafter_killed_mid_run_at_tp2_loses_nothing(tp_engine, tp_prompts, tp_references):
    tp_engine.set_mode(Mode.PSD, 3, 0)
    assert tp_engine.wait_for_drafter(300)
    scheduler = tp_engine.psd_scheduler
    for i, prompt in enumerate(tp_prompts):
        tp_engine.add_request(f"kill-{i}", prompt, GREEDY)
    outputs: dict[str, list[int]] = {f"kill-{i}": [] for i in range(len(tp_prompts))}
    steps = 0
    while tp_engine.has_unfinished_requests():
        if steps == 4:
            scheduler.drafter.kill()
        for delta in tp_engine.step():
            outputs[delta.request_id].extend(delta.token_ids)
        steps += 1
    assert_greedy_matches([outputs[f"kill-{i}"] for i in range(len(tp_prompts))], tp_references,
                          "psd at TP=2 with the drafter killed")
    assert tp_engine.wait_for_drafter(300), "the drafter came back"


def test_temperature_one_matches_the_target_distribution_at_tp2(tp_engine, tp_prompts):
    """Chi-square on tokens verified against drafts: psd vs ar on the same TP = 2 workers (as in test_engine)."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    n, positions = 300, 2

    def histograms(mode: Mode, tag: str) -> list[Counter[int]]:
        sampling = [SamplingSettings(max_tokens=positions + 1, temperature=1.0, seed=20_000 + i, ignore_eos=True)
                    for i in range(n)]
        tp_engine.set_mode(mode, None if mode is Mode.AR else 3, 0)
        run = drive(tp_engine, [Planned(f"{tag}-{i}", tp_prompts[5], s) for i, s in enumerate(sampling)])
        return [Counter(run.completions[f"{tag}-{i}"].token_ids[pos] for i in range(n))
                for pos in range(1, positions + 1)]

    tp_engine.set_mode(Mode.PSD, 3, 0)
    assert tp_engine.wait_for_drafter(300)
    before = tp_engine.totals()
    psd_hist = histograms(Mode.PSD, "t1-psd")
    after = tp_engine.totals()
    assert after.accepted_tokens > before.accepted_tokens, drafts_missing(tp_engine, before, after)
    ar_hist = histograms(Mode.AR, "t1-ar")
    for position, (a, b) in enumerate(zip(psd_hist, ar_hist, strict=True), start=1):
        common = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
        rows = [[a[t] for t in common] + [n - sum(a[t] for t in common)],
                [b[t] for t in common] + [n - sum(b[t] for t in common)]]
        rows = [list(col) for col in zip(*[c for c in zip(*rows, strict=True) if sum(c) > 0], strict=True)]
        _, p_value, _, _ = chi2_contingency(rows)
        assert p_value > 0.001, f"token {position}: psd and ar distributions differ at TP=2 (p={p_value:.2g})"


def test_every_worker_keeps_both_sub_batches_resident(tp_engine, tp_prompts, tp_references):
    # Resident sub-batches are installed through the worker extension in each TP worker process: both ranks hold two
    # persistent batches and, fed the same scheduler outputs, the same requests in each.
    outputs = run_mode(tp_engine, Mode.PSD, tp_prompts, GREEDY, "resident")
    assert_greedy_matches(outputs, tp_references, "psd at TP=2, resident sub-batches")
    sizes = tp_engine.resident_batch_sizes()
    assert len(sizes) == 2 and all(len(per_worker) == 2 for per_worker in sizes), sizes
    assert sizes[0] == sizes[1], sizes
