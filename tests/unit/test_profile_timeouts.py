"""Timeouts enforced from outside the measuring process: a hung worker (and everything it started) is killed, the
measurement is recorded as timed out, and the run goes on with a fresh worker. Workers here are a torch-free
stand-in (profile_support/fake_worker.py) that hangs where it is told to."""

import json
import sys
import time
from pathlib import Path

from minedraft.profile import curves
from minedraft.profile.runner import ProfileSettings, run_profile
from minedraft.profile.shapes import ShapeGrid
from minedraft.profile.supervisor import run_child

FAKE = (sys.executable, str(Path(__file__).parent / "profile_support" / "fake_worker.py"))


def _job(*batches: int) -> dict:
    return {"measurements": [{"id": i, "measurement": {"kind": "forward", "model": "m", "batch": b, "context": 8,
                                                       "tokens": 1, "drafter": ""}}
                             for i, b in enumerate(batches)]}


def _gone(pid: int) -> bool:
    """True once the process has exited (a zombie left for its parent to reap counts as exited)."""
    for _ in range(100):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _hung_pids(pid_file: Path) -> list[int]:
    return [int(p) for line in pid_file.read_text().splitlines() for p in line.split()]


def test_a_hung_measurement_is_killed_with_its_whole_process_group(tmp_path, monkeypatch):
    pid_file = tmp_path / "pids"
    monkeypatch.setenv("FAKE_WORKER_HANG_BATCHES", "2")
    monkeypatch.setenv("FAKE_WORKER_PID_FILE", str(pid_file))
    seen = []
    outcome = run_child(list(FAKE), _job(1, 2, 4), setup_timeout_s=30, measurement_timeout_s=1.0,
                        on_event=seen.append)
    assert outcome.ready is not None
    assert outcome.results[0]["ms"] == 1.0
    assert (outcome.failure, outcome.during, outcome.failed_id) == ("timeout", "measurement", 1)
    assert 2 not in outcome.results  # never reached: the worker was killed in measurement 1
    assert [e["event"] for e in seen] == ["ready", "start", "result", "start"]
    worker, grandchild = _hung_pids(pid_file)
    assert _gone(worker) and _gone(grandchild)


def test_a_hung_setup_is_a_setup_timeout(tmp_path, monkeypatch):
    pid_file = tmp_path / "pids"
    monkeypatch.setenv("FAKE_WORKER_HANG_SETUP", "1")
    monkeypatch.setenv("FAKE_WORKER_PID_FILE", str(pid_file))
    outcome = run_child(list(FAKE), _job(1), setup_timeout_s=1.0, measurement_timeout_s=30)
    assert (outcome.ready, outcome.failure, outcome.during, outcome.failed_id) == (None, "timeout", "setup", None)
    assert all(_gone(pid) for pid in _hung_pids(pid_file))


def test_a_worker_that_dies_is_an_exit_not_a_timeout():
    outcome = run_child([sys.executable, "-c", "import sys; sys.stdin.read(); sys.exit(3)"], _job(1),
                        setup_timeout_s=30, measurement_timeout_s=30)
    assert (outcome.failure, outcome.during, outcome.exit_code) == ("exit", "setup", 3)


def test_the_run_records_the_timeout_and_measures_the_rest(monkeypatch):
    monkeypatch.setenv("FAKE_WORKER_HANG_BATCHES", "2")
    settings = ProfileSettings(target="pair-v1-target", drafters=("pair-v1-draft",),
                               grid=ShapeGrid(points=((1, 8), (2, 8), (4, 8)), ks=(2,)),
                               measurement_timeout_s=1.0, setup_timeout_s=30, worker_argv=FAKE)
    lines = []
    doc = run_profile(settings, log=lines.append)
    target = doc["models"]["pair-v1-target"]
    # Batch 2 hung in each of the three kinds it appears in (two forwards per model, one draft loop): each one
    # is recorded as a timeout, and a fresh worker measured what came after it.
    assert {(e["batch"], e["new_tokens"]) for e in target["forward_ms"]} == {(1, 1), (1, 3), (4, 1), (4, 3)}
    assert {e["batch"] for e in doc["models"]["pair-v1-draft"]["draft_loop_ms"]} == {1, 4}
    timeouts = doc["timeouts"]
    assert len(timeouts) == 5 and {t["batch"] for t in timeouts} == {2}
    assert {t["during"] for t in timeouts} == {"measurement"} and {t["timeout_s"] for t in timeouts} == {1.0}
    assert doc["device"] == "fake device"
    assert any("timeout (measurement); restarting the worker" in line for line in lines)


def test_a_spent_budget_skips_what_is_left(monkeypatch):
    monkeypatch.setenv("FAKE_WORKER_HANG_BATCHES", "1")
    settings = ProfileSettings(target="pair-v1-target", drafters=("pair-v1-draft",),
                               grid=ShapeGrid(points=((1, 8), (2, 8)), ks=(2,)), measurement_timeout_s=60,
                               setup_timeout_s=60, budget_s=1.0, worker_argv=FAKE)
    doc = run_profile(settings)
    # The first measurement hangs until the budget ends; nothing else is started after that.
    assert doc["timeouts"][0]["during"] == "budget"
    assert len(doc["timeouts"]) + sum(len(m["forward_ms"]) + len(m.get("draft_loop_ms", []))
                                      for m in doc["models"].values()) == 10


def test_the_document_is_checkpointed_after_every_worker(monkeypatch):
    monkeypatch.delenv("FAKE_WORKER_HANG_BATCHES", raising=False)
    grid = ShapeGrid(points=((1, 8),), ks=(2,), concurrent_points=((1, 8),), concurrent_ks=(2,))
    settings = ProfileSettings(target="pair-v1-target", drafters=("pair-v1-draft",), grid=grid, device="cuda",
                               worker_argv=FAKE)
    saved = []
    doc = run_profile(settings, checkpoint=lambda d: saved.append(curves.dumps(d)))
    # Three workers: the target, the drafter, the pair on two streams (the fake worker does not need a GPU).
    assert len(saved) == 3
    first = json.loads(saved[0])
    assert first["device"] == "fake device" and len(first["models"]["pair-v1-target"]["forward_ms"]) == 2
    assert first["models"]["pair-v1-draft"]["forward_ms"] == [] and "concurrent_ms" not in first
    assert json.loads(saved[-1]) == json.loads(curves.dumps(doc))
    assert doc["execution"] == "CUDA graphs" and len(doc["concurrent_ms"]) == 1


def test_a_worker_that_dies_in_a_measurement_costs_that_measurement_only(monkeypatch):
    monkeypatch.setenv("FAKE_WORKER_CRASH_BATCHES", "2")
    settings = ProfileSettings(target="pair-v1-target", drafters=(), grid=ShapeGrid(points=((1, 8), (2, 8), (4, 8)),
                                                                                  ks=(2,)), worker_argv=FAKE)
    doc = run_profile(settings)
    assert {(e["batch"], e["new_tokens"]) for e in doc["models"]["pair-v1-target"]["forward_ms"]} == {
        (1, 1), (1, 3), (4, 1), (4, 3)}
    assert [(e["batch"], e["message"]) for e in doc["errors"]] == [
        (2, "the worker exited with code 9 during measurement")] * 2
    assert "timeouts" not in doc


def test_a_worker_that_ends_after_an_error_is_replaced(monkeypatch):
    monkeypatch.setenv("FAKE_WORKER_ERROR_BATCHES", "2")
    settings = ProfileSettings(target="pair-v1-target", drafters=(), grid=ShapeGrid(points=((1, 8), (2, 8), (4, 8)),
                                                                                  ks=(2,)), worker_argv=FAKE)
    doc = run_profile(settings)
    assert {(e["batch"], e["new_tokens"]) for e in doc["models"]["pair-v1-target"]["forward_ms"]} == {
        (1, 1), (1, 3), (4, 1), (4, 3)}
    assert [(e["batch"], e["tokens"], e["message"]) for e in doc["errors"]] == [
        (2, 1, "OutOfMemoryError: fake"), (2, 3, "OutOfMemoryError: fake")]
