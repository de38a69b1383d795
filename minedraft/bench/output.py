"""Keeping a benchmark's stdout for its result: everything else it (and what it starts) writes goes to stderr."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 (and sys.stdout) at stderr meanwhile.

    At the descriptor level, not only sys.stdout: vLLM, torch and the drafter processes started meanwhile (which
    inherit descriptor 1) may print, and `--json` output must stay parseable.
    """
    sys.stdout.flush()
    # Descriptors 1 and 2 themselves (sys.stdout may be a wrapper over another descriptor, as under pytest).
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
