"""Which tests read the CPU kind, for `make test-other-cpu`'s selection (the Makefile says how it was made):

    MINEDRAFT_CPU_FAST_BF16=audit PYTHONPATH=$PWD .venv/bin/pytest -p tests.cpu_kind_audit -p no:randomly tests/unit

Reads in the test process are recorded per test (and answered as if the variable were unset); a child process that
reads it refuses "audit" (placement._cpu_has_fast_bf16 takes only 0 or 1), so its test fails and shows up too. The
report, at the end: each reading test and whether it read this process's environment or a mapping it passed in."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

import pytest

from minedraft.engine import placement

_AUDIT = "audit"
_real = placement._cpu_has_fast_bf16
_current: list[str] = []
_reads: dict[str, set[str]] = {}


def _recording(environ: Mapping[str, str]) -> bool:
    audited = environ.get(placement.CPU_FAST_BF16_ENV) == _AUDIT
    if _current:
        _reads.setdefault(_current[-1], set()).add("process environment" if environ is os.environ or audited
                                                   else "a mapping it passed")
    if audited:
        environ = {k: v for k, v in environ.items() if k != placement.CPU_FAST_BF16_ENV}
    return _real(environ)


placement._cpu_has_fast_bf16 = _recording


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _current.append(item.nodeid)
    yield
    _current.pop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.write_line(f"tests that read the CPU kind ({len(_reads)}):")
    for nodeid, where in sorted(_reads.items()):
        terminalreporter.write_line(f"  {nodeid}: {', '.join(sorted(where))}")
