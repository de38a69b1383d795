"""Prometheus metrics of the gateway (`minedraft_gateway_*`): streams by status code, retries, admission, engines.

Stream outcomes and latencies are observed around the servicer's stream (`GatewayMetrics.stream`, a context manager
rather than a wrapping generator: every async-generator layer costs each forwarded token a few microseconds);
endpoint and admission state are read at scrape time from the live objects (`GatewayStateCollector`), so they
cannot drift from what routing sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from minedraft.gateway.policy import Admission, EndpointSet

PREFIX = "minedraft_gateway"

# The gateway's own work before an engine is called is sub-millisecond; first responses include the engine's
# prefill and queueing (seconds under load).
ROUTE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
FIRST_RESPONSE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Status codes the dashboards and alerts expect to see as series (at 0) before they first happen.
INITIAL_CODES = ("OK", "CANCELLED", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "UNAVAILABLE",
                 "UNAUTHENTICATED", "UNKNOWN", "INTERNAL")
PROTOCOLS = ("grpc", "http")

def outcome_code(error: BaseException | None, context_code: Any, deadline_passed: bool = False) -> str:
    """The gRPC status a stream ended with (pure): OK, the code it was ended with (a RouteError's, or the context's
    for an abort), DEADLINE_EXCEEDED or CANCELLED when the caller's deadline passed or the caller went away (the
    task is cancelled or the generator closed), UNKNOWN for anything else raised."""
    if error is None:
        return "OK"
    code = getattr(error, "code", None)
    if isinstance(code, grpc.StatusCode):  # RouteError
        return code.name
    if isinstance(error, grpc.aio.AbortError):
        return context_code.name if isinstance(context_code, grpc.StatusCode) else "UNKNOWN"
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return "DEADLINE_EXCEEDED" if deadline_passed else "CANCELLED"
    return "UNKNOWN"


class GatewayMetrics:
    """The gateway's counters and histograms. With registry=None they count but are not exported (tests, benches)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # protocol: "grpc" (the Generation service) or "http" (the OpenAI API); one stream family for both.
        self.started = Counter(f"{PREFIX}_streams_started", "Generate streams received.", ["protocol"],
                               registry=registry)
        self.finished = Counter(f"{PREFIX}_streams_finished", "Generate streams ended, by gRPC status code (an HTTP "
                                                              "stream's status maps to one).",
                                ["protocol", "code"], registry=registry)
        self.retries = Counter(f"{PREFIX}_retries", "Engine attempts beyond a stream's first (engine failures "
                                                    "before any token was streamed).", registry=registry)
        self.rejected = Counter(f"{PREFIX}_admission_rejected", "Streams refused with RESOURCE_EXHAUSTED because the "
                                                                "gateway was at its in-flight limit.",
                                registry=registry)
        self.credential_refusals = Counter(f"{PREFIX}_engine_credential_refused",
                                           "Calls an engine refused as UNAUTHENTICATED: the gateway's own credential "
                                           "(--engine-token-file) is not one it accepts; the engine is out of rotation "
                                           "until it does.", ["engine"], registry=registry)
        self.route_seconds = Histogram(f"{PREFIX}_route_seconds",
                                       "Latency the gateway adds before an engine is called: from a stream's arrival "
                                       "(auth, admission, picking) to the call of the engine, per attempt.",
                                       buckets=ROUTE_BUCKETS, registry=registry)
        self.first_response_seconds = Histogram(f"{PREFIX}_time_to_first_response_seconds",
                                                "From a stream's arrival to its first response forwarded (includes "
                                                "the engine's time to first token).", ["protocol"],
                                                buckets=FIRST_RESPONSE_BUCKETS, registry=registry)
        self.duration_seconds = Histogram(f"{PREFIX}_stream_duration_seconds", "From a stream's arrival to its end.",
                                          ["protocol"], buckets=DURATION_BUCKETS, registry=registry)
        for protocol in PROTOCOLS:
            self.started.labels(protocol)
            self.first_response_seconds.labels(protocol)
            self.duration_seconds.labels(protocol)
            for code in INITIAL_CODES:
                self.finished.labels(protocol, code)

    def credential_refused(self, engine: str) -> None:
        self.credential_refusals.labels(engine).inc()

    def engine_removed(self, engine: str) -> None:
        """The engine left the routing table: its series go (a counter that comes back starts again at 0, which
        Prometheus' rate() reads as a reset)."""
        with contextlib.suppress(KeyError):  # never refused: no series
            self.credential_refusals.remove(engine)

    def admission_rejected(self) -> None:
        self.rejected.inc()

    def engine_called(self, since_arrival_seconds: float, attempt: int) -> None:
        """An attempt (1 = first) called an engine `since_arrival_seconds` after the stream arrived."""
        self.route_seconds.observe(since_arrival_seconds)
        if attempt > 1:
            self.retries.inc()

    def stream(self, deadline: float | None = None, protocol: str = "grpc") -> StreamObservation:
        """Observe one stream: `with metrics.stream(deadline) as observed:` around it, `observed.responded()` at each
        response. Whatever the stream ends with (return, error, cancellation, the generator closed) is counted;
        `deadline` (event-loop time) tells an expired deadline from a caller's cancel."""
        return StreamObservation(self, deadline, protocol)

    def refused(self, code: grpc.StatusCode, protocol: str = "grpc") -> None:
        """A stream refused before it was routed (e.g. UNAUTHENTICATED)."""
        self.started.labels(protocol).inc()
        self.finished.labels(protocol, code.name).inc()


class StreamObservation:
    """One stream's count, status code, time to first response and duration (see GatewayMetrics.stream)."""

    __slots__ = ("_arrived", "_deadline", "_delivered", "_metrics", "_protocol", "_waiting_first")

    def __init__(self, metrics: GatewayMetrics, deadline: float | None, protocol: str = "grpc") -> None:
        self._metrics = metrics
        self._deadline = deadline
        self._protocol = protocol
        self._arrived = 0.0
        self._waiting_first = True
        # The final response (with its finish reason) was handed to the caller: the stream is complete, whatever
        # ends it now (a caller that closes as soon as it has read [DONE] is not a cancel).
        self._delivered = False

    def __enter__(self) -> StreamObservation:
        self._arrived = time.perf_counter()
        self._metrics.started.labels(self._protocol).inc()
        return self

    def responded(self) -> None:
        if self._waiting_first:
            self._metrics.first_response_seconds.labels(self._protocol).observe(time.perf_counter() - self._arrived)
            self._waiting_first = False

    def delivered(self) -> None:
        """The stream's final response is out."""
        self._delivered = True

    def __exit__(self, exc_type: type[BaseException] | None, error: BaseException | None, tb: Any) -> None:
        deadline_passed = self._deadline is not None and asyncio.get_running_loop().time() >= self._deadline
        if self._delivered and isinstance(error, asyncio.CancelledError | GeneratorExit):
            error = None  # complete: the caller went away after the end of its answer
        self._metrics.finished.labels(self._protocol, outcome_code(error, None, deadline_passed)).inc()
        self._metrics.duration_seconds.labels(self._protocol).observe(time.perf_counter() - self._arrived)


class GatewayStateCollector(Collector):
    """Gauges read at scrape time from the routing state: streams in flight, per-engine outstanding, endpoints."""

    def __init__(self, endpoints: EndpointSet, admission: Admission, waiting: Callable[[], int] = lambda: 0) -> None:
        self.endpoints = endpoints
        self.admission = admission
        self.waiting = waiting

    def collect(self) -> Iterable[Metric]:
        return gateway_state_families(list(self.endpoints), self.admission, time.monotonic(), self.waiting())

    def describe(self) -> Iterable[Metric]:
        return []


def gateway_state_families(endpoints: list[Any], admission: Admission, now_seconds: float,
                           num_waiting: int = 0) -> list[Metric]:
    """Pure: the gauges of one view of the routing state."""
    waiting = GaugeMetricFamily(f"{PREFIX}_streams_waiting", "Streams waiting for any engine to become ready (none "
                                                              "is): the scale-from-zero signal.")
    waiting.add_metric([], num_waiting)
    in_flight = GaugeMetricFamily(f"{PREFIX}_streams_in_flight", "Streams the gateway is serving now.")
    in_flight.add_metric([], admission.in_flight)
    limit = GaugeMetricFamily(f"{PREFIX}_streams_in_flight_limit", "In-flight streams past which new ones are "
                                                                   "refused.")
    limit.add_metric([], admission.max_in_flight)
    outstanding = GaugeMetricFamily(f"{PREFIX}_engine_outstanding_streams", "Streams open to each engine.",
                                    labels=["engine"])
    ready = GaugeMetricFamily(f"{PREFIX}_engine_ready", "1 when an engine is healthy and not cooling down after a "
                                                        "failure, else 0.", labels=["engine"])
    for endpoint in endpoints:
        outstanding.add_metric([endpoint.address], endpoint.outstanding)
        ready.add_metric([endpoint.address], 1.0 if endpoint.ready(now_seconds) else 0.0)
    known = GaugeMetricFamily(f"{PREFIX}_endpoints_known", "Engine endpoints discovered.")
    known.add_metric([], len(endpoints))
    num_ready = GaugeMetricFamily(f"{PREFIX}_endpoints_ready", "Engine endpoints healthy and routable now.")
    num_ready.add_metric([], sum(1 for e in endpoints if e.ready(now_seconds)))
    return [in_flight, limit, waiting, outstanding, ready, known, num_ready]
