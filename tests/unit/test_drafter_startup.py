"""A drafter's start-up is judged by its progress (protocol.StartupStage), not by the time since its spawn: a start
that keeps reaching stages (imports, a download growing, weights, compiling) is never killed, one that stops is."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

from minedraft.engine.drafter import client as client_module
from minedraft.engine.drafter import process, protocol
from minedraft.engine.drafter.client import DrafterClient, DrafterState

# A stand-in drafter process: connects to the client's socket and reports a start-up stage every `every` seconds,
# `count` times, then goes silent (alive, no Ready).
_FAKE_DRAFTER = """
import json, os, sys, time, zmq
from minedraft.engine.drafter import protocol
address, settings = sys.argv[1], json.loads(sys.argv[2])
socket = zmq.Context().socket(zmq.PAIR)
socket.connect(address)
for i in range(settings["count"]):
    time.sleep(settings["every"])
    socket.send(protocol.encode(protocol.StartupStage(os.getpid(), "downloading", i * settings["every"], str(i))))
time.sleep(60)
"""


def _fake_popen(real_popen):
    def popen(argv, **kwargs):
        assert argv[1:3] == ["-m", "minedraft.engine.drafter.process"]
        return real_popen([argv[0], "-c", _FAKE_DRAFTER, *argv[3:]], **kwargs)
    return popen


def _poll(client: DrafterClient, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        client.receive(timeout_seconds=0.05)
        client.check_alive()


def test_a_start_that_keeps_progressing_outlives_the_timeout_and_a_stalled_one_does_not(monkeypatch):
    monkeypatch.setattr(client_module.subprocess, "Popen", _fake_popen(subprocess.Popen))
    client = DrafterClient({"count": 8, "every": 0.4}, restart=False, startup_timeout_seconds=1.5)
    client.start()
    try:
        # 3.6 s of start-up, more than twice the timeout, with a stage every 0.4 s: still starting.
        _poll(client, 3.6)
        assert client.state is DrafterState.STARTING, client.last_error
        assert client.startup_stage == "downloading"
        # Then silence: stalled after the timeout.
        _poll(client, 3.0)
        assert client.state is DrafterState.DOWN
        assert "stalled" in (client.last_error or "") and "'downloading'" in (client.last_error or "")
    finally:
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
