"""The autoscaler's pure parts around the policy: reading Prometheus answers and scrapes, status.scaling, conditions,
and one evaluation with a fake source (no I/O)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from minedraft.operator import spec as s
from minedraft.operator import status
from minedraft.operator.autoscale import observe
from minedraft.operator.autoscale.loop import Autoscaler, _Memory, scaling_status
from minedraft.operator.autoscale.policy import Decision, Inputs


def sample(value: float, **labels: str) -> dict[str, Any]:
    return {"metric": labels, "value": [1000.0, str(value)]}


def test_observations_from_prometheus_answers() -> None:
    results = {
        "running": [sample(10, instance="a"), sample(6, instance="b")],
        "running_at": [sample(995.0), sample(990.0)],
        "waiting": [sample(4)], "output_tps": [sample(640)], "predicted_tps": [sample(700)],
        "acceptance": [sample(0.6)], "accepted_length": [sample(2.8)], "overlap": [sample(0.9)],
        "verify_seconds": [sample(0.02)], "draft_seconds": [sample("NaN")],  # type: ignore[arg-type]
        "modes": [sample(1, mode="psd"), sample(1, mode="ar")],
    }
    obs = observe.observations_from_prometheus(results, now_seconds=1000.0)
    assert obs.reporting_replicas == 2 and obs.running_requests == 16 and obs.waiting_requests == 4
    assert obs.age_seconds == 5.0 and obs.output_tokens_per_second == 640 and obs.predicted_tokens_per_second == 700
    assert obs.speculation.acceptance_rate == 0.6 and obs.speculation.draft_seconds_per_step is None  # NaN dropped
    assert obs.speculation.modes == ("ar", "psd")


def test_no_engine_series_is_metrics_unavailable() -> None:
    with pytest.raises(observe.MetricsUnavailable) as err:
        observe.observations_from_prometheus({"running": []}, 0.0)
    assert err.value.reason == "NoEngineMetrics"


def test_selector_matches_podmonitor_and_plain_jobs() -> None:
    sel = observe.selector("serving", "qwen-engine")
    assert 'namespace=~"serving|"' in sel and 'job=~"(.+/)?(qwen-engine|qwen)"' in sel


def exposition(running: float, streamed: float, accepted: float, drafted: float, drafts: float) -> str:
    registry = CollectorRegistry()
    Gauge("minedraft_engine_running_requests", "r", ["model"], registry=registry).labels("m").set(running)
    Gauge("minedraft_engine_waiting_requests", "w", ["model"], registry=registry).labels("m").set(1)
    Gauge("minedraft_engine_predicted_best_output_tokens_per_second", "p", ["model"],
          registry=registry).labels("m").set(running * 30)
    mode = Gauge("minedraft_engine_mode", "m", ["model", "mode"], registry=registry)
    mode.labels("m", "psd").set(1)
    mode.labels("m", "ar").set(0)
    for name, value in (("streamed_tokens", streamed), ("accepted_tokens", accepted), ("draft_tokens", drafted),
                        ("drafts", drafts), ("requests_finished", streamed / 100)):
        Counter(f"minedraft_engine_{name}", name, ["model"], registry=registry).labels("m").inc(value)
    return generate_latest(registry).decode()


def test_observations_from_two_scrapes() -> None:
    before = {"a:9400": observe.parse_exposition(exposition(8, 1000, 300, 600, 200), 100.0)}
    now = {"a:9400": observe.parse_exposition(exposition(8, 1400, 360, 690, 230), 110.0)}
    obs = observe.observations_from_scrapes(now, before)
    assert obs.running_requests == 8 and obs.waiting_requests == 1 and obs.predicted_tokens_per_second == 240
    assert obs.output_tokens_per_second == pytest.approx(40.0)
    assert obs.finished_requests_per_second == pytest.approx(0.4)
    assert obs.speculation.acceptance_rate == pytest.approx(60 / 90)
    assert obs.speculation.mean_accepted_length == pytest.approx(1 + 60 / 30)
    assert obs.speculation.modes == ("psd",)
    # First scrape: no rates yet, but gauges count.
    first = observe.observations_from_scrapes(now, {})
    assert first.output_tokens_per_second == 0.0 and first.finished_requests_per_second is None
    with pytest.raises(observe.MetricsUnavailable):
        observe.observations_from_scrapes({}, before)


def test_scaling_status_keeps_the_last_decisions() -> None:
    inputs = Inputs(100.0, 50.0, 5.0, "predicted", 10, 0, 3)
    scaling: dict[str, Any] | None = None
    for i in range(15):
        scaling = scaling_status(scaling, Decision(i, i + 1, f"scale up {i}", True, inputs), "ScaledUp", 1000.0 + i,
                                 None)
    assert scaling is not None
    assert [d["from"] for d in scaling["decisions"]] == list(range(5, 15))
    assert scaling["decisions"][-1]["inputs"]["capacity_source"] == "predicted"
    held = scaling_status(scaling, Decision(3, 3, "hold", True, inputs), "Steady", 2000.0, None)
    assert held["decisions"] == scaling["decisions"] and held["reason"] == "Steady"


def test_conditions_follow_the_last_evaluation() -> None:
    ready, metrics = status.autoscaling_conditions(
        {"metricsAvailable": False, "reason": "PrometheusUnreachable", "message": "connection refused"}, 3,
        "2026-01-01T00:00:00Z", [])
    assert (metrics["status"], metrics["reason"], metrics["observedGeneration"]) == ("False", "PrometheusUnreachable",
                                                                                     3)
    assert ready["status"] == "False" and "connection refused" in ready["message"]
    ready, metrics = status.autoscaling_conditions({"metricsAvailable": True, "reason": "Steady", "message": "m"}, 3,
                                                   "2026-01-01T00:00:00Z", [])
    assert metrics["status"] == "True" and ready["reason"] == "Steady"


def autoscaled_spec(**autoscaling: Any) -> s.MineDraftSpec:
    return s.parse_spec({
        "target": {"source": {"image": {"path": "/models/t"}}}, "draft": {"source": {"image": {"path": "/models/d"}}},
        "engine": {"maxNumSeqs": 32},
        "autoscaling": {"minReplicas": 1, "maxReplicas": 8, "intervalSeconds": 15, **autoscaling}})


def test_evaluation_without_prometheus_scrapes_the_engine_endpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    """No address anywhere: engine pods from EndpointSlices, scraped; their load decides."""
    asked: list[tuple[str, str]] = []

    async def addresses(namespace: str, service: str) -> list[str]:
        asked.append((namespace, service))
        return ["10.0.0.1", "10.0.0.2"]

    async def scrape(session: Any, addrs: list[str], at: float) -> dict[str, observe.Scrape]:
        assert addrs == ["10.0.0.1:9400", "10.0.0.2:9400"]
        return {a: observe.parse_exposition(exposition(32, 0, 0, 0, 0), at) for a in addrs}

    monkeypatch.setattr(observe, "scrape_engines", scrape)
    scaler = Autoscaler(None, addresses)
    meta = s.ObjectMeta("qwen", "serving", "uid")
    spec = autoscaled_spec()
    evaluation = asyncio.run(scaler.evaluate(None, spec, meta, None, 1000.0))
    assert asked == [("serving", "qwen-engine")]
    # 64 running + 2 waiting at 30 tok/s each on 1 replica (spec.replicas unset: min): scale up by the step limit.
    assert evaluation.decision.current == 1 and evaluation.decision.desired == 3
    assert evaluation.scaling["decisions"][0]["to"] == 3 and evaluation.speculation is None
    assert not scaler.due("serving", "qwen", 15, 1010.0) and scaler.due("serving", "qwen", 15, 1015.0)


def test_evaluation_with_prometheus_down_decides_nothing() -> None:
    async def addresses(namespace: str, service: str) -> list[str]:
        raise AssertionError("Prometheus is configured: no scraping")

    async def run() -> Any:
        import aiohttp

        scaler = Autoscaler("http://127.0.0.1:1", addresses)  # nothing listens on port 1
        async with aiohttp.ClientSession() as session:
            return await scaler.evaluate(session, autoscaled_spec(), s.ObjectMeta("q", "ns", "u"), None, 0.0)

    evaluation = asyncio.run(run())
    assert not evaluation.decision.changed and not evaluation.decision.metrics_available
    assert evaluation.scaling["reason"] == "PrometheusUnreachable" and evaluation.scaling["decisions"] == []


def test_gateway_waiting_gauge_is_read_from_an_exposition() -> None:
    registry = CollectorRegistry()
    Gauge("minedraft_gateway_streams_waiting", "waiting", registry=registry).set(3)
    assert observe.gateway_waiting_from_exposition(generate_latest(registry).decode()) == 3.0
    assert observe.gateway_waiting_from_exposition("") is None
    assert observe.gateway_waiting_query("ns", "q-gateway") == (
        'sum(minedraft_gateway_streams_waiting{namespace=~"ns|",job=~"(.+/)?(q-gateway|q)"})')


def test_at_zero_a_waiting_stream_scales_to_one_at_the_next_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    """minReplicas 0 and spec.replicas 0: no engine to observe; every tick is due and reads the gateway's waiting
    streams (scraped from the gateway pods without Prometheus); one waiting stream -> 1 replica at once."""
    asked: list[tuple[str, str]] = []
    waiting = [0.0]

    async def addresses(namespace: str, service: str) -> list[str]:
        asked.append((namespace, service))
        return ["10.0.0.9"]

    async def scrape(session: Any, addrs: list[str]) -> float | None:
        assert addrs == ["10.0.0.9:9401"]
        return waiting[0]

    monkeypatch.setattr(observe, "scrape_gateway_waiting", scrape)
    scaler = Autoscaler(None, addresses)
    meta = s.ObjectMeta("qwen", "serving", "uid")
    spec = autoscaled_spec(minReplicas=0, intervalSeconds=60)
    assert spec.desired_replicas == 0
    first = asyncio.run(scaler.evaluate(None, spec, meta, None, 1000.0))
    assert not first.decision.changed and first.decision.metrics_available
    assert asked == [("serving", "qwen-gateway")]
    # Due at the next tick, not an interval later.
    assert scaler.due("serving", "qwen", 60, 1005.0)
    waiting[0] = 2.0
    woken = asyncio.run(scaler.evaluate(None, spec, meta, first.scaling, 1005.0))
    assert woken.decision.current == 0 and woken.decision.desired == 1
    assert "streams waiting at the gateway" in woken.decision.reason
    assert woken.scaling["reason"] == "ScaledUp" and woken.scaling["decisions"][-1]["to"] == 1
    # Back on the interval once a replica is asked for.
    assert not scaler.due("serving", "qwen", 60, 1010.0)


def test_at_zero_with_prometheus_the_gateway_gauge_is_queried() -> None:
    """A real HTTP round trip to a Prometheus-shaped API on loopback answering the gateway query."""
    from aiohttp import web

    queries: list[str] = []

    async def query(request: web.Request) -> web.Response:
        queries.append(request.query["query"])
        return web.json_response({"status": "success", "data": {"resultType": "vector",
                                                                "result": [sample(1)]}})

    async def run() -> Any:
        import aiohttp

        app = web.Application()
        app.router.add_get("/api/v1/query", query)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async def no_scrape(namespace: str, service: str) -> list[str]:
                raise AssertionError("Prometheus is configured: no scraping")

            scaler = Autoscaler(f"http://127.0.0.1:{port}", no_scrape)
            spec = autoscaled_spec(minReplicas=0)
            async with aiohttp.ClientSession() as session:
                return await scaler.evaluate(session, spec, s.ObjectMeta("q", "ns", "u"), None, 0.0)
        finally:
            await runner.cleanup()

    evaluation = asyncio.run(run())
    assert evaluation.decision.desired == 1
    assert queries == [observe.gateway_waiting_query("ns", "q-gateway")]


def spec_with_replicas(replicas: int, **autoscaling: Any) -> s.MineDraftSpec:
    return s.parse_spec({
        "target": {"source": {"image": {"path": "/models/t"}}}, "draft": {"source": {"image": {"path": "/models/d"}}},
        "engine": {"maxNumSeqs": 32}, "replicas": replicas,
        "autoscaling": {"minReplicas": 1, "maxReplicas": 8, "intervalSeconds": 15, **autoscaling}})


def engine_exposition(running: float, waiting: float) -> str:
    registry = CollectorRegistry()
    Gauge("minedraft_engine_running_requests", "r", ["model"], registry=registry).labels("m").set(running)
    Gauge("minedraft_engine_waiting_requests", "w", ["model"], registry=registry).labels("m").set(waiting)
    Gauge("minedraft_engine_predicted_best_output_tokens_per_second", "p", ["model"],
          registry=registry).labels("m").set(running * 30)
    return generate_latest(registry).decode()


def test_a_growing_queue_is_evaluated_before_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path without Prometheus: each tick scrapes the engines' waiting requests; grown since the last
    evaluation -> evaluate now (not at the interval); unchanged -> nothing until the interval."""
    load = {"running": 16.0, "waiting": 0.0}
    scrapes: list[float] = []

    async def addresses(namespace: str, service: str) -> list[str]:
        assert service == "qwen-engine"
        return ["10.0.0.1"]

    async def scrape(session: Any, addrs: list[str], at: float) -> dict[str, observe.Scrape]:
        scrapes.append(at)
        return {a: observe.parse_exposition(engine_exposition(load["running"], load["waiting"]), at) for a in addrs}

    monkeypatch.setattr(observe, "scrape_engines", scrape)
    scaler = Autoscaler(None, addresses, tick_seconds=5.0)
    meta = s.ObjectMeta("qwen", "serving", "uid")
    spec = spec_with_replicas(2, intervalSeconds=60)
    assert spec.desired_replicas == 2

    def should(now: float) -> bool:
        return asyncio.run(scaler.should_evaluate(None, spec, meta, now))

    assert should(1000.0)  # never evaluated: due
    first = asyncio.run(scaler.evaluate(None, spec, meta, None, 1000.0))
    assert first.decision.metrics_available
    # Same load at the next ticks: no early evaluation (the check scraped, found nothing grown).
    before = len(scrapes)
    assert not should(1005.0) and not should(1010.0)
    assert len(scrapes) == before + 2
    # Within a tick of the last evaluation: not even a scrape.
    load["waiting"] = 12.0
    assert not should(1002.0) and len(scrapes) == before + 2
    # The queue grew: evaluated at this tick, 15 s after the last evaluation instead of 60.
    assert should(1015.0)
    grown = asyncio.run(scaler.evaluate(None, spec, meta, first.scaling, 1015.0))
    assert grown.observations is not None and grown.observations.waiting_requests == 12.0
    # The queue holds at 12: nothing grown since that evaluation, so no more early ones; the interval counts from it.
    assert not should(1020.0) and not should(1070.0) and should(1075.0)


def test_the_fast_path_with_prometheus_is_one_query_of_the_waiting_requests() -> None:
    """A real HTTP round trip: the per-tick check asks Prometheus one instant query, the engines' waiting sum."""
    from aiohttp import web

    queries: list[str] = []
    waiting = [0.0]

    async def query(request: web.Request) -> web.Response:
        queries.append(request.query["query"])
        return web.json_response({"status": "success", "data": {"resultType": "vector",
                                                                "result": [sample(waiting[0])]}})

    async def run() -> tuple[bool, bool]:
        import aiohttp

        app = web.Application()
        app.router.add_get("/api/v1/query", query)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async def no_scrape(namespace: str, service: str) -> list[str]:
                raise AssertionError("Prometheus is configured: no scraping")

            scaler = Autoscaler(f"http://127.0.0.1:{port}", no_scrape)
            spec = spec_with_replicas(2, intervalSeconds=60)
            meta = s.ObjectMeta("q", "ns", "u")
            async with aiohttp.ClientSession() as session:
                # As after an evaluation at t=0 that saw one waiting request.
                scaler._memory[("ns", "q")] = _Memory(last_evaluation_seconds=0.0, last_waiting=1.0)
                quiet = await scaler.should_evaluate(session, spec, meta, 5.0)
                waiting[0] = 3.0
                grown = await scaler.should_evaluate(session, spec, meta, 10.0)
            return quiet, grown
        finally:
            await runner.cleanup()

    quiet, grown = asyncio.run(run())
    assert not quiet and grown
    assert queries == [observe.PROMETHEUS_QUERIES["waiting"].format(sel=observe.selector("ns", "q-engine"))] * 2
