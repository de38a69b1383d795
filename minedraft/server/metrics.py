"""Prometheus metrics of one engine replica (`minedraft_engine_*`): an adapter over the engine's plain statistics.

Three sources, each counted once:
- step records (`Engine.step_records(since)`), polled by `EngineExporter.run` on the event loop: per-mode counters
  and per-step histograms. Only records newer than the last seen step are ingested, so nothing is counted twice;
  counters start at zero when the exporter starts (a replica's metrics start with its server).
- a snapshot read between steps at the same poll (`call`, wherever the engine runs): totals kept by the engine only
  (drafter restarts, deadline misses, preemptions, auto switches) and gauges (load, KV cache, mode, k, drafter up,
  predicted goodput). `SnapshotCollector` turns the latest snapshot into metric families at scrape time.
- the Generate streams (`RequestMetrics.observe`): time to first token, time per output token, end-to-end seconds,
  finish reasons, prompt and streamed tokens.

Overlap fraction (the engine's definition, minedraft/engine/control/stats.py): the share of drafting time hidden behind
verification, `1 - wait / draft` over a window, clamped to [0, 1]. In PromQL:
    1 - rate(minedraft_engine_verifier_wait_seconds_sum[w]) / rate(minedraft_engine_draft_seconds_sum[w])
(1.0: drafting fully hidden; 0: draft-then-verify in sequence).

vLLM's own metrics (`vllm:*`) live in prometheus_client's process-global registry, where vLLM's in-process engine
registers them; `VllmMetricsBridge` re-exposes them on this server's registry unchanged (with the engine in a process of
its own, as each poll brought them from there).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from minedraft.engine import calls
from minedraft.engine.control.stats import EngineTotals, StepRecord
from minedraft.engine.core import Engine
from minedraft.engine.requests import EngineDeadError, OutputDelta
from minedraft.engine.serving import ServingEngine

log = logging.getLogger(__name__)

PREFIX = "minedraft_engine"

# Modes whose steps go through our scheduler and so produce step records (vllm-sd and a plain ar engine use vLLM's).
RECORDED_MODES = ("psd", "sd", "ar", "lookahead")
DRAFTING_MODES = ("psd", "sd", "lookahead")
# Engine modes reported by the mode gauge (one series per mode, 1 for the one the coming steps run).
ALL_MODES = ("psd", "sd", "ar", "vllm-sd")

# Per-step phases on CPU run from ~1 ms (a tiny drafter job) to seconds (a large verify on a busy CPU); on GPUs from
# well under a millisecond. Buckets span both.
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# 2.5 s is a bucket boundary on purpose: the latency SLO alert counts first tokens slower than it.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
SUBBATCH_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
# The APIs a request can arrive through (the `protocol` label of the request families).
PROTOCOLS = ("grpc", "http")


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine reports at one moment (read on its thread, between steps)."""

    totals: EngineTotals
    running: int
    waiting: int
    kv_cache_usage: float
    mode: str
    k: int
    configured_mode: str
    # None when the engine has no drafter (an ar or vllm-sd engine).
    drafter_up: bool | None
    # (mode, k, predicted output tokens/s) from the cost model at the current load.
    predictions: tuple[tuple[str, int, float], ...] = ()


def read_snapshot(engine: Engine) -> EngineSnapshot:
    """Runs between steps wherever the engine runs (`call`): every read is consistent with the last completed step."""
    running, waiting = engine.load()
    mode, k = engine.current_mode
    scheduler = engine.psd_scheduler
    # The cost model predicts for a number of running requests; at idle, the capacity of one request is the
    # meaningful figure (0 running predicts nothing).
    predictions = tuple((p.mode, p.k, float(p.output_tokens_per_second)) for p in engine.predictions(max(1, running)))
    return EngineSnapshot(
        totals=engine.totals(),
        running=running,
        waiting=waiting,
        kv_cache_usage=engine.kv_cache_usage(),
        mode=mode.value,
        k=k,
        configured_mode=engine.configured_mode.value,
        drafter_up=bool(scheduler.drafter_up) if scheduler is not None and scheduler.drafter is not None else None,
        predictions=predictions,
    )


def snapshot_families(snapshot: EngineSnapshot, model: str) -> list[Metric]:
    """Metric families of one snapshot (pure): totals the engine alone keeps, and gauges."""
    families: list[Metric] = []

    def counter(name: str, doc: str, value: float) -> None:
        family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["model"])
        family.add_metric([model], value)
        families.append(family)

    def gauge(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
        extra = labels or {}
        family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["model", *extra])
        family.add_metric([model, *extra.values()], value)
        families.append(family)
        return family

    totals = snapshot.totals
    counter("drafter_restarts", "Drafter process restarts (after a crash, a hang or failed jobs).",
            totals.drafter_restarts)
    counter("drafter_deadline_misses", "Steps that gave up waiting for drafts at the deadline and ran without.",
            totals.deadline_misses)
    counter("drafter_errors", "Draft jobs that failed in the drafter.", totals.drafter_errors)
    counter("drafter_busy", "Draft jobs a shared drafter service refused as busy (queue full or past the engine's "
            "deadline); verified without drafts.", totals.drafter_busy)
    counter("preemptions", "Requests pushed back to waiting because the KV cache ran out.", totals.preemptions)
    counter("mode_switches", "Switches of mode or k made by auto mode.", totals.mode_switches)
    gauge("running_requests", "Requests being decoded (both sub-batches).", snapshot.running)
    gauge("waiting_requests", "Requests waiting for admission (queue).", snapshot.waiting)
    gauge("kv_cache_usage_ratio", "Share of the target's KV cache in use (0-1).", snapshot.kv_cache_usage)
    gauge("num_speculative_tokens", "k of the coming steps (draft tokens per request per step; 0 without drafts).",
          snapshot.k)
    mode = GaugeMetricFamily(f"{PREFIX}_mode", "1 for the mode the coming steps run, 0 for the others.",
                             labels=["model", "mode"])
    for name in ALL_MODES:
        mode.add_metric([model, name], 1.0 if name == snapshot.mode else 0.0)
    families.append(mode)
    gauge("auto_mode", "1 when auto mode chooses the mode and k, 0 when they are fixed.",
          1.0 if snapshot.configured_mode == "auto" else 0.0)
    if snapshot.drafter_up is not None:
        gauge("drafter_up", "1 while the drafter process serves drafts, 0 while it is down or restarting.",
              1.0 if snapshot.drafter_up else 0.0)
    if snapshot.predictions:
        predicted = GaugeMetricFamily(
            f"{PREFIX}_predicted_output_tokens_per_second",
            "Cost model's predicted output tokens/s of each mode and k at the current number of running requests.",
            labels=["model", "mode", "k"])
        for pred_mode, pred_k, value in snapshot.predictions:
            predicted.add_metric([model, pred_mode, str(pred_k)], value)
        families.append(predicted)
        gauge("predicted_best_output_tokens_per_second",
              "The best predicted output tokens/s over modes and k at the current load: this replica's capacity.",
              max(value for _, _, value in snapshot.predictions))
    return families


class SnapshotCollector(Collector):
    """Serves the latest snapshot at scrape time; nothing until the first poll has read one."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.snapshot: EngineSnapshot | None = None

    def collect(self) -> Iterable[Metric]:
        snapshot = self.snapshot  # one read: the poller replaces the object, never mutates it
        return snapshot_families(snapshot, self.model) if snapshot is not None else []

    def describe(self) -> Iterable[Metric]:
        # Registering must not take a snapshot (there may be none yet); the names are fixed by snapshot_families.
        return []


def prefill_tokens(record: StepRecord) -> int:
    """Prompt tokens a step computed: its scheduled tokens less one per decoding request and the k draft positions
    of each request that carried drafts (drafts are padded to k). A prompt's chunk on a request already admitted
    counts here too (vLLM schedules a long prompt in chunks over several steps)."""
    decode = record.num_decode_requests + record.num_requests_with_drafts * record.k
    return max(0, record.num_scheduled_tokens - decode)


class StepMetrics:
    """Counters and histograms fed from step records: no I/O, so tests feed it records directly."""

    def __init__(self, registry: CollectorRegistry | None, model: str, max_positions: int = 0) -> None:
        self.model = model
        labels = ["model", "mode"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, [*labels, *extra], registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, labels, buckets=buckets, registry=registry)

        self.steps = counter("steps", "Engine steps.")
        self.draft_steps = counter("draft_steps", "Verification steps that carried drafts.")
        self.drafts = counter("drafts", "Request drafts verified: one per request per step that carried drafts for "
                                        "it (the denominator of mean accepted length).")
        self.draft_tokens = counter("draft_tokens", "Draft tokens verified.")
        self.accepted_tokens = counter("accepted_tokens", "Draft tokens accepted.")
        self.drafted_per_position = counter("drafted_tokens_per_position",
                                            "Draft tokens verified at each draft position (0 = first).", ("position",))
        self.accepted_per_position = counter("accepted_tokens_per_position",
                                             "Draft tokens accepted at each draft position (0 = first).",
                                             ("position",))
        self.output_tokens = counter("output_tokens", "Tokens the target committed (accepted drafts plus one "
                                                      "sampled token per verified request).")
        self.prefill_tokens = counter("prefill_tokens", "Prompt tokens the target computed in steps (prefill "
                                                        "chunks; prefix-cache hits excluded).")
        self.prefill_seconds = counter("prefill_seconds", "Step seconds spent on prefill: each step's seconds times "
                                                          "its share of tokens that were prompt tokens. Its rate is "
                                                          "the share of the replica's time prefill takes (the "
                                                          "autoscaler's prefill signal).")
        # Lookahead: hit rate = rate(branch_hits) / (rate(branch_hits) + rate(branch_misses)).
        self.branch_hits = counter("lookahead_branch_hits", "Decoding requests a lookahead step verified with a "
                                                            "pre-drafted branch matching their real outcome.")
        self.branch_misses = counter("lookahead_branch_misses", "Decoding requests a lookahead step verified without "
                                                                "drafts: no branch matched (newcomers, misses, late "
                                                                "branch jobs).")
        self.branches_drafted = counter("lookahead_branches_drafted", "Outcomes pre-drafted beyond each request's "
                                                                      "root by the branch jobs sent.")
        self.bonus_outcomes = counter("lookahead_bonus_outcomes", "Verifications with candidates, by what ended "
                                                                  "them (after=full: every draft accepted; "
                                                                  "after=reject) and whether the target's token was "
                                                                  "among the drafter's top-F (covered).",
                                      ("after", "covered"))
        self.step_seconds = histogram("step_seconds", "Wall time of one engine step.", STEP_SECONDS_BUCKETS)
        self.verify_seconds = histogram("verify_seconds", "Target forward (verification) time per step.",
                                        STEP_SECONDS_BUCKETS)
        self.draft_seconds = histogram("draft_seconds", "Drafting time of the job whose drafts a step verified "
                                                        "(measured inside the drafter).", STEP_SECONDS_BUCKETS)
        self.wait_seconds = histogram("verifier_wait_seconds", "Time a step waited for its drafts (0 when they were "
                                                               "ready: drafting hidden).", STEP_SECONDS_BUCKETS)
        self.idle_seconds = histogram("drafter_idle_seconds", "Drafter idle time per step.", STEP_SECONDS_BUCKETS)
        self.subbatch_size = histogram("subbatch_size", "Requests in the sub-batch a step verified.",
                                       SUBBATCH_BUCKETS)
        self.subbatch_requests = Gauge(f"{PREFIX}_subbatch_requests", "Requests in each sub-batch after the last step.",
                                       ["model", "subbatch"], registry=registry)
        self.records_missed = Counter(f"{PREFIX}_step_records_missed",
                                      "Step records that left the engine's bounded history before the exporter read "
                                      "them (their counts are missing from the per-step metrics).", ["model"],
                                      registry=registry)
        self.last_step: int | None = None
        self._initialize(max_positions)

    def _initialize(self, max_positions: int) -> None:
        # Create every series at 0 up front: a series first scraped at a non-zero value loses that increase to
        # rate(), and dashboards should show "0 drafts", not "no data".
        model = self.model
        self.records_missed.labels(model)
        for group in ("0", "1"):
            self.subbatch_requests.labels(model, group).set(0)
        for mode in RECORDED_MODES:
            for metric in (self.steps, self.output_tokens, self.step_seconds, self.verify_seconds, self.prefill_tokens,
                           self.prefill_seconds):
                metric.labels(model, mode)
        for mode in DRAFTING_MODES:
            for metric in (self.draft_steps, self.drafts, self.draft_tokens, self.accepted_tokens, self.draft_seconds,
                           self.wait_seconds, self.idle_seconds, self.subbatch_size):
                metric.labels(model, mode)
            if mode == "lookahead":
                for metric in (self.branch_hits, self.branch_misses, self.branches_drafted):
                    metric.labels(model, mode)
                for after in ("full", "reject"):
                    for covered in ("true", "false"):
                        self.bonus_outcomes.labels(model, mode, after, covered)
            for position in range(max_positions):
                self.drafted_per_position.labels(model, mode, str(position))
                self.accepted_per_position.labels(model, mode, str(position))

    def start_after(self, step: int) -> None:
        """Count only steps after this one (the exporter's start)."""
        self.last_step = step

    def ingest(self, records: Iterable[StepRecord]) -> int:
        """Count records newer than the last one seen (older ones are ignored); returns how many were counted."""
        counted = 0
        model = self.model
        last = None
        for record in sorted(records, key=lambda r: r.step):
            if self.last_step is not None and record.step <= self.last_step:
                continue
            if self.last_step is not None and record.step > self.last_step + 1:
                self.records_missed.labels(model).inc(record.step - self.last_step - 1)
            self.last_step = record.step
            last = record
            counted += 1
            mode = record.mode
            self.steps.labels(model, mode).inc()
            self.output_tokens.labels(model, mode).inc(record.num_output_tokens)
            self.step_seconds.labels(model, mode).observe(record.step_seconds)
            self.verify_seconds.labels(model, mode).observe(record.verify_seconds)
            prefill = prefill_tokens(record)
            if prefill and record.num_scheduled_tokens > 0:
                self.prefill_tokens.labels(model, mode).inc(prefill)
                self.prefill_seconds.labels(model, mode).inc(
                    record.step_seconds * prefill / record.num_scheduled_tokens)
            # drafted_per_position[0] counts the requests that carried at least one draft token: the engine's own
            # denominator of mean accepted length (EngineTotals.mean_accepted_length).
            drafts = record.drafted_per_position[0] if record.drafted_per_position else 0
            if drafts:
                self.draft_steps.labels(model, mode).inc()
                self.drafts.labels(model, mode).inc(drafts)
                self.draft_tokens.labels(model, mode).inc(record.num_draft_tokens)
                self.accepted_tokens.labels(model, mode).inc(record.num_accepted_tokens)
                for position, count in enumerate(record.drafted_per_position):
                    self.drafted_per_position.labels(model, mode, str(position)).inc(count)
                for position, count in enumerate(record.accepted_per_position):
                    self.accepted_per_position.labels(model, mode, str(position)).inc(count)
            if record.num_branch_hits or record.num_branch_misses or record.num_branches_drafted:
                self.branch_hits.labels(model, mode).inc(record.num_branch_hits)
                self.branch_misses.labels(model, mode).inc(record.num_branch_misses)
                self.branches_drafted.labels(model, mode).inc(record.num_branches_drafted)
            for after, total, covered in (("full", record.num_bonus_after_full, record.num_bonus_covered_after_full),
                                          ("reject", record.num_bonus_after_reject,
                                           record.num_bonus_covered_after_reject)):
                if total:
                    self.bonus_outcomes.labels(model, mode, after, "true").inc(covered)
                    self.bonus_outcomes.labels(model, mode, after, "false").inc(total - covered)
            # Draft, wait and idle time are observed on every step that verified a sub-batch (and on any other step
            # that has some), so their histogram sums equal the engine's totals and overlap is exact in PromQL.
            verified = record.verified_group is not None
            if verified or record.draft_seconds > 0:
                self.draft_seconds.labels(model, mode).observe(record.draft_seconds)
            if verified or record.wait_seconds > 0:
                self.wait_seconds.labels(model, mode).observe(record.wait_seconds)
            if verified or record.drafter_idle_seconds > 0:
                self.idle_seconds.labels(model, mode).observe(record.drafter_idle_seconds)
            if record.verified_group is not None:
                self.subbatch_size.labels(model, mode).observe(record.group_sizes[record.verified_group])
        if last is not None:
            for group, size in enumerate(last.group_sizes):
                self.subbatch_requests.labels(model, str(group)).set(size)
        return counted


class RequestMetrics:
    """Per-request latency and outcome, observed on the Generate streams of both APIs (`protocol`: grpc or http)."""

    def __init__(self, registry: CollectorRegistry | None, model: str) -> None:
        self.model = model
        labels = ["model", "protocol"]
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "From the request's arrival at the server to its first generated token.", labels,
                              buckets=TTFT_BUCKETS, registry=registry)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "Per request: (last token time - first token time) / (output tokens - 1).", labels,
                              buckets=TPOT_BUCKETS, registry=registry)
        self.e2e = Histogram(f"{PREFIX}_request_duration_seconds",
                             "From the request's arrival at the server to its end.", labels,
                             buckets=E2E_BUCKETS, registry=registry)
        self.finished = Counter(f"{PREFIX}_requests_finished",
                                "Requests ended, by finish reason (stop, length, abort: aborted by the client or a "
                                "deadline, error: the engine failed).", [*labels, "finish_reason"], registry=registry)
        self.aborted = Counter(f"{PREFIX}_requests_aborted", "Requests aborted before they finished (client cancel, "
                                                             "deadline, drain).", labels, registry=registry)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of admitted requests.", labels,
                                     registry=registry)
        self.streamed_tokens = Counter(f"{PREFIX}_streamed_tokens", "Generated tokens streamed to clients (every "
                                                                    "mode).", labels, registry=registry)
        for protocol in PROTOCOLS:
            for metric in (self.ttft, self.tpot, self.e2e, self.aborted, self.prompt_tokens, self.streamed_tokens):
                metric.labels(model, protocol)
            for reason in ("stop", "length", "abort", "error"):
                self.finished.labels(model, protocol, reason)

    def record(self, outcome: RequestOutcome, protocol: str = "grpc") -> None:
        """Count one ended request (pure apart from the metric objects)."""
        model = self.model
        self.finished.labels(model, protocol, outcome.finish_reason).inc()
        if outcome.finish_reason == "abort":
            self.aborted.labels(model, protocol).inc()
        self.e2e.labels(model, protocol).observe(outcome.duration_seconds)
        if outcome.first_token_seconds is not None:
            self.ttft.labels(model, protocol).observe(outcome.first_token_seconds)
        tpot = outcome.time_per_output_token_seconds
        if tpot is not None:
            self.tpot.labels(model, protocol).observe(tpot)

    async def observe(self, stream: AsyncIterator[OutputDelta], num_prompt_tokens: int,
                      protocol: str = "grpc") -> AsyncGenerator[OutputDelta, None]:
        """Pass a request's deltas through, timing them. Closing this iterator closes (and so aborts) `stream`."""
        self.prompt_tokens.labels(self.model, protocol).inc(num_prompt_tokens)
        streamed = self.streamed_tokens.labels(self.model, protocol)
        timer = RequestTimer(time.perf_counter())
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for delta in stream:
                    timer.delta(time.perf_counter(), len(delta.token_ids), delta.finish_reason)
                    if delta.token_ids:
                        streamed.inc(len(delta.token_ids))
                    yield delta
        except (EngineDeadError, ValueError):
            timer.error = True
            raise
        finally:
            self.record(timer.outcome(time.perf_counter()), protocol)


@dataclass(frozen=True)
class RequestOutcome:
    finish_reason: str
    duration_seconds: float
    first_token_seconds: float | None
    num_output_tokens: int
    last_token_seconds: float | None

    @property
    def time_per_output_token_seconds(self) -> float | None:
        if self.first_token_seconds is None or self.last_token_seconds is None or self.num_output_tokens < 2:
            return None
        return (self.last_token_seconds - self.first_token_seconds) / (self.num_output_tokens - 1)


@dataclass
class RequestTimer:
    """One request's timeline (seconds relative to its arrival); pure, so its arithmetic is tested directly."""

    started: float
    first_token: float | None = None
    last_token: float | None = None
    num_output_tokens: int = 0
    finish_reason: str | None = None
    error: bool = False

    def delta(self, now: float, num_tokens: int, finish_reason: str | None) -> None:
        if num_tokens:
            if self.first_token is None:
                self.first_token = now
            self.last_token = now
            self.num_output_tokens += num_tokens
        if finish_reason is not None:
            self.finish_reason = finish_reason

    def outcome(self, now: float) -> RequestOutcome:
        # No finish reason and no error: the stream was closed early (client cancel, deadline, drain), which aborts
        # the request in the engine.
        reason = "error" if self.error else (self.finish_reason or "abort")
        return RequestOutcome(
            finish_reason=reason,
            duration_seconds=now - self.started,
            first_token_seconds=None if self.first_token is None else self.first_token - self.started,
            num_output_tokens=self.num_output_tokens,
            last_token_seconds=None if self.last_token is None else self.last_token - self.started,
        )


def vllm_metric_families(source: CollectorRegistry = REGISTRY, prefix: str = "vllm:") -> list[Metric]:
    """vLLM's own metric families as its engine registered them in this process's global registry."""
    return [family for family in source.collect() if family.name.startswith(prefix)]


def poll_engine(engine: Engine, since_step: int,
                vllm_metrics: bool) -> tuple[list[StepRecord], EngineSnapshot, list[Metric] | None]:
    """One metrics poll, run in the engine's process between steps (`call`): new step records, a snapshot and, for
    an engine in its own process, vLLM's metric families there (they pickle: plain names and samples)."""
    return engine.step_records(since_step), read_snapshot(engine), vllm_metric_families() if vllm_metrics else None


class VllmMetricsBridge(Collector):
    """Re-exposes vLLM's own `vllm:*` metrics on this server's registry, so one scrape carries both: read live from
    prometheus_client's global registry (where vLLM's in-process engine registers them), or, with the engine in a
    process of its own, the families its last poll brought (`families`)."""

    def __init__(self, source: CollectorRegistry = REGISTRY, prefix: str = "vllm:") -> None:
        self.source = source
        self.prefix = prefix
        self.families: list[Metric] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.families is not None:
            yield from self.families
            return
        yield from vllm_metric_families(self.source, self.prefix)

    def describe(self) -> Iterable[Metric]:
        return []


@dataclass
class EngineExporter:
    """The engine replica's metric set in one registry, kept current by `run` (a task on the server's loop)."""

    registry: CollectorRegistry
    model: str
    max_positions: int = 0
    interval_seconds: float = 1.0
    expose_vllm: bool = True
    steps: StepMetrics = field(init=False)
    requests: RequestMetrics = field(init=False)
    snapshots: SnapshotCollector = field(init=False)
    vllm_bridge: VllmMetricsBridge | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.steps = StepMetrics(self.registry, self.model, self.max_positions)
        self.requests = RequestMetrics(self.registry, self.model)
        self.snapshots = SnapshotCollector(self.model)
        self.registry.register(self.snapshots)
        if self.expose_vllm:
            self.vllm_bridge = VllmMetricsBridge()
            self.registry.register(self.vllm_bridge)

    async def start(self, engine: ServingEngine) -> None:
        """Count from now on: steps the engine made before this are not this exporter's."""
        records = await engine.call(calls.step_records)
        self.steps.start_after(max((r.step for r in records), default=0))
        await self.poll(engine)

    async def poll(self, engine: ServingEngine) -> None:
        since = self.steps.last_step if self.steps.last_step is not None else -1
        # vLLM's own metrics live in the engine's process: from an engine process they come with each poll.
        records, snapshot, vllm_families = await engine.call(partial(poll_engine, since_step=since,
                                                                     vllm_metrics=not engine.in_process))
        self.steps.ingest(records)
        self.snapshots.snapshot = snapshot
        if self.vllm_bridge is not None and vllm_families is not None:
            self.vllm_bridge.families = vllm_families

    async def run(self, engine: ServingEngine) -> None:
        while True:
            try:
                await self.poll(engine)
            except EngineDeadError:
                return
            except Exception:  # a metrics failure must never take the server down
                log.exception("engine metrics poll failed")
            await asyncio.sleep(self.interval_seconds)
