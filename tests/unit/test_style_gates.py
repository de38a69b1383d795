"""Style gates: ruff, mypy and the layer contracts (import-linter) of docs/architecture.md (Layers)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    exe = BIN / tool
    if not exe.exists():
        found = shutil.which(tool)
        if found is None:
            pytest.fail(f"{tool} is not installed: the test extra provides it")
        exe = Path(found)
    return subprocess.run([str(exe), *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff():
    result = run("ruff", "check", "minedraft", "tests")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy():
    result = run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_layers():
    result = run("lint-imports")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" not in result.stdout.lower() or "0 broken" in result.stdout.lower()
