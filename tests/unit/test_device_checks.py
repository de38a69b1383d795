"""The device-aware greedy check: bitwise on CPUs, a stated agreement threshold on GPUs, red for a real bug."""

import random

import pytest

from tests.component.device_checks import AGREEMENT_TOKENS, assert_greedy_matches, prefix_agreement


def test_cpu_mode_is_bitwise():
    refs = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert_greedy_matches([list(r) for r in refs], refs, "same", gpu=False)
    with pytest.raises(AssertionError, match="request 1 diverged"):
        assert_greedy_matches([[1, 2, 3, 4], [5, 6, 7, 9]], refs, "late fork", gpu=False)


def test_gpu_mode_tolerates_a_rare_late_near_tie_but_not_a_psd_bug():
    rng = random.Random(0)
    refs = [[rng.randrange(1000) for _ in range(40)] for _ in range(20)]
    # bf16 near-ties: one request forks early, a few fork after the checked prefix.
    near_ties = [list(r) for r in refs]
    near_ties[0][5] += 1
    for i in (3, 7, 11):
        near_ties[i][AGREEMENT_TOKENS + 2] += 1
    assert prefix_agreement(near_ties, refs) == 0.95
    assert_greedy_matches(near_ties, refs, "bf16", gpu=True)
    # A PSD bug (e.g. a draft committed without verification): most requests fork within a few tokens.
    broken = [r[:2] + [t + 1 for t in r[2:]] if i % 3 else list(r) for i, r in enumerate(refs)]
    with pytest.raises(AssertionError, match="agree with the target alone"):
        assert_greedy_matches(broken, refs, "bug", gpu=True)
