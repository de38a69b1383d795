"""The verifier's side of the drafter: start, talk to, watch and restart the drafter process."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import zmq

from minedraft.engine.drafter import protocol

log = logging.getLogger(__name__)


# A Unix socket path must fit sockaddr_un.sun_path (108 bytes with its NUL); the socket file is "drafter-N.sock".
_MAX_SOCKET_DIR_CHARS = 80


def _socket_dir() -> Path:
    """A private folder for the drafter's socket: under TMPDIR unless that path is too long for a Unix socket (a
    deep TMPDIR, as pods and test runners set), then under /tmp."""
    path = Path(tempfile.mkdtemp(prefix="minedraft-drafter-"))
    if len(str(path)) <= _MAX_SOCKET_DIR_CHARS:
        return path
    path.rmdir()
    return Path(tempfile.mkdtemp(prefix="minedraft-drafter-", dir="/tmp"))


class DrafterState(StrEnum):
    STARTING = "starting"
    UP = "up"
    DOWN = "down"


@dataclass
class JobTicket:
    job_id: int
    request_ids: frozenset[str]
    sent_at: float


class JobMessages:
    """The job side of a drafter client, over its `_send`: one definition for the local drafter process and the
    shared service's session (remote.py). Messages go out only while the drafter is up and connected."""

    state: DrafterState
    _socket: zmq.Socket | None
    _next_job_id: int

    def _send(self, message: Any) -> bool:
        raise NotImplementedError

    def _can_send(self) -> bool:
        return self.state is DrafterState.UP and self._socket is not None

    def submit(self, items: list[protocol.DraftItem], want_logprobs: bool, top_f: int = 0) -> JobTicket | None:
        if not self._can_send() or not items:
            return None
        job_id = self._next_job_id
        self._next_job_id += 1
        if not self._send(protocol.DraftJob(job_id, items, want_logprobs, top_f)):
            return None
        return JobTicket(job_id, frozenset(i.request_id for i in items), time.monotonic())

    def cancel(self, request_ids: list[str]) -> None:
        """These requests are gone: the drafter drops their work and forgets their tokens and KV."""
        if self._can_send() and request_ids:
            self._send(protocol.CancelRequests(request_ids))

    def cancel_jobs(self, job_ids: list[int]) -> None:
        """Drafts of these jobs are no longer wanted; the drafter keeps their requests' tokens and KV."""
        if self._can_send() and job_ids:
            self._send(protocol.CancelJobs(job_ids))


class DrafterClient(JobMessages):
    """Owns one drafter process and a ZMQ PAIR socket to it; single-threaded (the scheduler's thread)."""

    def __init__(self, process_settings: dict[str, object], restart: bool = True,
                 startup_timeout_seconds: float = 300.0) -> None:
        self._process_settings = process_settings
        self._restart = restart
        self._startup_timeout_seconds = startup_timeout_seconds
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._tmpdir = _socket_dir()
        self._next_job_id = 1
        self._started_at = 0.0
        # A start-up is judged by its progress: the time since its last stage (protocol.StartupStage) or the spawn,
        # not since the spawn (a drafter downloading 3.4 GB or capturing CUDA graphs is slow, not hung).
        self._startup_progress_at = 0.0
        self.startup_stage = ""
        self.state = DrafterState.DOWN
        self.num_restarts = 0
        self.num_starts = 0
        self.startup_seconds: float | None = None
        # The longest context the running drafter holds (from its Ready; 0: no limit known).
        self.max_context_tokens = 0
        self.last_error: str | None = None
        # Restarts back off exponentially while the drafter keeps dying or failing, so a drafter that cannot start,
        # or starts and then fails every job (a sticky device error), does not take the target's CPU with a start-up
        # every step. Only a drafted reply ends the run: coming up (Ready) is not enough.
        self._consecutive_failures = 0
        self._next_start_at = 0.0

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the process without waiting for it: the engine serves without drafts until it is ready."""
        self._close_socket()
        address = f"ipc://{self._tmpdir}/drafter-{self.num_starts}.sock"
        socket = self._context.socket(zmq.PAIR)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(address)
        self._socket = socket
        env = dict(os.environ)
        env.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "minedraft.engine.drafter.process", address,
             json.dumps(self._process_settings)],
            env=env,
            stdout=sys.stderr.fileno() if hasattr(sys.stderr, "fileno") else None,
            start_new_session=True,
        )
        self.num_starts += 1
        self._started_at = time.monotonic()
        self._startup_progress_at = self._started_at
        self.startup_stage = "spawned"
        self.state = DrafterState.STARTING
        log.info("drafter process %d starting", self._process.pid)

    def wait_ready(self, timeout_seconds: float) -> bool:
        """Wait until the drafter is up, (re)starting it when allowed; for start-up and idle moments only."""
        deadline = time.monotonic() + timeout_seconds
        while self.state is not DrafterState.UP and time.monotonic() < deadline:
            if not self.check_alive() and self._process is None and not self._restart:
                break
            for message in self.receive(timeout_seconds=0.2):
                # A reply before Ready cannot happen: nothing was sent to this process yet.
                log.debug("unexpected drafter message while starting: %r", message)
            if self._socket is None:
                time.sleep(0.2)
        return self.state is DrafterState.UP

    def kill(self, wait: bool = True) -> None:
        """Stop the process at once (used for restarts and in fault tests). Without `wait` the exit is reaped later
        by check_alive: a hung drafter is killed from the engine's step thread, and a large process's exit (its
        memory torn down) took tenths of a second there, a gap in every stream."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            if wait:
                self._process.wait(timeout=30)

    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def shutdown(self) -> None:
        if self._socket is not None and self._process is not None and self._process.poll() is None:
            try:
                self._socket.send(protocol.encode(protocol.Shutdown()), zmq.NOBLOCK)
                self._process.wait(timeout=10)
            except (zmq.ZMQError, subprocess.TimeoutExpired):
                pass
        self.kill()
        self._close_socket()
        self.state = DrafterState.DOWN
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _close_socket(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    # -- health ------------------------------------------------------------------------------------------------

    def check_alive(self) -> bool:
        """Notice a dead or never-ready drafter; restart it if allowed (with backoff). Returns whether it is up."""
        if self._process is None:
            if self._restart and time.monotonic() >= self._next_start_at:
                self.num_restarts += 1
                self.start()
            return False
        dead = self._process.poll() is not None
        slow_start = (
            self.state is DrafterState.STARTING
            and time.monotonic() - self._startup_progress_at > self._startup_timeout_seconds
        )
        if dead or slow_start:
            if self.state is not DrafterState.DOWN or slow_start:
                code = None if self._process is None else self._process.poll()
                self.last_error = (f"drafter process exited with code {code}" if dead else
                                   f"drafter start-up stalled: no progress for {self._startup_timeout_seconds:.0f}s "
                                   f"after stage {self.startup_stage!r}")
                log.error("%s; serving without drafts", self.last_error)
                self.state = DrafterState.DOWN
            if self._restart:
                self.kill()
                self._close_socket()
                self._consecutive_failures += 1
                self._next_start_at = time.monotonic() + min(60.0, 2.0 ** (self._consecutive_failures - 1))
                self._process = None
        if self._process is None and self._restart and time.monotonic() >= self._next_start_at:
            self.num_restarts += 1
            self.start()
        return self.state is DrafterState.UP

    def mark_hung(self, reason: str) -> None:
        self.last_error = reason
        log.error("drafter hung (%s); restarting", reason)
        self.kill(wait=False)
        self.state = DrafterState.DOWN
        self.check_alive()

    # -- messages ----------------------------------------------------------------------------------------------

    def _send(self, message: protocol.ToDrafter) -> bool:
        """Never block the engine on the drafter: a peer that cannot take a message is treated as down."""
        assert self._socket is not None
        try:
            self._socket.send(protocol.encode(message), zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.last_error = "drafter not accepting messages"
            log.error("%s; treating it as down", self.last_error)
            self.kill()
            self.state = DrafterState.DOWN
            self.check_alive()
            return False

    def receive(self, timeout_seconds: float) -> list[protocol.FromDrafter]:
        """Messages available within the timeout (all that are queued, at least one if any arrives)."""
        if self._socket is None:
            return []
        messages: list[protocol.FromDrafter] = []
        timeout_ms = max(0, int(timeout_seconds * 1000))
        while self._socket.poll(timeout_ms if not messages else 0):
            message = protocol.decode_from_drafter(self._socket.recv())
            if isinstance(message, protocol.Ready):
                self.state = DrafterState.UP
                self.startup_seconds = message.startup_seconds
                self.max_context_tokens = message.max_context_tokens
                log.info("drafter %d up after %.1fs", message.pid, message.startup_seconds)
                continue
            if isinstance(message, protocol.StartupStage):
                self._startup_progress_at = time.monotonic()
                self.startup_stage = message.stage
                log.info("drafter %d start-up: %s after %.1fs %s", message.pid, message.stage, message.seconds,
                         message.detail)
                continue
            if isinstance(message, protocol.DraftReply):
                self._consecutive_failures = 0
            messages.append(message)
        return messages
