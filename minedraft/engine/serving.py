"""What the servers hold: an engine front end, in this process (AsyncEngine) or over its own (EngineProcess)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, TypeVar

from minedraft.engine.requests import OutputDelta, SamplingSettings
from minedraft.engine.settings import EngineSettings

T = TypeVar("T")


class ServingEngine(Protocol):
    """AsyncEngine's public interface. `call(fn)` runs fn(engine) between steps wherever the engine runs: fn must be
    a module-level function (or a functools.partial of one) with a picklable result, so that it can cross to an
    engine process. Everything else the servers need is an attribute here, never read off the engine itself."""

    in_process: bool
    settings: EngineSettings

    @property
    def tokenizer(self) -> Any: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def startup_seconds(self) -> float: ...

    def generate(self, prompt: str | list[int], sampling: SamplingSettings,
                 request_id: str | None = None) -> AsyncIterator[OutputDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    async def call(self, fn: Callable[[Any], T]) -> T: ...

    @property
    def num_in_flight(self) -> int: ...

    @property
    def dead_error(self) -> BaseException | None: ...

    async def shutdown(self, shutdown_engine: bool = True) -> None: ...
