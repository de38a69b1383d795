"""Lending the drafter's cores: the step thread's affinity and torch's thread count widen and narrow together."""

from __future__ import annotations

import os
import threading

import torch

from minedraft.engine.placement import ComputePlacement


def test_widen_and_narrow_on_the_calling_thread_only() -> None:
    cores = tuple(sorted(os.sched_getaffinity(0)))
    threads_before = torch.get_num_threads()
    seen: dict[str, object] = {}

    def step_thread() -> None:
        placement = ComputePlacement(cores[:1], cores[1:])
        placement.apply(wide=False)
        seen["narrow"] = (os.sched_getaffinity(0), torch.get_num_threads())
        placement.apply(wide=True)
        seen["wide"] = (os.sched_getaffinity(0), torch.get_num_threads())

    try:
        worker = threading.Thread(target=step_thread)
        worker.start()
        worker.join()
        assert seen["narrow"] == ({cores[0]}, 1)
        assert seen["wide"] == (set(cores), len(cores))
        assert os.sched_getaffinity(0) == set(cores), "other threads keep their affinity"
    finally:
        torch.set_num_threads(threads_before)


def test_nothing_to_lend_keeps_the_target_cores() -> None:
    placement = ComputePlacement((0,), ())
    assert not placement.can_widen
    assert placement.wide_cores == (0,)
