"""Which CPU cores the target computes on: its own, plus the drafter's while nothing is being drafted.

On a CPU machine the drafter's cores sit idle whenever the engine runs without drafts (auto mode chose ar, or the
drafter is down). The target then widens onto them (more threads, the step thread's affinity widened so the extra
OpenMP worker may run there) and narrows back before drafting resumes, so drafting never competes with it. On GPU
machines the drafter has a device of its own and nothing is lent.

Both the affinity and OpenMP's thread count belong to the calling thread, so the engine's step thread makes these
calls, between steps.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


class ComputePlacement:
    def __init__(self, target_cores: tuple[int, ...], lend_cores: tuple[int, ...]) -> None:
        self.target_cores = tuple(target_cores)
        self.wide_cores = tuple(dict.fromkeys([*target_cores, *lend_cores]))
        self.wide: bool | None = None
        self.num_threads = 0

    @property
    def can_widen(self) -> bool:
        return bool(self.target_cores) and len(self.wide_cores) > len(self.target_cores)

    def apply(self, wide: bool) -> None:
        """Idempotent; cheap enough (two syscalls) to call once per step when the mode changes."""
        if not self.target_cores or wide == self.wide:
            return
        import torch

        cores = self.wide_cores if wide and self.can_widen else self.target_cores
        try:
            os.sched_setaffinity(0, cores)
        except OSError as exc:  # a core outside this process's allowed set: keep computing where we are
            log.warning("cannot bind the step thread to cores %s: %s", cores, exc)
            return
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op once it has bound its threads; the
        # underlying call still works and is what we mean.
        torch._C.set_num_threads(len(cores))
        self.wide = wide
        # Read back on this thread: OpenMP keeps the thread count per thread, and this is the one that computes.
        self.num_threads = torch.get_num_threads()
