"""A drafter's start-up is judged by its progress (protocol.StartupStage), not by the time since its spawn: a start
that keeps reaching stages (imports, a download growing, weights, compiling) is never killed, one that stops is."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from types import SimpleNamespace

from minedraft.engine.drafter import client as client_module
from minedraft.engine.drafter import process, protocol
from minedraft.engine.drafter.client import DrafterClient, DrafterState

# A stand-in drafter process: connects to the client's socket and reports one start-up stage for each line the test
# writes to its stdin (the line is the stage's `seconds`), then stays silent (alive, no Ready) until its stdin closes.
_FAKE_DRAFTER = """
import os, sys, zmq
from minedraft.engine.drafter import protocol
socket = zmq.Context().socket(zmq.PAIR)
socket.connect(sys.argv[1])
for line in sys.stdin:
    socket.send(protocol.encode(protocol.StartupStage(os.getpid(), "downloading", float(line), line.strip())))
"""


def _fake_popen(real_popen, spawned: list[subprocess.Popen[bytes]]):
    def popen(argv, **kwargs):
        assert argv[1:3] == ["-m", "minedraft.engine.drafter.process"]
        child = real_popen([argv[0], "-c", _FAKE_DRAFTER, *argv[3:]], stdin=subprocess.PIPE, **kwargs)
        spawned.append(child)
        return child
    return popen


class _Clock:
    """The client's time.monotonic, moved by the test: how long a start-up went without progress is then exact,
    whatever the machine's load (the real one made this test depend on how fast the stand-in started)."""

    def __init__(self) -> None:
        self.now_seconds = 1000.0

    def monotonic(self) -> float:
        return self.now_seconds


def _stage_arrives(client: DrafterClient, child: subprocess.Popen[bytes], caplog, seconds: float) -> None:
    """Has the stand-in send one stage and waits (real time, no deadline on the client's clock) until the client
    took it in."""
    before = sum("start-up: downloading" in r.getMessage() for r in caplog.records)
    assert child.stdin is not None
    child.stdin.write(f"{seconds}\n".encode())
    child.stdin.flush()
    give_up_at = time.monotonic() + 120.0  # a safety net against hanging, not a measured bound
    while sum("start-up: downloading" in r.getMessage() for r in caplog.records) == before:
        client.receive(timeout_seconds=0.05)
        assert child.poll() is None, "the stand-in drafter died"
        assert time.monotonic() < give_up_at, "the client never took in the stand-in's stage"


def test_a_start_that_keeps_progressing_outlives_the_timeout_and_a_stalled_one_does_not(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=client_module.log.name)
    clock = _Clock()
    monkeypatch.setattr(client_module, "time", SimpleNamespace(monotonic=clock.monotonic, sleep=time.sleep))
    spawned: list[subprocess.Popen[bytes]] = []
    monkeypatch.setattr(client_module.subprocess, "Popen", _fake_popen(subprocess.Popen, spawned))
    client = DrafterClient({}, restart=False, startup_timeout_seconds=1.5)
    client.start()
    try:
        (child,) = spawned
        # 8 s of start-up, over five times the timeout, with a stage every second: still starting.
        for second in range(1, 9):
            clock.now_seconds += 1.0
            assert not client.check_alive() and client.state is DrafterState.STARTING, client.last_error
            _stage_arrives(client, child, caplog, second)
        assert client.startup_stage == "downloading"
        # Progress resets the clock: 1.4 s after the last stage is still within the timeout...
        clock.now_seconds += 1.4
        client.check_alive()
        assert client.state is DrafterState.STARTING, client.last_error
        # ...and silence past it is a stall, although the process is alive.
        clock.now_seconds += 0.2
        client.check_alive()
        assert client.state is DrafterState.DOWN and child.poll() is None
        assert "stalled" in (client.last_error or "") and "'downloading'" in (client.last_error or "")
    finally:
        for child in spawned:
            if child.stdin is not None:
                child.stdin.close()  # the stand-in exits: shutdown need not wait for it
        client.shutdown()


def test_stages_from_vllms_log_lines_and_the_process_itself_are_sent_once_each():
    sent: list[protocol.StartupStage] = []
    with process.StartupReporter(sent.append, time.perf_counter(), watch_downloads=False) as startup:
        startup.stage("imported")
        vllm_log = logging.getLogger("vllm.v1.worker.gpu_model_runner")
        vllm_log.setLevel(logging.INFO)
        vllm_log.info("Model loading took %s GiB memory and %.6f seconds", 3.2, 41.0)
        vllm_log.info("Graph capturing finished in %.0f secs, took %.2f GiB", 12, 0.4)
        logging.getLogger("vllm.v1.engine.core").info("init engine (profile, create kv cache, warmup model) took 9 s")
        startup.stage("compiled")
    assert [m.stage for m in sent] == ["imported", "weights", "compiled"]
    assert all(isinstance(m, protocol.StartupStage) and m.seconds >= 0 for m in sent)
    assert not any(isinstance(h, process.StartupReporter) for h in logging.getLogger("vllm").handlers)


def test_a_growing_download_is_reported_as_progress(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(process, "DOWNLOAD_POLL_SECONDS", 0.1)
    sent: list[protocol.StartupStage] = []
    with process.StartupReporter(sent.append, time.perf_counter(), watch_downloads=True):
        blob = tmp_path / "models--x" / "blobs" / "a.incomplete"
        blob.parent.mkdir(parents=True)
        for _ in range(3):
            with blob.open("ab") as f:
                f.write(b"\0" * 1000)
            time.sleep(0.3)
    downloads = [m for m in sent if m.stage == "downloading"]
    assert len(downloads) >= 2 and "bytes" in downloads[0].detail


def test_startup_stages_travel_on_the_wire():
    message = protocol.StartupStage(7, "weights", 12.5, "")
    assert protocol.decode_from_drafter(protocol.encode(message)) == message
    assert sys.modules["minedraft.engine.drafter.protocol"].STARTUP_STAGES[0] == "imported"
