"""`minedraft profile` end to end on this CPU at tiny shapes (real worker processes, real torch forwards), in an
interpreter where vLLM, transformers, gRPC and the rest are blocked, as on a lent GPU machine."""

import json
import subprocess
import sys

from minedraft.profile import curves
from minedraft.profile.shapes import SHAPE_PRESETS
from tests.unit.test_profile_imports import blocked_env


def test_profile_at_tiny_shapes_writes_a_valid_cost_curve_file(tmp_path):
    out = tmp_path / "tiny.json"
    argv = [sys.executable, "-m", "minedraft.profile", "--shapes", "tiny", "--device", "cpu", "--threads", "1",
            "--repeats", "1", "--replays", "1", "--warmup", "0", "--timeout-s", "120", "--output", str(out), "--json"]
    site = tmp_path / "site"
    site.mkdir()
    result = subprocess.run(argv, env=blocked_env(site), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    assert json.loads(result.stdout) == doc  # stdout holds the document and nothing else; progress is on stderr
    assert "[10/10" in result.stderr and "wrote" in result.stderr
    curves.validate(doc)
    assert (doc["format"], doc["execution"], doc["dtype"]) == ("minedraft-cost-curves/v1", "eager (cpu)", "float32")
    assert doc["device"].startswith("CPU: ")
    assert "timeouts" not in doc and "errors" not in doc and "concurrent_ms" not in doc  # no two streams on a CPU
    grid = SHAPE_PRESETS["tiny"]
    target, draft = doc["models"]["pair-v1-target"], doc["models"]["pair-v1-draft"]
    assert (target["role"], draft["role"]) == ("target", "drafter")
    assert len(target["forward_ms"]) == len(draft["forward_ms"]) == len(grid.points) * len(grid.new_tokens())
    assert len(draft["draft_loop_ms"]) == len(grid.points) * len(grid.ks)
    assert all(e["ms"] > 0 for m in (target, draft) for e in (*m["forward_ms"], *m.get("draft_loop_ms", [])))
    assert doc["command"].startswith("minedraft profile --shapes tiny")


def test_minedraft_profile_is_a_subcommand():
    from minedraft.cli import build_parser

    args = build_parser().parse_args(["profile", "--shapes", "tiny", "--target", "qwen3-32b", "--drafter",
                                      "qwen3-1.7b"])
    assert args.func.__module__ == "minedraft.profile.cli"
    assert (args.target, args.drafters) == ("qwen3-32b", ["qwen3-1.7b"])
