"""Tensor parallelism on this CPU (vLLM's multiprocess executor, one worker per core): psd, sd and ar stay lossless.

One TP = 2 engine serves every test here: its ar mode (no drafts at all) is the target alone at TP = 2, so psd and
sd are compared with it on the same workers. The CPU kernel correction must be live in each worker process (it was
installed only in-process before), which the temperature-1 test depends on and the first test checks directly.
"""

from __future__ import annotations

import pytest

from minedraft.engine.requests import SamplingSettings
from minedraft.engine.settings import Mode

from .conftest import engine_settings, on_all_process_cores
from .device_checks import assert_greedy_matches
from .driver import Planned, drive
from .patience import drafts_missing, wait_for_drafts

pytestmark = pytest.mark.engine

GREEDY = SamplingSettings(max_tokens=32)


@pytest.fixture(scope="module", autouse=True)
def _all_process_cores():
    """Two TP ranks need two cores: the module runs on all of them, whichever engine test left this thread bound to
    its target's one core (the TP engine and the served one sized themselves from it: every test here failed)."""
    with on_all_process_cores():
        yield


@pytest.fixture(scope="module")
def tp_engine(pair_dir, _all_process_cores):
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


def test_no_step_asks_the_workers_for_in_worker_drafts(tp_engine, tp_prompts, monkeypatch):
    """vLLM's post_step asked every worker for the in-worker proposer's drafts after each step (a collective RPC at
    TP > 1) and MineDraft discarded the answer: that round trip is gone."""
    from minedraft.engine.vllm_adapter.engine_core import in_process_core

    executor = in_process_core(tp_engine._llm).model_executor
    calls = []
    original = executor.take_draft_token_ids
    monkeypatch.setattr(executor, "take_draft_token_ids", lambda: calls.append(1) or original())
    outputs = run_mode(tp_engine, Mode.PSD, tp_prompts[:2], SamplingSettings(max_tokens=8), "no-take")
    assert all(len(tokens) == 8 for tokens in outputs)
    assert calls == []


@pytest.mark.parametrize("mode", [Mode.PSD, Mode.SD])
def test_greedy_output_equals_ar_at_tp2(tp_engine, tp_prompts, tp_references, mode):
    before = tp_engine.totals()
    outputs = run_mode(tp_engine, mode, tp_prompts, GREEDY, f"g-{mode.value}")
    assert_greedy_matches(outputs, tp_references, f"{mode.value} at TP=2")
    after = tp_engine.totals()
    assert after.accepted_tokens > before.accepted_tokens, drafts_missing(tp_engine, before, after)
    if mode is Mode.PSD:
        # Resident sub-batches are installed through the worker extension in each TP worker process: both ranks
        # hold two persistent batches and, fed the same scheduler outputs, the same requests in each. (Checked on
        # this run rather than on a psd run of its own: the same workload took ~15-25 s more of the suite.)
        sizes = tp_engine.resident_batch_sizes()
        assert len(sizes) == 2 and all(len(per_worker) == 2 for per_worker in sizes), sizes
        assert sizes[0] == sizes[1], sizes


def test_async_psd_steps_at_tp2_overlap_through_the_workers_and_match_synchronous_steps(
        tp_engine, tp_prompts, tp_references):
    """Async PSD steps at TP = 2: each step scheduled ahead is one non-blocking RPC to the worker processes, sent
    while they compute the step before (overlap.WorkerProcesses), with arrivals mid-run and an abort while a step is
    in flight: greedy output token-identical to synchronous steps (ar at TP = 2 on the same workers, which synchronous
    psd equals: test_greedy_output_equals_ar_at_tp2)."""
    from minedraft.engine.vllm_adapter.overlap import WorkerProcesses

    engine = tp_engine
    assert engine.overlap is not None and isinstance(engine.overlap._launcher, WorkerProcesses)
    engine.set_mode(Mode.PSD, 3, 0)
    assert engine.wait_for_drafter(300)
    records_before = engine.step_records()
    first_step = records_before[-1].step if records_before else 0
    ahead_before = engine.overlap.counters.ahead
    before = engine.totals()
    engine.set_async_psd_steps(True)
    try:
        run = drive(engine, [Planned(f"tp-async-{i}", p, GREEDY, arrive_at_step=(i % 4) * 3,
                                     abort_after_tokens=8 if i == 5 else None) for i, p in enumerate(tp_prompts)])
    finally:
        engine.set_async_psd_steps(False)
    assert run.aborted == {"tp-async-5"}
    outputs, expected = [], []
    for i in range(len(tp_prompts)):
        tokens = run.completions[f"tp-async-{i}"].token_ids
        outputs.append(tokens)
        expected.append(tp_references[i][: len(tokens)] if i == 5 else tp_references[i])
    assert_greedy_matches(outputs, expected, "async psd steps at TP=2")
    after = engine.totals()
    assert after.accepted_tokens > before.accepted_tokens, drafts_missing(engine, before, after)
    records = engine.step_records(first_step)
    ahead = [r for r in records if r.scheduled_ahead]
    assert ahead and engine.overlap.counters.ahead > ahead_before, "no step was scheduled ahead at TP=2"
    by_step = {r.step: r for r in records}
    for r in ahead:
        previous = by_step.get(r.step - 1)
        # A step scheduled ahead verifies the other sub-batch than the step in flight (never the same requests).
        assert r.mode == "psd" and previous is not None and r.verified_group == 1 - previous.verified_group, r
    assert not engine.has_unfinished_requests()
    assert engine.psd_scheduler.core.subbatches.sizes() == (0, 0)


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
    # vLLM's sampling (per-request generators) on both ranks; keyed races are checked below.
    tp_engine.set_reproducible_seeds(False)
    try:
        before = tp_engine.totals()
        psd_hist = histograms(Mode.PSD, "t1-psd")
        after = tp_engine.totals()
        assert after.accepted_tokens > before.accepted_tokens, drafts_missing(tp_engine, before, after)
        ar_hist = histograms(Mode.AR, "t1-ar")
    finally:
        tp_engine.set_reproducible_seeds(True)
    for position, (a, b) in enumerate(zip(psd_hist, ar_hist, strict=True), start=1):
        common = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
        rows = [[a[t] for t in common] + [n - sum(a[t] for t in common)],
                [b[t] for t in common] + [n - sum(b[t] for t in common)]]
        rows = [list(col) for col in zip(*[c for c in zip(*rows, strict=True) if sum(c) > 0], strict=True)]
        _, p_value, _, _ = chi2_contingency(rows)
        assert p_value > 0.001, f"token {position}: psd and ar distributions differ at TP=2 (p={p_value:.2g})"
    # Keyed races on both ranks: seeded psd gives the target alone's tokens exactly.
    seeded = [SamplingSettings(max_tokens=12, temperature=1.0, seed=500 + i, ignore_eos=True) for i in range(6)]
    outputs = {}
    for mode in (Mode.AR, Mode.PSD):
        tp_engine.set_mode(mode, None if mode is Mode.AR else 3, 0)
        if mode is Mode.PSD:
            assert tp_engine.wait_for_drafter(300)
        run = drive(tp_engine, [Planned(f"k-{mode.value}-{i}", tp_prompts[i], s) for i, s in enumerate(seeded)])
        outputs[mode] = [run.completions[f"k-{mode.value}-{i}"].token_ids for i in range(6)]
    assert outputs[Mode.PSD] == outputs[Mode.AR], "seeded psd differs from the target alone at TP=2"


def test_serve_at_tp2_answers_as_the_target_alone(pair_dir, tp_prompts, tp_references, tmp_path):
    """`minedraft serve --tensor-parallel-size 2` end to end: its workers start by spawn (the serving process already
    runs gRPC and ZMQ threads before the engine loads) and one greedy psd request over gRPC equals ar at TP=2.

    The engine runs in a process of its own (the serving process's child, the workers' parent), streaming through
    it; killing that process ends the open stream with UNAVAILABLE and turns readiness NOT_SERVING, as an engine
    loop dying in-process does, while the server itself lives on."""
    import asyncio
    import os
    import re
    import signal
    import subprocess
    import sys
    import threading

    import grpc

    from minedraft.api import pb, pb_grpc

    from .grpc_helpers import wait_for_health

    process = subprocess.Popen(
        [sys.executable, "-m", "minedraft.cli", "serve", "--model", str(pair_dir / "target"), "--draft",
         str(pair_dir / "draft"), "--mode", "psd", "--tensor-parallel-size", "2", "--num-speculative-tokens", "3",
         "--max-model-len", "512", "--kv-cache-gib", "1", "--max-num-seqs", "8", "--host", "127.0.0.1",
         "--grpc-port", "0", "--metrics-port", "0"],
        env={k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    found = threading.Event()

    def read_stderr() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line)
            if "gRPC on" in line:
                found.set()

    threading.Thread(target=read_stderr, daemon=True).start()
    try:
        assert found.wait(300), "".join(lines[-40:])
        port = re.search(r"gRPC on 127\.0\.0\.1:(\d+)", "".join(lines)).group(1)  # type: ignore[union-attr]
        target = f"127.0.0.1:{port}"

        async def generate() -> list[int]:
            from grpc_health.v1 import health_pb2

            await wait_for_health(target, health_pb2.HealthCheckResponse.SERVING, timeout_seconds=600)
            request = pb.GenerateRequest(prompt_token_ids=tp_prompts[0], request_id="tp2-serve",
                                         sampling_params=pb.SamplingParams(max_tokens=GREEDY.max_tokens))
            async with grpc.aio.insecure_channel(target) as channel:
                responses = [r async for r in pb_grpc.GenerationStub(channel).Generate(request, timeout=300)]
            return [t for r in responses for t in r.token_ids]

        async def kill_the_engine_mid_stream(engine_pid: int) -> tuple[int, grpc.StatusCode | None]:
            from grpc_health.v1 import health_pb2

            request = pb.GenerateRequest(prompt_token_ids=tp_prompts[0], request_id="tp2-killed",
                                         sampling_params=pb.SamplingParams(max_tokens=400, ignore_eos=True))
            received, code = 0, None
            async with grpc.aio.insecure_channel(target) as channel:
                try:
                    async for response in pb_grpc.GenerationStub(channel).Generate(request, timeout=300):
                        if received == 0:
                            os.kill(engine_pid, signal.SIGKILL)
                        received += len(response.token_ids)
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
            await wait_for_health(target, health_pb2.HealthCheckResponse.NOT_SERVING, timeout_seconds=120)
            return received, code

        tokens = asyncio.run(generate())
        assert process.poll() is None, "".join(lines[-40:])
        # How the workers started: a spawned worker is a fresh exec, so its initial environment (/proc/PID/environ)
        # holds what the serving process had set by then, VLLM_WORKER_MULTIPROC_METHOD=spawn included; a forked one
        # shares the serving process's initial environment, which did not have it.
        workers = [pid for pid in _descendants(process.pid) if _cmdline(pid).startswith("VLLM::Worker")]
        worker_environments = [_environ(pid) for pid in workers]
        serve_environment = _environ(process.pid)
        engine_processes = {_parent(pid) for pid in workers}
        assert len(engine_processes) == 1, engine_processes
        engine_pid = engine_processes.pop()
        assert engine_pid != process.pid and _parent(engine_pid) == process.pid, "no engine process of its own"
        received, code = asyncio.run(kill_the_engine_mid_stream(engine_pid))
        assert code == grpc.StatusCode.UNAVAILABLE, (received, code)
        assert received < 400
        assert process.poll() is None, "the server exited with its engine: " + "".join(lines[-40:])
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
    assert tokens == tp_references[0], "serve at TP=2 diverged from ar at TP=2"
    assert len(workers) == 2, workers
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in serve_environment
    assert all(e.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn" for e in worker_environments), "a worker was forked"


def _parent(pid: int) -> int:
    from pathlib import Path

    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> str:
    from pathlib import Path

    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _environ(pid: int) -> dict[str, str]:
    from pathlib import Path

    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)


def _descendants(pid: int) -> list[int]:
    from pathlib import Path

    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        children = [child for child, parent in parents.items() if parent == current]
        found.extend(children)
        frontier.extend(children)
    return found
