"""Shared fixtures. vLLM engines take ~40 s to start here, so engine fixtures are session-scoped and shared."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def pair_dir() -> Path:
    from minedraft.cli import ensure_pair
    from minedraft.models.spec import default_pair_dir

    return ensure_pair(default_pair_dir())
