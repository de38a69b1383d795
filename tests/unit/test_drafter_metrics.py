"""The drafter pool's metrics, read from a real ServiceCore after real (recording-backend) batches."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from minedraft.server.drafter_metrics import DrafterServiceCollector

from .test_drafter_service import Harness, branch_harness, branch_job


def test_the_pool_reports_jobs_batches_queue_and_per_engine_latency():
    h = Harness()
    h.connect(b"a")
    h.connect(b"b")
    h.job(b"a", 1, ("r", [1, 2], 2))
    h.job(b"b", 1, ("r", [3], 2), ("s", [4], 2))
    h.clock.now += 0.5  # both jobs waited half a second before the batch ran
    h.run()
    h.job(b"a", 2, ("q", [5], 2))  # queued, not drafted yet
    registry = CollectorRegistry()
    collector = DrafterServiceCollector()
    registry.register(collector)
    assert generate_latest(registry) == b""  # nothing before the service exists
    collector.attach(h.core)
    value = registry.get_sample_value
    assert value("minedraft_drafter_jobs_total") == 2
    assert value("minedraft_drafter_batches_total") == 1
    assert value("minedraft_drafter_shared_batches_total") == 1
    assert value("minedraft_drafter_batch_requests_total") == 3
    assert value("minedraft_drafter_sessions") == 2
    assert value("minedraft_drafter_queued_jobs") == 1
    assert value("minedraft_drafter_requests_held") == 4
    assert value("minedraft_drafter_engine_jobs_total", {"engine": "a"}) == 1
    assert value("minedraft_drafter_engine_job_seconds_total", {"engine": "b"}) == 0.5


def test_the_pool_reports_time_on_lookaheads_extra_branches_and_those_it_dropped():
    h = branch_harness()
    h.core.on_message(b"a", branch_job(1, [1, 2, 3]))
    h.run()  # alone: both branches drafted, 3 of the 7 drafted tokens the extra branch's
    h.core.on_message(b"a", branch_job(2, [7], base=3))
    h.job(b"b", 1, ("r", [8], 2))
    h.run()  # shared with b's job: a's extra branch dropped
    registry = CollectorRegistry()
    collector = DrafterServiceCollector()
    registry.register(collector)
    collector.attach(h.core)
    value = registry.get_sample_value
    assert value("minedraft_drafter_drafting_seconds_total") == pytest.approx(0.02)
    assert value("minedraft_drafter_optional_drafting_seconds_total") == pytest.approx(0.01 * 3 / 7)
    assert value("minedraft_drafter_optional_items_dropped_total") == 1
