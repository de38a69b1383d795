"""Timeouts enforced from outside the measuring process: a worker runs in a child process (its own session), every
measurement has its own deadline, and a child that misses one is killed with its whole process group.

A hung CUDA call cannot be interrupted from inside the process that made it (the thread is blocked in the driver,
and Python signal handlers only run between bytecodes), so the only reliable timeout is a kill from outside.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChildOutcome:
    """What one child process did before it finished or was killed."""

    ready: dict[str, Any] | None = None  # the ready event (device description, ...); None: setup never finished
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    # The measurement the child was in when it failed (timed out, or exited without a result); None when every
    # measurement handed to it ended, or when it failed before the first one started.
    failed_id: int | None = None
    # "timeout" (a deadline passed: killed), "exit" (died on its own, code in exit_code), "" (finished normally).
    failure: str = ""
    during: str = ""  # "setup" | "measurement" | "budget": which deadline passed
    exit_code: int | None = None
    stdout_noise: list[str] = field(default_factory=list)  # lines that were not events (kept for the error message)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):  # the child leads its own session: this reaches only its group
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_child(argv: list[str], job: dict[str, Any], setup_timeout_s: float, measurement_timeout_s: float,
              deadline: float | None = None, on_event: Callable[[dict[str, Any]], None] | None = None,
              env: dict[str, str] | None = None) -> ChildOutcome:
    """Start `argv`, write `job` as JSON to its stdin, follow its events on stdout (see minedraft.profile.worker).
    Until it is ready it has `setup_timeout_s`; after that, each event must follow the previous one within
    `measurement_timeout_s`. `deadline` (time.monotonic()) is the whole run's budget. The child's stderr is ours."""
    outcome = ChildOutcome()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(json.dumps(job).encode())
        proc.stdin.close()
    except BrokenPipeError:  # it died at once; its exit code tells below
        pass
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    buffer = b""
    current: int | None = None
    last_event = time.monotonic()
    try:
        while True:
            own_deadline = last_event + (measurement_timeout_s if outcome.ready is not None else setup_timeout_s)
            until = own_deadline if deadline is None else min(own_deadline, deadline)
            wait_s = until - time.monotonic()
            if wait_s <= 0 or not selector.select(timeout=wait_s):
                if time.monotonic() < until:
                    continue
                outcome.failure = "timeout"
                outcome.during = ("budget" if deadline is not None and deadline <= own_deadline
                                  else "measurement" if outcome.ready is not None else "setup")
                outcome.failed_id = current
                _kill_group(proc)
                break
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:  # the child closed stdout: it exited (or is about to)
                outcome.exit_code = proc.wait()
                if current is not None or outcome.exit_code != 0 or outcome.ready is None:
                    outcome.failure, outcome.failed_id = "exit", current
                    outcome.during = "measurement" if outcome.ready is not None else "setup"
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for raw in lines:
                try:
                    event = json.loads(raw)
                except json.JSONDecodeError:
                    outcome.stdout_noise.append(raw.decode(errors="replace"))
                    continue
                if not isinstance(event, dict) or "event" not in event:
                    outcome.stdout_noise.append(raw.decode(errors="replace"))
                    continue
                last_event = time.monotonic()
                kind = event["event"]
                if kind == "ready":
                    outcome.ready = event
                elif kind == "start":
                    current = int(event["id"])
                elif kind == "result":
                    outcome.results[int(event["id"])] = event
                    current = None
                elif kind == "error":
                    outcome.errors[int(event["id"])] = str(event.get("message", ""))
                    current = None
                if on_event is not None:
                    on_event(event)
    finally:
        selector.close()
        if proc.poll() is None:
            _kill_group(proc)
        proc.stdout.close()
    return outcome
