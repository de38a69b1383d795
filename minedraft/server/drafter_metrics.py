"""Prometheus metrics of a shared drafter service (`minedraft_drafter_*`): an adapter over its plain counters.

Read at scrape time from the service's ServiceCore (minedraft/engine/drafter/service.py), which only the service's
loop writes; a scrape reads plain numbers and copies the per-engine dicts, so a scrape during a batch sees the
totals of the batches before it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "minedraft_drafter"


class DrafterServiceCollector(Collector):
    def __init__(self) -> None:
        self._core: Any = None
        # The pool's settings as it resolved them (dtype after `auto`, backend, requests held): an info metric.
        self.info: dict[str, str] = {}

    def attach(self, core: Any) -> None:
        self._core = core

    def collect(self) -> Iterator[Metric]:
        if self.info:
            info = GaugeMetricFamily(f"{PREFIX}_info", "The drafter's resolved settings (value 1): dtype (after auto), "
                                     "backend, max_num_seqs.", labels=sorted(self.info))
            info.add_metric([self.info[k] for k in sorted(self.info)], 1)
            yield info
        core = self._core
        if core is None:
            return
        c = core.counters
        totals = (
            ("jobs", "Draft jobs answered (all engines).", c.jobs_done),
            ("batches", "Batched forwards run (one or more engines' jobs each).", c.batches),
            ("shared_batches", "Batches that carried jobs of more than one engine.", c.shared_batches),
            ("batch_requests", "Requests drafted, summed over batches (mean batch size: rate of this / rate of "
             "batches).", c.batch_requests),
            ("busy", "Jobs answered busy (queue full or queued past the engine's deadline).", c.busy_replies),
            ("sessions_expired", "Engine sessions dropped after a silence.", c.sessions_expired),
            ("drafting_seconds", "Seconds spent drafting (utilisation: its rate).", c.drafting_seconds),
            ("optional_drafting_seconds", "Of drafting_seconds, the part spent on lookahead's extra branches, drafted "
             "only when no other job waited (spare time: the pool's autoscaler leaves it out).",
             c.optional_drafting_seconds),
            ("optional_items_dropped", "Lookahead's extra branches not drafted because their batch was shared or other "
             "jobs waited.", c.optional_items_dropped),
        )
        for name, doc, value in totals:
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc)
            family.add_metric([], value)
            yield family
        gauges = (
            ("sessions", "Engine sessions open.", len(core.sessions)),
            ("queued_jobs", "Draft jobs waiting to be drafted.", core.queued_jobs),
            ("requests_held", "Requests whose tokens (and KV) the drafter holds, all engines.",
             len(core.server.contexts)),
        )
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
            gauge.add_metric([], value)
            yield gauge
        jobs = CounterMetricFamily(f"{PREFIX}_engine_jobs", "Draft jobs answered, per engine.", labels=["engine"])
        seconds = CounterMetricFamily(f"{PREFIX}_engine_job_seconds", "Seconds from a job's arrival to its answer, "
                                      "per engine (mean latency: rate of this / rate of engine_jobs).",
                                      labels=["engine"])
        for engine, count in dict(c.engine_jobs).items():
            jobs.add_metric([engine], count)
            seconds.add_metric([engine], c.engine_job_seconds.get(engine, 0.0))
        yield jobs
        yield seconds
