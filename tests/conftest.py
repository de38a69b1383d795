"""Shared fixtures. vLLM engines take ~40 s to start here, so engine fixtures are session-scoped and shared."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM 0.32's AOT compile cache fails to load on CPUs ("Compiling model again due to a load failure ...
# 'function' object has no attribute 'finalize_loading'"), so with it on every engine start recompiles the model.
# Without it vLLM's compile cache is reused across the suite's engines: measured on this 2-core machine, an ar
# engine's "init engine" took 19 s from the cache (load average 17) against 34 s recompiling (load average 10).
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")

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
