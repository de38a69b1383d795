"""The engine's one step loop, behind both front ends: drain the queued commands, step, publish the step's deltas.

`AsyncEngine` (async_engine.py) runs it on a thread of the serving process; the engine process (engine_process.py)
runs it in a process of its own, over a pipe. Each front end supplies only what differs: how a command is handled,
where a step's deltas go, and how long an idle loop blocks for the next command.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

Command = TypeVar("Command")


class Steppable(Protocol):
    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[Any]: ...


def run_steps(engine: Steppable, commands: queue.SimpleQueue[Command] | queue.Queue[Command],
              handle: Callable[[Command], bool], publish: Callable[[list[Any]], None],
              idle_wait_seconds: float | None = None, stopping: Callable[[], bool] = lambda: False) -> None:
    """Until `handle` returns False for a command (stop) or `stopping()` holds: every queued command, then one step,
    then `publish` with its deltas (every turn, an empty list when nothing stepped: a front end may have gathered
    output of its own while handling commands). Idle (no unfinished request), the loop blocks for the next command,
    at most `idle_wait_seconds` (None: until one comes); busy, it never waits for one."""
    while not stopping():
        busy = engine.has_unfinished_requests()
        command: Command | None
        try:
            command = commands.get(block=not busy, timeout=None if busy else idle_wait_seconds)
        except queue.Empty:
            command = None
            if not busy:
                continue
        while command is not None:
            if not handle(command):
                return
            try:
                command = commands.get_nowait()
            except queue.Empty:
                command = None
        if stopping():
            return
        publish(engine.step() if engine.has_unfinished_requests() else [])
