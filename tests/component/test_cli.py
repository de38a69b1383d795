"""CLI contracts other checks depend on: `minedraft generate ... --json` prints one clean JSON object per prompt."""

import json
import subprocess
import sys

import pytest

from minedraft.engine.requests import SamplingSettings

from .driver import reference

pytestmark = pytest.mark.engine


def test_generate_json_lines_match_the_target_alone(tmp_path, pair_dir, ar_engine):
    from minedraft.bench.workload import bench_prompts

    prompts = [p.replace("\n", " ") for p in bench_prompts(pair_dir, 3, chars=120)]
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(prompts) + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "minedraft.cli", "generate", "--model", str(pair_dir / "target"),
         "--draft", str(pair_dir / "draft"), "--mode", "psd", "--prompts-file", str(prompts_file),
         "--max-tokens", "16", "--num-speculative-tokens", "3", "--max-model-len", "512", "--kv-cache-gib", "1",
         "--json"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == len(prompts), f"stdout must hold only the JSON lines: {result.stdout[:500]}"
    objects = [json.loads(line) for line in lines]
    assert [o["index"] for o in objects] == [0, 1, 2]
    assert all(set(o) == {"index", "token_ids", "text", "finish_reason"} for o in objects)
    expected = reference(ar_engine, [ar_engine.encode_prompt(p) for p in prompts], SamplingSettings(max_tokens=16))
    assert [o["token_ids"] for o in objects] == expected
    assert all(o["finish_reason"] in ("length", "stop") and o["text"] for o in objects)


def test_bad_arguments_fail_with_a_named_field(tmp_path, pair_dir):
    prompts_file = tmp_path / "p.txt"
    prompts_file.write_text("x = 1\n")
    result = subprocess.run(
        [sys.executable, "-m", "minedraft.cli", "generate", "--mode", "turbo", "--prompts-file", str(prompts_file),
         "--json"], capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "mode" in result.stderr and "turbo" in result.stderr
    assert result.stdout == ""
    result = subprocess.run(
        [sys.executable, "-m", "minedraft.cli", "generate", "--num-speculative-tokens", "40",
         "--prompts-file", str(prompts_file), "--json"], capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2 and "num_speculative_tokens" in result.stderr


def test_bench_runs_auto_beside_the_fixed_modes_and_reports_each_round(tmp_path, pair_dir):
    """The benchmark end to end on a tiny load: psd, sd and auto share one engine (auto with a cost model of its
    own), every mode's greedy output matches, each round's throughput is kept, and the trace is composed."""
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "minedraft.cli", "bench", "--pair", str(pair_dir), "--modes", "ar,psd,auto",
         "--concurrency", "2", "--num-prompts", "4", "--max-tokens", "8", "--rounds", "2", "--trace", "2:4",
         "--max-model-len", "512", "--kv-cache-gib", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["greedy_outputs_identical"] is True
    level, trace = report["runs"]
    assert level["concurrency"] == 2 and trace["concurrency"] == "trace 2:4"
    for mode in ("ar", "psd", "auto"):
        figures = level["modes"][mode]
        assert len(figures["output_tokens_per_s_by_round"]) == 2 and figures["output_tokens"] == 2 * 4 * 8
    assert sum(level["modes"]["auto"]["output_token_share_by_mode"].values()) == pytest.approx(1.0, abs=0.01)
    text = out.with_suffix(".md").read_text()
    assert "auto = **" in text and "(by round: " in text
    assert "switching for free" in text
    assert out.with_suffix(".png").stat().st_size > 0
