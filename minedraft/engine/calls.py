"""Engine calls the servers and benchmarks make between steps (`call(fn)`): module-level functions, so that they
pickle across to an engine process (with functools.partial for arguments); each returns plain, picklable data."""

from __future__ import annotations

from typing import Any

from minedraft.engine.control.auto import Decision
from minedraft.engine.control.stats import EngineTotals, StepRecord
from minedraft.engine.settings import Mode


def noop(engine: Any) -> None:
    """Nothing: answers once the loop gets to it (the server's "engine loop answers" readiness check)."""


def load(engine: Any) -> tuple[int, int]:
    """(running, waiting) requests."""
    running, waiting = engine.load()
    return int(running), int(waiting)


def step_records(engine: Any, since_step: int = -1) -> list[StepRecord]:
    return list(engine.step_records(since_step))


def totals(engine: Any) -> EngineTotals:
    return engine.totals()  # type: ignore[no-any-return]


def auto_decisions(engine: Any) -> list[Decision]:
    return list(engine.auto_decisions())


def switchable(engine: Any) -> bool:
    """Whether the engine can switch modes (it runs our scheduler)."""
    return engine.psd_scheduler is not None


def set_mode(engine: Any, mode: Mode, k: int | None = None) -> None:
    engine.set_mode(mode, k)


def set_async_psd_steps(engine: Any, enabled: bool) -> None:
    engine.set_async_psd_steps(enabled)
