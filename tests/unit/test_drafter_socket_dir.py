"""The drafter's Unix socket must fit sockaddr_un even when TMPDIR is deep (pods and pytest set long ones)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from minedraft.engine.drafter import client as drafter_client


def test_a_deep_tmpdir_falls_back_to_a_short_socket_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    folder = drafter_client._socket_dir()
    try:
        assert len(str(folder / "drafter-0.sock")) < 108
        assert folder.is_dir() and not any(deep.iterdir())  # nothing left behind in the deep folder
    finally:
        folder.rmdir()


def test_a_short_tmpdir_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    short = Path(tempfile.mkdtemp(prefix="md-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(short))
    folder = drafter_client._socket_dir()
    try:
        assert folder.parent == short
    finally:
        folder.rmdir()
        short.rmdir()
