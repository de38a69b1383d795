"""`minedraft doctor` end to end on this CPU with the local pair (short: one second per mode, k and load)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine


def test_doctor_checks_loads_measures_and_gives_a_verdict(pair_dir):
    out = subprocess.run(
        [sys.executable, "-m", "minedraft.cli", "--log-level", "WARNING", "doctor", "--pair", str(pair_dir),
         "--loads", "1,2,4", "--ks", "2", "--seconds", "1", "--repeats", "2", "--max-tokens", "16",
         "--max-model-len", "512", "--kv-cache-gib", "1", "--json"],
        capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)  # stdout is the JSON report alone
    checks = report["checks"]
    assert all(check["ok"] for check in checks.values()), checks
    assert checks["devices"]["target"] == "cpu" and checks["devices"]["drafter_backend"] == "torch"
    # "auto" resolved before anything loads: float32 on this CPU whether or not it has fast bf16 (issue 27: on an
    # AVX-512 BF16 CPU it stayed "auto" and vLLM loaded the float32 pair in bfloat16).
    assert (checks["dtype"]["requested"], checks["dtype"]["dtype"]) == ("auto", "float32")
    assert checks["memory"]["target"]["parameters"] > checks["memory"]["draft"]["parameters"] > 0
    assert checks["vocabulary"]["target_vocab_size"] == checks["vocabulary"]["draft_vocab_size"]
    assert {(r["mode"], r["concurrency"]) for r in report["runs"]} == {
        (m, c) for m in ("ar", "sd", "psd") for c in (1, 2, 4)}
    assert all(r["output_tokens"] > 0 for r in report["runs"])
    # Two interleaved rounds (the default's three take half as long again): each mode, k and load measured in both.
    assert all(len(r["samples"]) == 2 for r in report["runs"]) and report["verdict"]["decided_by"]["repeats"] == 2
    assert any(r["acceptance_rate"] > 0 for r in report["runs"] if r["mode"] == "psd")
    assert isinstance(report["verdict"]["psd_pays"], bool) and report["verdict"]["summary"]
    assert len(report["verdict"]["per_load"]) == 3


def test_doctor_reports_a_vocabulary_mismatch_before_loading(pair_dir, tmp_path, capsys):
    from minedraft.cli import build_parser
    from minedraft.models.tiny import DRAFT_SHAPE, tiny_config

    # A draft whose vocabulary is larger than the target's: its ids would not be the target's tokens.
    draft = tmp_path / "draft"
    config = tiny_config("llama", DRAFT_SHAPE, vocab_size=4096)
    config.save_pretrained(draft)
    # The command's own function in this process (the test above runs the whole command line in a fresh one): it
    # stops before loading anything, and a fresh interpreter's imports were most of this test's time.
    args = build_parser().parse_args(["doctor", "--model", str(pair_dir / "target"), "--draft", str(draft),
                                      "--pair", str(pair_dir), "--json"])
    assert args.func(args) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["checks"]["vocabulary"]["ok"]
    assert "vocabulary (4096) is larger" in report["checks"]["vocabulary"]["error"]
    assert "runs" not in report
