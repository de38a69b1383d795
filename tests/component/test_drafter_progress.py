"""Slow is not hung: a real drafter process whose every step is slow finishes its jobs without being restarted,
while a stopped one (SIGSTOP: alive, silent) is restarted. The real client, link and torch drafter process; the
slowness comes from the drafter's test-only per-step sleep (MINEDRAFT_TEST_DRAFTER_STEP_SLEEP_SECONDS)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from minedraft.engine.drafter import protocol
from minedraft.engine.drafter.client import DrafterClient, DrafterState
from minedraft.engine.drafter.link import DrafterLink
from minedraft.engine.drafter.process import STEP_SLEEP_ENV
from minedraft.engine.psd.events import DrafterRestarted, DraftsArrived
from minedraft.engine.settings import default_core_split

HANG_SECONDS = 1.5
STEP_SLEEP_SECONDS = 0.4


@pytest.fixture
def slow_drafter(pair_dir, monkeypatch):
    monkeypatch.setenv(STEP_SLEEP_ENV, str(STEP_SLEEP_SECONDS))  # read by the drafter process at its start
    client = DrafterClient({"model": str(pair_dir / "draft"), "backend": "torch", "max_model_len": 512,
                            "max_num_seqs": 4, "cpu_cores": list(default_core_split()[1]), "dtype": "float32"})
    client.start()
    try:
        assert client.wait_ready(120), client.last_error
        yield client
    finally:
        client.shutdown()


def test_a_slow_drafter_finishes_its_jobs_unrestarted_and_a_stopped_one_is_restarted(slow_drafter):
    client = slow_drafter
    link = DrafterLink(client, hang_seconds=HANG_SECONDS, max_failed_jobs=3)
    replies: list[DraftsArrived] = []

    def handle(events):
        replies.extend(event for event in events if isinstance(event, DraftsArrived))

    # 12 drafted tokens: a catch-up and 11 decode steps at 0.4 s each, about 5 s, three times the hang threshold.
    context = list(range(10, 60))
    assert link.send(0, [protocol.DraftItem("slow", context, 12)], want_logprobs=False)
    started = time.monotonic()
    while 0 in link.jobs and time.monotonic() - started < 120:
        handle(link.wait_for(0, 0.5).events)
    assert replies and replies[0].drafts[0][1].context_num_tokens == len(context)
    assert len(replies[0].drafts[0][1].token_ids) == 12
    assert replies[0].draft_seconds > 2 * HANG_SECONDS, "the job was not slower than the hang threshold"
    assert link.num_hangs == 0 and client.num_starts == 1, "a slow but working drafter was restarted"
    assert link.num_progress_reports >= 2

    # Stopped: alive but making no progress. Only the silence can tell, and it is restarted.
    pid = client.pid()
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    # The hang is handled on the engine's step thread: it kills the process and must not wait there for the exit.
    stopped = client._process
    assert stopped is not None
    waited_on_step_thread: list[float] = []
    real_wait = stopped.wait

    def recording_wait(timeout=None):
        waited_on_step_thread.append(timeout)
        return real_wait(timeout)

    stopped.wait = recording_wait
    try:
        assert link.send(0, [protocol.DraftItem("slow", [7], 12, len(context))], want_logprobs=False)
        started = time.monotonic()
        while link.num_hangs == 0 and time.monotonic() - started < 60:
            handle(link.wait_for(0, 0.5).events)
    finally:
        with contextlib.suppress(ProcessLookupError):  # (the restart killed it already)
            os.kill(pid, signal.SIGCONT)
    assert link.num_hangs == 1 and not link.jobs
    assert waited_on_step_thread == [], "the step thread waited for the hung drafter's exit"
    assert stopped.poll() is not None or real_wait(30) is not None  # killed all the same, reaped later
    # The replacement starts after the client's restart back-off, in the background; the link notices it once.
    assert client.wait_ready(120) and client.state is DrafterState.UP
    assert client.num_starts == 2 and DrafterRestarted() in link.take_events() and link.take_events() == []
