"""The one step loop behind both engine front ends (engine/loop.py), over a fake engine."""

from __future__ import annotations

import queue
from typing import Any

from minedraft.engine.loop import run_steps


class FakeEngine:
    def __init__(self) -> None:
        self.pending = 0
        self.log: list[str] = []

    def has_unfinished_requests(self) -> bool:
        return self.pending > 0

    def step(self) -> list[Any]:
        self.log.append("step")
        self.pending -= 1
        return [f"delta{self.pending}"]


def test_every_queued_command_runs_before_the_next_step_and_each_step_is_published() -> None:
    engine = FakeEngine()
    commands: queue.SimpleQueue[str] = queue.SimpleQueue()
    published: list[list[Any]] = []

    def handle(command: str) -> bool:
        engine.log.append(command)
        if command == "add":
            engine.pending += 2
        elif command == "stop":
            return False
        if command == "add" and engine.log.count("add") == 1:
            commands.put("abort")  # queued while the first command runs: drained in the same turn
        return True

    def publish(deltas: list[Any]) -> None:
        published.append(deltas)
        if len(published) == 2:
            commands.put("stop")

    commands.put("add")
    run_steps(engine, commands, handle, publish)
    assert engine.log == ["add", "abort", "step", "step", "stop"]
    assert published == [["delta1"], ["delta0"]]


def test_an_idle_loop_waits_for_commands_and_stops_when_told() -> None:
    engine = FakeEngine()
    commands: queue.SimpleQueue[str] = queue.SimpleQueue()
    turns: list[int] = []

    def stopping() -> bool:
        turns.append(1)
        return len(turns) > 3

    run_steps(engine, commands, lambda command: True, lambda deltas: None, idle_wait_seconds=0.001,
              stopping=stopping)
    assert engine.log == [] and len(turns) == 4  # three idle waits, nothing stepped
