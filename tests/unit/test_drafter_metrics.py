"""The drafter pool's metrics, read from a real ServiceCore after real (recording-backend) batches."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from minedraft.server.drafter_metrics import DrafterServiceCollector

from .test_drafter_service import Harness


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
