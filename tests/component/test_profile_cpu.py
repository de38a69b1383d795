"""`minedraft profile` end to end on this CPU at tiny shapes (real worker processes, real torch forwards), in an
interpreter where vLLM, transformers, gRPC and the rest are blocked, as on a lent GPU machine."""

import json
import os
import re
import signal
import subprocess
import sys
import time

from minedraft.profile import curves
from minedraft.profile.shapes import SHAPE_PRESETS
from tests.unit.test_profile_imports import blocked_env


def test_profile_at_tiny_shapes_writes_a_valid_cost_curve_file(tmp_path):
    out = tmp_path / "tiny.json"
    argv = [sys.executable, "-m", "minedraft.profile", "--shapes", "tiny", "--device", "cpu", "--threads", "1",
            "--repeats", "1", "--replays", "1", "--warmup", "0", "--min-block-ms", "0", "--timeout-s", "120",
            "--output", str(out), "--json"]
    site = tmp_path / "site"
    site.mkdir()
    result = subprocess.run(argv, env=blocked_env(site), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    assert json.loads(result.stdout) == doc  # stdout holds the document and nothing else; progress is on stderr
    assert "[14/14" in result.stderr and "wrote" in result.stderr
    curves.validate(doc)
    assert (doc["format"], doc["execution"], doc["dtype"]) == ("minedraft-cost-curves/v1", "eager (cpu)", "float32")
    assert doc["device"].startswith("CPU: ")
    assert "timeouts" not in doc and "errors" not in doc and "concurrent_ms" not in doc  # no two streams on a CPU
    grid = SHAPE_PRESETS["tiny"]
    target, draft = doc["models"]["pair-v1-target"], doc["models"]["pair-v1-draft"]
    assert (target["role"], draft["role"]) == ("target", "drafter")
    assert len(target["forward_ms"]) == len(draft["forward_ms"]) == len(grid.points) * len(grid.new_tokens())
    assert len(draft["draft_loop_ms"]) == len(grid.points) * len(grid.ks)
    assert len(target["prefill_ms"]) == len(draft["prefill_ms"]) == len(grid.prefill_points)
    assert all(e["ms"] > 0 for m in (target, draft) for e in (*m["forward_ms"], *m.get("draft_loop_ms", [])))
    assert doc["command"].startswith("minedraft profile --shapes tiny")


def test_a_drafter_profiled_alone_feeds_plan_beside_the_targets_curves(tmp_path, capsys):
    """A drafter device of its own: `profile --drafter-only` measures the drafter alone; `plan --drafter-curves`
    takes its costs (measured, not a roofline) and its device for the engine's drafting modes."""
    from pathlib import Path

    from minedraft.cli import main

    out = tmp_path / "drafter.json"
    argv = [sys.executable, "-m", "minedraft.profile", "--shapes", "tiny", "--device", "cpu", "--threads", "1",
            "--repeats", "1", "--replays", "1", "--warmup", "0", "--min-block-ms", "0", "--drafter-only",
            "--output", str(out)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    curves.validate(doc)
    assert doc["models"]["pair-v1-target"]["forward_ms"] == [] and doc["models"]["pair-v1-draft"]["draft_loop_ms"]
    target_curves = Path(__file__).resolve().parents[2] / "benchmarks" / "curves" / "cpu-local-pair.json"
    assert main(["plan", "--curves", str(target_curves), "--drafter-curves", str(out), "--concurrency", "2",
                 "-k", "2", "--no-auto", "--modes", "sd", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["devices"]["drafter"]["costs"] == "measured (the curve file)"
    assert planned["loads"][0]["modes"]["sd-k2"]["tokens_per_s"] > 0


def test_minedraft_profile_is_a_subcommand():
    from minedraft.cli import build_parser

    args = build_parser().parse_args(["profile", "--shapes", "tiny", "--target", "qwen3-32b", "--drafter",
                                      "qwen3-1.7b"])
    assert args.func.__module__ == "minedraft.profile.cli"
    assert (args.target, args.drafters) == ("qwen3-32b", ["qwen3-1.7b"])


def test_sigterm_to_the_profiler_kills_its_worker(tmp_path):
    """An outer `timeout` (as in scripts/gpu_profile.sh) must not leave a worker running: it leads its own session,
    so nothing else would end it, and on a GPU it would keep the device."""
    out = tmp_path / "partial.json"
    argv = [sys.executable, "-m", "minedraft.profile", "--shapes", "cpu-small", "--device", "cpu", "--threads", "1",
            "--repeats", "50", "--output", str(out)]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=tmp_path)
    assert proc.stderr is not None
    worker_pid = None
    for line in proc.stderr:
        match = re.search(r"worker \(pid (\d+)\) ready", line)
        if match:
            worker_pid = int(match.group(1))
            break
    assert worker_pid is not None
    proc.send_signal(signal.SIGTERM)
    exit_code = proc.wait(timeout=60)
    try:
        assert _exits(worker_pid), f"worker {worker_pid} still runs after the profiler got SIGTERM"
    finally:
        if not _exits(worker_pid, tries=1):
            os.kill(worker_pid, signal.SIGKILL)  # do not leave it behind when the test fails
    assert exit_code == 128 + signal.SIGTERM


def _exits(pid: int, tries: int = 200) -> bool:
    """True once the process has exited (a zombie left for its parent to reap counts as exited)."""
    for _ in range(tries):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False
