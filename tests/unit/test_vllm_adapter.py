"""The vLLM adapter package: the version check, and the class paths vLLM imports by name."""

from __future__ import annotations

import importlib

import pytest

from minedraft.engine import vllm_adapter
from minedraft.engine.vllm_adapter import (
    EXPECTED_VLLM_VERSION,
    VllmVersionError,
    check_vllm_version,
    release_of,
    version_problem,
)


def test_release_parsing_accepts_build_tags_and_refuses_pre_releases():
    assert release_of("0.32.0") == (0, 32, 0)
    assert release_of("0.32.0+cpu") == release_of("0.32.0+cu128") == (0, 32, 0)
    assert release_of("0.32.0rc1") is None and release_of("0.32.1.dev3+g1234") is None
    assert release_of("dev") is None


@pytest.mark.parametrize("found", ["0.32.0", "0.32.0+cpu", "0.32.0+cu128"])
def test_the_pinned_release_passes(found):
    assert version_problem(found, "0.32.0") is None


@pytest.mark.parametrize("found", ["0.34.0", "0.31.2", "0.32.1", "0.32.0rc1", "dev"])
def test_any_other_vllm_is_refused_naming_both_versions(found):
    problem = version_problem(found, "0.32.0")
    assert problem is not None
    assert f"vLLM {found} is installed" in problem and "vLLM 0.32.0 exactly" in problem
    assert "docs/vllm-upgrade.md" in problem


def test_the_check_raises_at_start_unless_explicitly_allowed(monkeypatch):
    monkeypatch.setattr(vllm_adapter, "installed_vllm_version", lambda: "0.34.0")
    monkeypatch.delenv(vllm_adapter.ALLOW_OTHER_VLLM_ENV, raising=False)
    with pytest.raises(VllmVersionError, match=r"vLLM 0\.34\.0 is installed"):
        check_vllm_version()
    monkeypatch.setenv(vllm_adapter.ALLOW_OTHER_VLLM_ENV, "1")
    assert check_vllm_version() == "0.34.0"


def test_the_installed_vllm_is_the_pinned_one():
    assert check_vllm_version().startswith(EXPECTED_VLLM_VERSION)


@pytest.mark.parametrize("path", [vllm_adapter.SCHEDULER_CLASS, vllm_adapter.PROPOSER_CLASS,
                                  vllm_adapter.WORKER_EXTENSION_CLASS])
def test_every_class_path_vllm_imports_by_name_resolves(path):
    module, _, name = path.rpartition(".")
    assert module.startswith("minedraft.engine.vllm_adapter.")
    assert isinstance(getattr(importlib.import_module(module), name), type)


def test_the_engine_hands_vllm_the_adapters_class_paths():
    from minedraft.engine.core import engine_args
    from minedraft.engine.settings import DrafterSettings, EngineSettings, Mode

    args = engine_args(EngineSettings(model="/m/t", drafter=DrafterSettings(model="/m/d"), mode=Mode.PSD))
    assert args.scheduler_cls == vllm_adapter.SCHEDULER_CLASS
    assert args.speculative_config["model"] == vllm_adapter.PROPOSER_CLASS
    assert args.worker_extension_cls == vllm_adapter.WORKER_EXTENSION_CLASS
