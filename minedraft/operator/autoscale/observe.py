"""Where the autoscaler's observations come from: Prometheus's HTTP API (the recording rules), or, without a
Prometheus, the engine pods' own metrics endpoints scraped directly.

Both return `policy.Observations` or raise `MetricsUnavailable` with a reason for the MetricsAvailable condition.
The parsing of answers is pure (`observations_from_prometheus`, `observations_from_scrapes`) so it is tested
without I/O; the fetching is a thin layer over aiohttp.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from minedraft.operator.autoscale.drafter_pool import PoolObservation, observation_from_prometheus, pool_queries
from minedraft.operator.autoscale.policy import Observations, SpeculationFigures

QUERY_TIMEOUT_SECONDS = 5.0
SCRAPE_TIMEOUT_SECONDS = 5.0


class MetricsUnavailable(RuntimeError):
    """No usable observation; the message is the MetricsAvailable=False condition's."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def selector(namespace: str, engine_service: str) -> str:
    """Label matchers for one MineDraft's engines.

    With the Prometheus Operator's PodMonitor the job is "<namespace>/<monitor>"; with plain scrape configs it is
    whatever the job is named, conventionally the engine Service. A missing namespace label (Prometheus outside
    Kubernetes) matches too.
    """
    return f'namespace=~"{namespace}|",job=~"(.+/)?({engine_service}|{engine_service.removesuffix("-engine")})"'


# name -> PromQL; {sel} is the selector above. Sums/averages over this MineDraft's replicas.
PROMETHEUS_QUERIES: Mapping[str, str] = {
    "running": "minedraft_engine_running_requests{{{sel}}}",
    "running_at": "timestamp(minedraft_engine_running_requests{{{sel}}})",
    "waiting": "sum(minedraft_engine_waiting_requests{{{sel}}})",
    "output_tps": "sum(minedraft:engine_output_tokens_per_second:rate1m{{{sel}}})",
    "finished_rps": "sum(rate(minedraft_engine_requests_finished_total{{{sel}}}[1m]))",
    "predicted_tps": "sum(minedraft:engine_predicted_capacity_tokens_per_second:max{{{sel}}})",
    "acceptance": "avg(minedraft:engine_acceptance_rate:rate1m{{{sel}}})",
    "accepted_length": "avg(minedraft:engine_mean_accepted_length:rate1m{{{sel}}})",
    "overlap": "avg(minedraft:engine_overlap_fraction:rate1m{{{sel}}})",
    "verify_seconds": "avg(minedraft:engine_verify_seconds_per_step:rate1m{{{sel}}})",
    "draft_seconds": "avg(minedraft:engine_draft_seconds_per_step:rate1m{{{sel}}})",
    "modes": "minedraft_engine_mode{{{sel}}} == 1",
    # Prompts as load: the KV cache in use (now, and a minute's mean) and the replicas' time spent prefilling.
    "kv_usage": "avg(minedraft_engine_kv_cache_usage_ratio{{{sel}}})",
    "kv_usage_1m": "avg(avg_over_time(minedraft_engine_kv_cache_usage_ratio{{{sel}}}[1m]))",
    "prefill_seconds": "sum(rate(minedraft_engine_prefill_seconds_total{{{sel}}}[1m]))",
    "ttft_mean": "sum(rate(minedraft_engine_time_to_first_token_seconds_sum{{{sel}}}[1m])) / "
                 "sum(rate(minedraft_engine_time_to_first_token_seconds_count{{{sel}}}[1m]))",
}


def _scalar(result: Sequence[Mapping[str, Any]]) -> float | None:
    if not result:
        return None
    value = float(result[0]["value"][1])
    return value if math.isfinite(value) else None


def observations_from_prometheus(results: Mapping[str, Sequence[Mapping[str, Any]]], now_seconds: float
                                 ) -> Observations:
    """Observations from the instant-query results of PROMETHEUS_QUERIES (each a list of {metric, value})."""
    running = results.get("running") or []
    if not running:
        raise MetricsUnavailable("NoEngineMetrics", "Prometheus has no minedraft_engine_running_requests for this "
                                                    "MineDraft's engines")
    stamps = [float(r["value"][1]) for r in results.get("running_at") or []]
    age = now_seconds - max(stamps) if stamps else 0.0
    modes = sorted({str(r["metric"].get("mode")) for r in results.get("modes") or [] if r["metric"].get("mode")})
    return Observations(
        age_seconds=max(age, 0.0),
        reporting_replicas=len(running),
        running_requests=sum(float(r["value"][1]) for r in running),
        waiting_requests=_scalar(results.get("waiting") or []) or 0.0,
        output_tokens_per_second=_scalar(results.get("output_tps") or []) or 0.0,
        predicted_tokens_per_second=_scalar(results.get("predicted_tps") or []),
        finished_requests_per_second=_scalar(results.get("finished_rps") or []),
        speculation=SpeculationFigures(
            acceptance_rate=_scalar(results.get("acceptance") or []),
            mean_accepted_length=_scalar(results.get("accepted_length") or []),
            draft_seconds_per_step=_scalar(results.get("draft_seconds") or []),
            verify_seconds_per_step=_scalar(results.get("verify_seconds") or []),
            overlap_fraction=_scalar(results.get("overlap") or []),
            modes=tuple(modes)),
        kv_cache_usage=_scalar(results.get("kv_usage") or []),
        kv_cache_usage_1m=_scalar(results.get("kv_usage_1m") or []),
        prefill_seconds_per_second=_scalar(results.get("prefill_seconds") or []),
        mean_ttft_seconds=_scalar(results.get("ttft_mean") or []),
    )


async def prometheus_api(session: aiohttp.ClientSession, address: str, endpoint: str,
                         params: dict[str, str],
                         timeout_seconds: float = QUERY_TIMEOUT_SECONDS) -> list[dict[str, Any]]:
    """One Prometheus HTTP API call (`/api/v1/<endpoint>`): its result list, or MetricsUnavailable naming why."""
    async with session.get(address.rstrip("/") + f"/api/v1/{endpoint}", params=params,
                           timeout=aiohttp.ClientTimeout(total=timeout_seconds)) as response:
        body = await response.json(content_type=None)
        if response.status != 200 or body.get("status") != "success":
            raise MetricsUnavailable("QueryFailed", f"Prometheus at {address}: HTTP {response.status}: "
                                                    f"{str(body.get('error', ''))[:200]}")
        return list(body["data"]["result"])


async def query_prometheus(session: aiohttp.ClientSession, address: str, namespace: str, engine_service: str,
                           now_seconds: float) -> Observations:
    sel = selector(namespace, engine_service)
    names = list(PROMETHEUS_QUERIES)
    try:
        answers = await asyncio.gather(*(prometheus_api(session, address, "query", {
            "query": PROMETHEUS_QUERIES[n].format(sel=sel)}) for n in names))
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        raise MetricsUnavailable("PrometheusUnreachable", f"Prometheus at {address}: {exc or type(exc).__name__}"
                                 ) from exc
    return observations_from_prometheus(dict(zip(names, answers, strict=True)), now_seconds)


# -- direct scraping (no Prometheus) ------------------------------------------------------------------------------

COUNTERS = ("minedraft_engine_streamed_tokens", "minedraft_engine_accepted_tokens", "minedraft_engine_draft_tokens",
            "minedraft_engine_drafts", "minedraft_engine_requests_finished", "minedraft_engine_prefill_seconds")
KV_USAGE_METRIC = "minedraft_engine_kv_cache_usage_ratio"


@dataclass(frozen=True)
class Scrape:
    """One engine's exposition at a time: gauge values, counter totals, modes flagged 1."""

    at_seconds: float
    gauges: Mapping[str, float]
    counters: Mapping[str, float]
    modes: tuple[str, ...] = ()


def parse_exposition(text: str, at_seconds: float) -> Scrape:
    from prometheus_client.parser import text_string_to_metric_families

    gauges: dict[str, float] = {}
    counters: dict[str, float] = {}
    modes: list[str] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name == "minedraft_engine_mode":
                if sample.value == 1:
                    modes.append(sample.labels.get("mode", ""))
            elif family.type == "counter" and family.name in COUNTERS and sample.name.endswith("_total"):
                counters[family.name] = counters.get(family.name, 0.0) + sample.value
            elif family.type == "gauge" and family.name.startswith("minedraft_engine_"):
                gauges[family.name] = gauges.get(family.name, 0.0) + sample.value
    return Scrape(at_seconds, gauges, counters, tuple(modes))


def observations_from_scrapes(now: Mapping[str, Scrape], before: Mapping[str, Scrape]) -> Observations:
    """Observations from this scrape of each engine (by address) and the previous one (for rates)."""
    if not now:
        raise MetricsUnavailable("NoEngineMetrics", "no engine pod answered on its metrics port")
    rate_tokens = rate_finished = accepted = drafted = drafts = prefill = 0.0
    rated = False
    for address, scrape in now.items():
        prev = before.get(address)
        if prev is None or scrape.at_seconds <= prev.at_seconds:
            continue
        seconds = scrape.at_seconds - prev.at_seconds

        def delta(name: str, s: Scrape = scrape, p: Scrape = prev) -> float:
            return max(s.counters.get(name, 0.0) - p.counters.get(name, 0.0), 0.0)  # a restart resets counters

        rated = True
        rate_tokens += delta("minedraft_engine_streamed_tokens") / seconds
        rate_finished += delta("minedraft_engine_requests_finished") / seconds
        accepted += delta("minedraft_engine_accepted_tokens")
        drafted += delta("minedraft_engine_draft_tokens")
        drafts += delta("minedraft_engine_drafts")
        prefill += delta("minedraft_engine_prefill_seconds") / seconds
    predicted = [s.gauges["minedraft_engine_predicted_best_output_tokens_per_second"] for s in now.values()
                 if "minedraft_engine_predicted_best_output_tokens_per_second" in s.gauges]
    kv = [s.gauges[KV_USAGE_METRIC] for s in now.values() if KV_USAGE_METRIC in s.gauges]
    prefilling = any("minedraft_engine_prefill_seconds" in s.counters for s in now.values())
    return Observations(
        age_seconds=0.0, reporting_replicas=len(now),
        running_requests=sum(s.gauges.get("minedraft_engine_running_requests", 0.0) for s in now.values()),
        waiting_requests=sum(s.gauges.get("minedraft_engine_waiting_requests", 0.0) for s in now.values()),
        output_tokens_per_second=rate_tokens,
        predicted_tokens_per_second=sum(predicted) if predicted else None,
        finished_requests_per_second=rate_finished if rated else None,
        speculation=SpeculationFigures(
            acceptance_rate=accepted / drafted if drafted else None,
            mean_accepted_length=1.0 + accepted / drafts if drafts else None,
            modes=tuple(sorted({m for s in now.values() for m in s.modes}))),
        # Without Prometheus there is no minute's history of the gauge: the policy reads the instant's.
        kv_cache_usage=sum(kv) / len(kv) if kv else None,
        prefill_seconds_per_second=prefill if rated and prefilling else None,
    )


async def scrape_engines(session: aiohttp.ClientSession, addresses: Sequence[str], at_seconds: float
                         ) -> dict[str, Scrape]:
    """GET /metrics of every engine address (host:port); engines that do not answer are left out."""

    async def one(address: str) -> tuple[str, Scrape | None]:
        try:
            async with session.get(f"http://{address}/metrics",
                                   timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_SECONDS)) as response:
                if response.status != 200:
                    return address, None
                return address, parse_exposition(await response.text(), at_seconds)
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return address, None

    answers = await asyncio.gather(*(one(a) for a in addresses))
    return {address: scrape for address, scrape in answers if scrape is not None}


# -- the engines' waiting requests alone (the fast path's per-tick check) --------------------------------------

ENGINE_WAITING_METRIC = "minedraft_engine_waiting_requests"


async def query_engines_waiting(session: aiohttp.ClientSession, address: str, namespace: str,
                                engine_service: str) -> float | None:
    """One instant query: requests waiting at this MineDraft's engines, summed; None if no engine series."""
    query = PROMETHEUS_QUERIES["waiting"].format(sel=selector(namespace, engine_service))
    try:
        result = await prometheus_api(session, address, "query", {"query": query})
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        raise MetricsUnavailable("PrometheusUnreachable", f"Prometheus at {address}: {exc or type(exc).__name__}"
                                 ) from exc
    return _scalar(result)


# -- the gateway's waiting streams (scale from zero) ---------------------------------------------------------------

GATEWAY_WAITING_METRIC = "minedraft_gateway_streams_waiting"


def gateway_waiting_query(namespace: str, gateway_service: str) -> str:
    """The operator's PodMonitor scrapes engines and gateway under one job, "<namespace>/<MineDraft name>"; a plain
    scrape config conventionally names the job after the gateway Service. Both match."""
    name = gateway_service.removesuffix("-gateway")
    sel = f'namespace=~"{namespace}|",job=~"(.+/)?({gateway_service}|{name})"'
    return f"sum({GATEWAY_WAITING_METRIC}{{{sel}}})"


def gateway_waiting_from_prometheus(result: Sequence[Mapping[str, Any]]) -> float | None:
    """Streams waiting for an engine, summed over the gateway pods; None: no gateway series (not scraped yet, or a
    gateway without the gauge)."""
    return _scalar(result)


def gateway_waiting_from_exposition(text: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    values = [sample.value for family in text_string_to_metric_families(text) if family.name == GATEWAY_WAITING_METRIC
              for sample in family.samples if sample.name == GATEWAY_WAITING_METRIC]
    return sum(values) if values else None


async def query_gateway_waiting(session: aiohttp.ClientSession, address: str, namespace: str,
                                gateway_service: str) -> float | None:
    url = address.rstrip("/") + "/api/v1/query"
    try:
        async with session.get(url, params={"query": gateway_waiting_query(namespace, gateway_service)},
                               timeout=aiohttp.ClientTimeout(total=QUERY_TIMEOUT_SECONDS)) as response:
            body = await response.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        raise MetricsUnavailable("PrometheusUnreachable", f"Prometheus at {address}: {exc or type(exc).__name__}"
                                 ) from exc
    if response.status != 200 or body.get("status") != "success":
        raise MetricsUnavailable("QueryFailed", f"Prometheus at {address}: HTTP {response.status}: "
                                                f"{str(body.get('error', ''))[:200]}")
    return gateway_waiting_from_prometheus(body["data"]["result"])


async def scrape_gateway_waiting(session: aiohttp.ClientSession, addresses: Sequence[str]) -> float | None:
    """The gauge summed over the gateway pods that answer (host:port each); None if none answers with it."""

    async def one(address: str) -> float | None:
        try:
            async with session.get(f"http://{address}/metrics",
                                   timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_SECONDS)) as response:
                if response.status != 200:
                    return None
                return gateway_waiting_from_exposition(await response.text())
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None

    answers = [a for a in await asyncio.gather(*(one(a) for a in addresses)) if a is not None]
    return sum(answers) if answers else None


# -- the shared drafter pool -------------------------------------------------------------------------------------


async def query_drafter_pool(session: aiohttp.ClientSession, address: str, namespace: str, deployment: str
                             ) -> PoolObservation | None:
    """The pool's busy figures from Prometheus (drafter_pool.pool_queries); None when it has none yet."""
    queries = pool_queries(namespace, deployment)
    names = list(queries)
    try:
        answers = await asyncio.gather(*(prometheus_api(session, address, "query", {"query": queries[n]})
                                         for n in names))
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        raise MetricsUnavailable("PrometheusUnreachable", f"Prometheus at {address}: {exc or type(exc).__name__}"
                                 ) from exc
    return observation_from_prometheus(dict(zip(names, answers, strict=True)))
