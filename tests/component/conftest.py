from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from minedraft.engine.settings import DrafterSettings, EngineSettings, Mode, default_core_split

from .device_checks import on_gpu
from .patience import wait_for_drafts

MAX_MODEL_LEN = 512
# MINEDRAFT_TEST_ASYNC_PSD_STEPS=1: the shared psd engines run async PSD steps, so every psd test runs them (the
# default tests the default, synchronous steps; test_async_psd_steps_* turn them on for themselves either way).
ASYNC_PSD_STEPS = os.environ.get("MINEDRAFT_TEST_ASYNC_PSD_STEPS") == "1"
# The cores this process may use, read before any engine ran: an in-process engine binds the thread that steps it
# (the test's own) to its target cores, and leaves it so after its test (a step narrowed to [0] stays narrowed).
PROCESS_CORES = frozenset(os.sched_getaffinity(0))


@contextlib.contextmanager
def on_all_process_cores() -> Iterator[None]:
    """The calling thread on every core this process may use, then back to its binding: for an engine that sizes
    itself from the process's cores (TP ranks, a child process inheriting the binding), whatever engine test ran
    last. Put back afterwards, so the shared engines' placement (which skips re-binding a thread it believes bound)
    stays true."""
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, PROCESS_CORES)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def engine_settings(pair_dir: Path, mode: Mode, backend: str = "torch", **changes) -> EngineSettings:
    target_cores, drafter_cores = default_core_split()
    settings = EngineSettings(
        model=str(pair_dir / "target"),
        drafter=DrafterSettings(model=str(pair_dir / "draft"), cpu_cores=drafter_cores, kv_cache_gib=1,
                                deadline_seconds=10.0, backend=backend),
        mode=mode,
        num_speculative_tokens=3,
        max_num_seqs=32,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_gib=1,
        target_cpu_cores=target_cores,
        check_invariants=True,
        # Pinned on CPUs, not "auto": the tests assert token-identical greedy output, which float32 guarantees on every
        # CPU (in bf16 greedy choices depend on batch composition). "auto" resolving to float32 is tested in doctor's.
        # On GPUs the model's own 16-bit dtype, checked by agreement (device_checks).
        dtype="auto" if on_gpu() else "float32",
        async_psd_steps=ASYNC_PSD_STEPS,
    )
    return settings.with_changes(**changes) if changes else settings


@pytest.fixture(scope="session")
def ar_engine(pair_dir):
    """The target alone: the reference every speculative mode must match."""
    from minedraft.engine.core import Engine

    engine = Engine(engine_settings(pair_dir, Mode.AR))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def psd_engine(pair_dir):
    """Our engine (psd, switchable to sd and ar), with sub-batch invariants asserted on every step, waiting for its
    drafts (patience.py: timing taken out of what the tests claim about drafts)."""
    from minedraft.engine.core import Engine

    engine = Engine(engine_settings(pair_dir, Mode.PSD, max_num_speculative_tokens=4))
    assert engine.wait_for_drafter(300), "drafter did not start"
    yield wait_for_drafts(engine)
    engine.shutdown()


@pytest.fixture
def psd(psd_engine):
    """The shared engine in psd mode with a healthy drafter, restored after each test."""
    from minedraft.engine.settings import Mode

    psd_engine.set_mode(Mode.PSD, 3, 0)
    assert psd_engine.wait_for_drafter(300)
    yield wait_for_drafts(psd_engine)
    # Leave nothing in flight for the next test (bounded: a request that can never finish must fail, not hang).
    for _ in range(5000):
        if not psd_engine.has_unfinished_requests():
            break
        psd_engine.step()
    else:
        raise AssertionError("requests left by the test never finished")
    psd_engine.set_mode(Mode.PSD, 3, 0)


@pytest.fixture(scope="session")
def psd_vllm_drafter_engine(pair_dir):
    """Our engine with the draft model served by vLLM in the drafter process (the GPU-ready backend). It runs at the k
    it was built for (4): steps padded to k have the one decode shape vLLM captures full CUDA graphs for (1 + the
    engine's num_speculative_tokens query tokens per request), which an engine built for more than its k never runs."""
    from minedraft.engine.core import Engine

    engine = Engine(engine_settings(pair_dir, Mode.PSD, backend="vllm", num_speculative_tokens=4,
                                    max_num_speculative_tokens=4))
    assert engine.wait_for_drafter(300), "drafter did not start"
    yield wait_for_drafts(engine)
    engine.shutdown()


@pytest.fixture(scope="session")
def vllm_sd_engine(pair_dir):
    """vLLM's built-in draft-model speculative decoding: the anchor."""
    from minedraft.engine.core import Engine

    engine = Engine(engine_settings(pair_dir, Mode.VLLM_SD))
    yield engine
    engine.shutdown()


@pytest.fixture
async def fake_stacks():
    """Gateways routing to fake engines (see gateway_stack.py), all stopped when the test ends."""
    from .gateway_stack import FakeStacks

    stacks = FakeStacks()
    yield stacks
    await stacks.close()
