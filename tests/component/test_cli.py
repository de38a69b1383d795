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
