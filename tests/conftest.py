"""Shared fixtures. vLLM engines take ~40 s to start here, so engine fixtures are session-scoped and shared."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM 0.32's AOT compile cache fails to load on CPUs ("Compiling model again due to a load failure ...
# 'function' object has no attribute 'finalize_loading'"), so with it on every engine start recompiles the model.
# Without it vLLM's compile cache is reused across the suite's engines: measured on this 2-core machine, an ar
# engine's "init engine" took 19 s from the cache (load average 17) against 34 s recompiling (load average 10).
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")

from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def pair_dir() -> Path:
    from minedraft.cli import ensure_pair
    from minedraft.models.spec import default_pair_dir

    return ensure_pair(default_pair_dir())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    # The order's seed at the end too (pytest-randomly prints it in the header, which -q leaves out): a failure that
    # depends on the order is repeated with the same seed.
    seed = getattr(config.option, "randomly_seed", None)
    if config.pluginmanager.has_plugin("randomly") and isinstance(seed, int):
        terminalreporter.write_line(f"tests ran in random order: repeat it with -p randomly --randomly-seed={seed}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Runs after pytest-randomly's shuffle (its hook wraps this one). A test marked last_in_module checks what the
    # rest of its module did (test_operator_kmock's audit of the RBAC the operator used), so whatever order was
    # drawn it moves behind the last test of its own module.
    for item in [i for i in items if i.get_closest_marker("last_in_module")]:
        items.remove(item)
        same = [n for n, other in enumerate(items) if getattr(other, "module", None) is getattr(item, "module", None)]
        items.insert(same[-1] + 1 if same else len(items), item)


UNIT_DIR = Path(__file__).resolve().parent / "unit"


@pytest.fixture(autouse=True)
def _cpu_kind_readers_are_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`make test-other-cpu` reruns only the unit tests marked cpu_kind, as if on the other kind of x86 CPU. A unit
    test that reads the CPU kind from this process's environment (placement.detect_device: MINEDRAFT_CPU_FAST_BF16 or
    /proc/cpuinfo) without the marker would be left out of that rerun, so it fails here instead. (A child process
    reading it is not seen: none of the unit tests starts one that does, see the Makefile.)"""
    if request.node.get_closest_marker("cpu_kind") or UNIT_DIR not in Path(str(request.path)).parents:
        yield
        return
    from minedraft.engine import placement

    real = placement._cpu_has_fast_bf16
    reads: list[bool] = []

    def reading(environ: Mapping[str, str]) -> bool:
        reads.append(environ is os.environ)
        return real(environ)

    monkeypatch.setattr(placement, "_cpu_has_fast_bf16", reading)
    yield
    assert not any(reads), (f"{request.node.nodeid} reads the CPU kind (placement.detect_device): mark it "
                            "@pytest.mark.cpu_kind so that `make test-other-cpu` reruns it as if on the other kind")


@pytest.fixture(autouse=True)
def _unit_tests_compute_on_one_torch_thread(request: pytest.FixtureRequest) -> Iterator[None]:
    """A unit test's tensors are small: with torch's default thread per core, their time went to OpenMP's hand-offs
    between threads, the more so with other processes on the cores (the suite's engines, a shared runner). Measured
    under load ~8 on 2 cores: the keyed-sampling, top-k and torch-drafter unit files took 74 s on the default threads,
    36 s on one. Restored afterwards: the engine tests in the same session set their own. torch._C's setter, as
    placement.ComputePlacement uses it: vLLM's CPU worker turns torch.set_num_threads into a no-op in this process."""
    torch = sys.modules.get("torch")  # imported while collecting the unit tests that use it; never imported here
    if torch is None or UNIT_DIR not in Path(str(request.path)).parents:
        yield
        return
    threads = torch.get_num_threads()
    torch._C.set_num_threads(1)
    try:
        yield
    finally:
        torch._C.set_num_threads(threads)
