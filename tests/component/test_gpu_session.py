"""scripts/gpu_session.sh --dry-run: every stage of the prepared GPU run on this CPU at tiny shapes, in a Python
whose every import of vLLM, transformers, gRPC, ... fails (the device machine has torch and Triton only), within its
limits. Its numbers mean nothing on a CPU; what is checked is that each stage runs, records and is summarised."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from minedraft.profile import session
from tests.unit.test_profile_imports import ROOT, blocked_env


def test_the_stage_limits_fit_the_nine_minutes():
    kill_grace_s = 5
    assert sum(session.STAGE_LIMITS_S.values()) + kill_grace_s * len(session.STAGE_LIMITS_S) <= 9 * 60
    assert set(session.STAGE_LIMITS_S) == {"check", *session.STAGES, "summary"}


def test_the_dry_run_runs_every_stage_torch_only(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    out = tmp_path / "out"
    env = dict(blocked_env(site), PYTHON=sys.executable)
    env.pop("OUT", None)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_session.sh"), "--dry-run", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    stages = summary["stages"]
    assert list(stages) == ["check", *session.STAGES]
    for name, stage in stages.items():
        assert stage["status"] == "done" and stage["dry_run"], name
        assert stage["results"] and not stage["errors"], (name, stage.get("errors"))
    assert stages["curves"]["results"][0]["exit"] == 0 and stages["curves"]["results"][0]["curves"]
    variants = {r["variant"]: r for r in stages["async-step"]["results"] if "variant" in r}
    assert set(variants) == {"sync", "alone", "bursts", "bursts-switch-0.5ms", "bursts-own-stream"}
    assert all(v["outputs_equal"] and v["idle_gap_ms"]["n"] >= 10 for v in variants.values())
    assert all(r["equal"] for r in stages["keyed"]["results"])
    assert [r["rows"] for r in stages["keyed"]["results"]] == [32, 64, 128, 256]
    for job in stages["drafter-job"]["results"]:
        assert job["first_forward_ms"] > 0 and job["steps_ms"] > 0 and job["job_wall_ms"] >= job["first_forward_ms"]
    assert "## keyed" in (out / "summary.md").read_text()
    assert os.path.exists(out / "curves-tiny.json")


def test_a_stage_killed_by_its_limit_is_reported_as_such(tmp_path):
    (tmp_path / "check.json").write_text(json.dumps({"stage": "check", "status": "running", "results": [],
                                                     "errors": []}))
    doc = session.summarize(tmp_path)
    assert doc["stages"]["check"]["status"] == "running"
    assert doc["stages"]["keyed"] == {"status": "missing"}
    assert "| keyed | missing |" in session.summary_markdown(doc)
    assert session.main(["summary", "--out", str(tmp_path)]) == 1
