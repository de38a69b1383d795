"""The gateway benchmark's pure parts: which cores each process gets, and its percentile."""

import pytest

from minedraft.gateway.bench import cpu_layout, percentile


def test_pinned_layout_gives_the_gateway_a_core_of_its_own():
    gateway, harness, layout = cpu_layout({0, 1, 2, 3}, "pinned")
    assert (gateway, harness, layout) == ({3}, {0, 1, 2}, "pinned")
    assert not gateway & harness


def test_pinned_layout_falls_back_to_shared_on_one_core():
    assert cpu_layout({5}, "pinned") == ({5}, {5}, "shared")


def test_shared_layout_puts_every_process_on_every_core():
    assert cpu_layout({0, 1}, "shared") == ({0, 1}, {0, 1}, "shared")


def test_unknown_layout_is_refused_by_name():
    with pytest.raises(ValueError, match="layout"):
        cpu_layout({0, 1}, "spread")


def test_nearest_rank_percentile():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([3.0], 99) == 3.0
