"""`minedraft bench` and its subcommands: argument parsing reaches the benchmark, --json output stays clean (no
engine starts here: the benchmarks' measuring functions are replaced)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from minedraft import cli
from minedraft.bench import stall, steps


@pytest.fixture(autouse=True)
def _environment_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    # cli.main sets VLLM_LOGGING_LEVEL for the processes it starts: undone after each test, not left to later ones.
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)


@pytest.mark.parametrize("name", ["steps", "stall"])
def test_bench_subcommand_parses_into_the_benchmarks_run(name: str, monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    calls: list[tuple[Any, str]] = []
    module = {"steps": steps, "stall": stall}[name]
    monkeypatch.setattr(module, "run", lambda args, command: calls.append((args, command)) or 7)
    extra = ["--contexts", "512,2048", "--requests", "8"] if name == "steps" else ["--streams", "4",
                                                                                 "--stop-seconds", "1.5"]
    argv = ["bench", name, "--out", str(tmp_path / "r"), "-k", "2", *extra, "--json"]
    assert cli.main(argv) == 7, "the benchmark's exit code is the command's"
    (args, command), = calls
    assert args.out == tmp_path / "r" and args.k == 2 and args.json is True
    if name == "steps":
        assert (args.contexts, args.requests, args.max_tokens) == ("512,2048", 8, 16)
    else:
        assert (args.streams, args.stop_seconds, args.scenarios) == (4, 1.5, "stop,hang,hang-own-core")
    # Recorded in the result files, so that scripts/bench_all.py can repeat exactly this command.
    assert command == "minedraft " + " ".join(argv)


def test_bench_without_subcommand_still_runs_the_modes_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(cli, "cmd_bench", lambda args: seen.append(args) or 0)
    assert cli.main(["bench", "--json", "o.json", "--modes", "ar,psd", "--model", "t", "--draft", "d"]) == 0
    assert seen[0].json == "o.json" and seen[0].modes == "ar,psd" and seen[0].bench_command is None


def test_bench_without_subcommand_needs_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--model", "t", "--draft", "d"]) == 2
    err = capsys.readouterr().err
    assert "--json" in err and "steps" in err and "stall" in err


def test_unknown_stall_scenario_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--scenarios"):
        cli.main(["bench", "stall", "--out", str(tmp_path / "r"), "--scenarios", "stop,freeze"])


def _noisy(result: dict[str, Any]) -> Any:
    def measure(*args: Any) -> dict[str, Any]:
        # What vLLM, torch and child processes may do while the benchmark runs: print, at both levels.
        print("python-level noise")
        sys.stdout.flush()
        os.write(1, b"fd-level noise\n")
        return result
    return measure


def test_steps_json_output_is_only_the_result(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    result = {"config": {"command": "c"}, "runs": [{"context": 512, "mode": "psd", "layout": "equal-cores",
                                                     "steps": 0}]}
    monkeypatch.setattr(steps, "_measure", _noisy(result))
    assert cli.main(["bench", "steps", "--out", str(tmp_path / "s"), "--json"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out) == result
    assert "python-level noise" in err and "fd-level noise" in err
    assert json.loads((tmp_path / "s.json").read_text()) == result and (tmp_path / "s.md").exists()


def test_steps_reports_failure_to_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                        capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(steps, "_measure", lambda *args: None)
    assert cli.main(["bench", "steps", "--out", str(tmp_path / "s"), "--json"]) == 1
    assert capfd.readouterr().out == "" and not (tmp_path / "s.json").exists()
