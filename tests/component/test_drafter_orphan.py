"""An engine killed outright (SIGKILL, the OOM killer) sends its drafter no Shutdown. The drafter must notice it was
orphaned and stop within about one job - not draft on through its backlog for nobody, holding cores and memory (seen:
the drafters of a SIGKILLed test run kept running until killed by hand).

A real parent process starts a real (torch) drafter through DrafterClient, queues a backlog of slow jobs (the
drafter's test-only per-step sleep makes the backlog take minutes), and SIGKILLs itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from minedraft.engine.drafter.process import STEP_SLEEP_ENV
from minedraft.engine.settings import default_core_split

STEP_SLEEP_SECONDS = 0.3
NUM_JOBS = 40
DRAFT_TOKENS = 8  # each job: about DRAFT_TOKENS x STEP_SLEEP_SECONDS = 2.4 s; the backlog: about 100 s

PARENT = """
import os, signal, sys
from minedraft.engine.drafter import protocol
from minedraft.engine.drafter.client import DrafterClient
client = DrafterClient({settings!r})
client.start()
assert client.wait_ready(120), client.last_error
for n in range({jobs}):
    assert client.submit([protocol.DraftItem(f"r{{n}}", list(range(10, 40)), {tokens})], False) is not None
print(client.pid(), flush=True)
# Give the sends a moment to leave this process's ZMQ queue, then die without a word.
import time; time.sleep(1.0)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan that exited may wait a moment for init to reap it)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return fields[0] != "Z"


def test_a_drafter_whose_engine_was_killed_stops_within_a_job_not_after_its_backlog(pair_dir):
    settings = {"model": str(pair_dir / "draft"), "backend": "torch", "max_model_len": 512, "max_num_seqs": 4,
                "cpu_cores": list(default_core_split()[1]), "dtype": "float32"}
    script = PARENT.format(settings=settings, jobs=NUM_JOBS, tokens=DRAFT_TOKENS)
    parent = subprocess.run([sys.executable, "-c", script], env={**os.environ, STEP_SLEEP_ENV: str(STEP_SLEEP_SECONDS)},
                            stdout=subprocess.PIPE, timeout=300, check=False)
    assert parent.returncode == -9, parent
    pid = int(parent.stdout.decode().split()[0])
    killed_at = time.monotonic()
    try:
        # Well past one job (2.4 s, slower on a loaded machine), well short of the backlog (about 100 s).
        while _running(pid) and time.monotonic() - killed_at < 45:
            time.sleep(0.5)
        assert not _running(pid), "the orphaned drafter kept drafting its backlog"
    finally:
        if _running(pid):
            os.kill(pid, 9)

