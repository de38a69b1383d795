"""`--log-level` reaches vLLM's own loggers, which configure themselves from the environment, not from logging."""

from __future__ import annotations

import subprocess
import sys

import pytest

from minedraft.cli import build_parser, recorded_command

PROBE = """
import os, sys
os.environ.pop("VLLM_LOGGING_LEVEL", None)
from minedraft.cli import main
main(["--log-level", sys.argv[1], "operator", "crd"])
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging_if_needed, init_logger
# What vLLM does when an engine is created (EngineArgs.create_engine_config), in this process or a worker's.
configure_logging_if_needed(LoggingConfig())
log = init_logger("vllm.minedraft_probe")
log.info("PROBE-INFO")
log.warning("PROBE-WARNING")
"""


@pytest.fixture(scope="module")
def probe_stderr() -> dict[str, str]:
    """Both probes at once: each spends most of its time importing vLLM, so they share the wall time."""
    levels = ("warning", "INFO")
    probes = {level: subprocess.Popen([sys.executable, "-c", PROBE, level], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for level in levels}
    stderr = {}
    for level, probe in probes.items():
        out, err = probe.communicate(timeout=300)
        assert probe.returncode == 0, err[-2000:]
        assert "PROBE" not in out, "vLLM's logs must stay off stdout (--json output)"
        stderr[level] = err
    return stderr


def test_warning_silences_vllm_info_lines_and_keeps_its_warnings(probe_stderr) -> None:
    stderr = probe_stderr["warning"]
    assert "PROBE-WARNING" in stderr
    assert "PROBE-INFO" not in stderr


def test_info_keeps_vllm_info_lines(probe_stderr) -> None:
    # The control: the probe's INFO line does show at INFO, so the test above can fail.
    assert "PROBE-INFO" in probe_stderr["INFO"]


def test_an_unknown_level_is_refused_by_name() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--log-level", "loud", "operator", "crd"])


def test_a_benchmark_records_its_command_without_the_log_level() -> None:
    assert recorded_command(["--log-level", "WARNING", "bench", "steps", "--contexts", "512"]) == (
        "minedraft bench steps --contexts 512")
    assert recorded_command(["--log-level=debug", "bench", "stall"]) == "minedraft bench stall"
