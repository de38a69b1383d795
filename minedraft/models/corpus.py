"""The training corpus every machine has: the Python standard library's own source files."""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CorpusSplit:
    train_files: list[Path]
    heldout_files: list[Path]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stable_bucket(relative_path: str, modulus: int) -> int:
    # hash() is salted per process; a digest keeps the split identical on every machine and run.
    return int.from_bytes(hashlib.sha256(relative_path.encode()).digest()[:4], "big") % modulus


def split_stdlib(heldout_modulus: int, root: Path | None = None) -> CorpusSplit:
    root = root or stdlib_root()
    files = sorted(
        path
        for path in root.rglob("*.py")
        if "site-packages" not in path.parts and "test" not in path.parts and "tests" not in path.parts
    )
    train: list[Path] = []
    heldout: list[Path] = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        (heldout if _stable_bucket(rel, heldout_modulus) == 0 else train).append(path)
    return CorpusSplit(train_files=train, heldout_files=heldout)


def read_texts(paths: list[Path], max_bytes_per_file: int = 200_000) -> list[str]:
    texts = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            texts.append(text[:max_bytes_per_file])
    return texts
