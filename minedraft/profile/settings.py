"""How measurements are timed: a plain dataclass, importable without torch (the CLI parses with it where torch
is not installed)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TimingSettings:
    repeats: int = 3  # medians over this many timed blocks
    replays: int = 10  # calls per timed block (graph replays; on the eager path, calls)
    warmup: int = 2  # calls before capture / before timing
    # Eager timing: at least this long a block (more calls per block than `replays` when calls are short), so that
    # on a shared CPU a block averages over the scheduler's time slices instead of landing in or out of one.
    min_block_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("repeats", "replays", "warmup"):
            if getattr(self, name) < (0 if name == "warmup" else 1):
                raise ValueError(f"{name}: must be at least {0 if name == 'warmup' else 1}, "
                                 f"got {getattr(self, name)}")
