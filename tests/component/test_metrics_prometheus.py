"""The metrics end to end with a real Prometheus (Debian's package): the engine server over the shared PSD engine and
a gateway export, Prometheus scrapes both every second with the rules loaded, load runs through the gateway, then
every metric, dashboard query and rule is checked against what Prometheus holds.

One module-scoped run (~20 s beyond the shared engine's start) feeds every test here. Set MINEDRAFT_WRITE_PREVIEWS=1
to also render each dashboard's panels from this run's data to docs/dashboards/*.png (docs/operations.md's images).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from minedraft.api import pb, pb_grpc
from minedraft.engine.async_engine import AsyncEngine
from minedraft.engine.control.stats import EngineTotals
from minedraft.engine.settings import Mode
from minedraft.gateway.app import Gateway, GatewayConfig
from minedraft.server.app import EngineServer
from tests.metrics_support import (
    RULES_FILE,
    Prometheus,
    alert_rules,
    dashboard_queries,
    drafter_service_registry,
    exported_sample_names,
    full_registry,
    recording_rules,
    substitute,
)

from .grpc_helpers import wait_for

pytestmark = pytest.mark.engine

PREVIEW_DIR = Path(__file__).resolve().parents[2] / "docs" / "dashboards"
WRITE_PREVIEWS = bool(os.environ.get("MINEDRAFT_WRITE_PREVIEWS"))
# Rounds of load (12 completed streams, one cancelled, one invalid each): one for the checks (~2 s here); more, with
# pauses, when rendering the previews, so their curves have a shape.
ROUNDS = 8 if WRITE_PREVIEWS else 1
PAUSE_SECONDS = 2.0
NUM_REQUESTS = 12
CONCURRENCY = 6
MAX_TOKENS = 40


# Grafana unit ids as axis labels.
UNIT_LABELS = {"percentunit": "ratio (1 = 100%)", "s": "seconds", "reqps": "per second", "short": "count",
               "suffix: tok/s": "tokens/s"}


@dataclass
class Run:
    prometheus: Prometheus
    engine_metrics_url: str
    gateway_metrics_url: str
    # The engine's own counters over the run (after - before), the reference for Prometheus' figures.
    totals: EngineTotals
    load_started: float
    load_finished: float
    codes: dict[str, int]
    # vLLM's own speculative-decoding counters over the run (draft tokens, accepted tokens), from its registry.
    vllm_spec_decode: tuple[float, float]


def vllm_spec_decode_counts() -> tuple[float, float]:
    """Sums of vLLM's own vllm:spec_decode_num_{draft,accepted}_tokens_total in prometheus_client's global registry
    (where vLLM's in-process engine registers them)."""
    from prometheus_client import REGISTRY

    totals = {"vllm:spec_decode_num_draft_tokens": 0.0, "vllm:spec_decode_num_accepted_tokens": 0.0}
    for family in REGISTRY.collect():
        if family.name in totals:
            totals[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals["vllm:spec_decode_num_draft_tokens"], totals["vllm:spec_decode_num_accepted_tokens"]


async def poll(predicate: Any, timeout_seconds: float, what: str, interval: float = 0.25) -> Any:
    """Poll predicate() (sync, quick) until it returns something truthy; the event loop keeps running meanwhile."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_seconds}s waiting for {what}")
        await asyncio.sleep(interval)


def prompts(n: int) -> list[str]:
    base = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):",
            "for i in range(10):\n    print(", "with open(path) as f:\n    data = "]
    return [base[i % len(base)] + " " * (i // len(base)) for i in range(n)]


async def drive_load(target: str) -> dict[str, int]:
    """Streams through the gateway: completed ones, one the client cancels, one invalid; returns status counts."""
    codes: dict[str, int] = {}
    semaphore = asyncio.Semaphore(CONCURRENCY)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def generate(text: str) -> None:
            async with semaphore:
                request = pb.GenerateRequest(prompt=text, sampling_params=pb.SamplingParams(max_tokens=MAX_TOKENS))
                try:
                    async for _ in stub.Generate(request, timeout=120):
                        pass
                    codes["OK"] = codes.get("OK", 0) + 1
                except grpc.aio.AioRpcError as exc:
                    codes[exc.code().name] = codes.get(exc.code().name, 0) + 1

        async def cancelled() -> None:
            call = stub.Generate(pb.GenerateRequest(prompt="def main():", sampling_params=pb.SamplingParams(
                max_tokens=400)))
            async for _ in call:
                break
            call.cancel()

        async def invalid() -> None:
            try:
                async for _ in stub.Generate(pb.GenerateRequest(prompt="")):
                    pass
            except grpc.aio.AioRpcError as exc:
                assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT

        await asyncio.gather(*(generate(t) for t in prompts(NUM_REQUESTS)), cancelled(), invalid())
    return codes


@pytest.fixture(scope="module")
async def run(psd_engine, tmp_path_factory):
    psd_engine.set_mode(Mode.PSD, 3, 0)
    assert psd_engine.wait_for_drafter(300)
    directory = tmp_path_factory.mktemp("prometheus")
    engine = AsyncEngine(psd_engine)
    engine_registry, gateway_registry = CollectorRegistry(), CollectorRegistry()
    engine_http, _ = start_http_server(0, addr="127.0.0.1", registry=engine_registry)
    gateway_http, _ = start_http_server(0, addr="127.0.0.1", registry=gateway_registry)
    # A drafter pool's metrics (the dashboard's drafter-pool row), from a real service core that drafted one job.
    drafter_http, _ = start_http_server(0, addr="127.0.0.1", registry=drafter_service_registry())
    server = EngineServer("replica-metrics", engine_registry, metrics_interval_seconds=0.2)
    await server.start()
    await server.attach(engine)
    gateway = Gateway(GatewayConfig(health_retry_seconds=0.05), gateway_registry)
    await gateway.start()
    gateway.set_engines([f"127.0.0.1:{server.port}"])
    prometheus = Prometheus(directory, {"minedraft-engine": f"127.0.0.1:{engine_http.server_port}",
                                        "minedraft-gateway": f"127.0.0.1:{gateway_http.server_port}",
                                        "minedraft-drafter": f"127.0.0.1:{drafter_http.server_port}"}, [RULES_FILE])
    try:
        await wait_for(lambda: any(e.healthy for e in gateway.endpoints), what="engine healthy at the gateway")
        await asyncio.to_thread(prometheus.wait_ready)
        # Every target scraped, with the zero-valued series in place before any load (so rate() sees every increase).
        await poll(lambda: prometheus.value('count(up == 1)') == 3
                   and prometheus.query("minedraft_engine_draft_tokens_total")
                   and prometheus.query("minedraft_gateway_streams_started_total"), 30, "first scrapes")
        before = await engine.call(lambda e: e.totals())
        vllm_before = await engine.call(lambda e: vllm_spec_decode_counts())
        load_started = time.time()
        codes: dict[str, int] = {}
        for round_index in range(ROUNDS):
            if round_index:
                await asyncio.sleep(PAUSE_SECONDS)
            for code, count in (await drive_load(f"127.0.0.1:{gateway.port}")).items():
                codes[code] = codes.get(code, 0) + count
        await poll(lambda: not psd_engine.has_unfinished_requests(), 60, "the engine to go idle")
        load_finished = time.time()
        totals = await engine.call(lambda e: e.totals()) - before
        vllm_after = await engine.call(lambda e: vllm_spec_decode_counts())
        assert totals.draft_tokens > 0, "psd drafted nothing"
        # Prometheus has the final counts once its latest scrape matches the engine's own totals.
        await poll(lambda: prometheus.value("sum(minedraft_engine_draft_tokens_total)") == totals.draft_tokens
                   and prometheus.value("sum(minedraft_engine_requests_finished_total)") == ROUNDS * (NUM_REQUESTS + 1)
                   and prometheus.value('sum(minedraft_gateway_streams_finished_total)') == ROUNDS * (NUM_REQUESTS + 2),
                   30, "the final counts in Prometheus")
        # Recording rules are evaluated on their own clock (every second, each group at its own offset): wait until
        # every one has recorded a series, so a loaded machine cannot make the checks below race the evaluator.
        # A rule that never records is left for test_rules_load_and_evaluate to name.
        with contextlib.suppress(AssertionError):
            await poll(lambda: all(prometheus.query(rule["record"]) for rule in recording_rules()), 30,
                       "every recording rule to record a series")
        yield Run(prometheus, f"http://127.0.0.1:{engine_http.server_port}/metrics",
                  f"http://127.0.0.1:{gateway_http.server_port}/metrics", totals, load_started, load_finished, codes,
                  (vllm_after[0] - vllm_before[0], vllm_after[1] - vllm_before[1]))
    finally:
        prometheus.stop()
        await gateway.stop()
        await server.stop()
        await engine.shutdown(shutdown_engine=False)
        engine_http.shutdown()
        gateway_http.shutdown()
        drafter_http.shutdown()
        psd_engine.set_mode(Mode.PSD, 3, 0)


def scraped_types(url: str) -> dict[str, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    types = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            types[sample.name] = family.type
    return types


def test_every_metric_is_scraped_with_its_type(run):
    """Every metric the code defines is in the live scrape with the same type, and Prometheus stored it."""
    expected = exported_sample_names(full_registry())
    scraped = scraped_types(run.engine_metrics_url) | scraped_types(run.gateway_metrics_url)
    missing = sorted(set(expected) - set(scraped))
    assert not missing, f"not in the scrape: {missing}"
    wrong = {name: (kind, scraped[name]) for name, kind in expected.items() if scraped[name] != kind}
    assert not wrong, f"types differ (expected, scraped): {wrong}"
    # What Prometheus itself recorded from the scrape (metadata API: family name -> type).
    metadata = run.prometheus.get("/api/v1/metadata")["data"]
    families = {"minedraft_engine_drafts": "counter", "minedraft_engine_verify_seconds": "histogram",
                "minedraft_engine_running_requests": "gauge", "minedraft_gateway_streams_finished": "counter",
                "minedraft_gateway_route_seconds": "histogram", "minedraft_gateway_streams_in_flight": "gauge",
                "minedraft_engine_predicted_best_output_tokens_per_second": "gauge"}
    for family, kind in families.items():
        # The family's name in Prometheus' metadata: with _total for counters in the classic text format.
        entry = metadata.get(family) or metadata.get(f"{family}_total")
        assert entry is not None and entry[0]["type"] == kind, (family, entry)
    stored = {s["metric"]["__name__"] for s in run.prometheus.query('{__name__=~"minedraft_.+"}')}
    assert set(expected) <= stored, sorted(set(expected) - stored)


def test_vllm_own_metrics_are_exposed(run):
    """vLLM's in-process engine registers its `vllm:*` metrics in prometheus_client's global registry; the server
    re-exposes them beside ours."""
    names = set(scraped_types(run.engine_metrics_url))
    assert "vllm:num_requests_running" in names
    assert any(n.startswith("vllm:generation_tokens") for n in names)
    families = sorted({n.removesuffix("_total").removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
                       for n in names if n.startswith("vllm:")})
    print(f"vLLM's own metrics ({len(families)}): {', '.join(families)}")


def test_our_counters_equal_vllms_own_spec_decode_counters(run):
    """vLLM counts the drafts it verifies too (vllm:spec_decode_*): ours, from the scheduler's step records, are
    exported unchanged and never exceed vLLM's (which include padding)."""
    drafted, accepted = run.vllm_spec_decode
    if drafted == 0:
        # vLLM re-registers its metrics for each engine it creates: with several engines in one test process the
        # global registry may hold another engine's (e.g. the ar engine's, which drafts nothing).
        pytest.skip("vLLM's global registry holds another engine's metrics in this process")
    value = run.prometheus.value
    assert value("sum(minedraft_engine_draft_tokens_total)") == run.totals.draft_tokens
    assert value("sum(minedraft_engine_accepted_tokens_total)") == run.totals.accepted_tokens
    # vLLM also counts the tokens that only pad drafts to k (one decode shape per step; ours leave them out), and a
    # pad token the target happens to accept: its counts bound ours from above.
    assert drafted >= run.totals.draft_tokens and accepted >= run.totals.accepted_tokens


def test_dashboard_expressions_return_series(run):
    failures = []
    for query in dashboard_queries():
        if "minedraft_operator_" in query.expr:
            # No operator runs here: its panels' names are checked against what it exports in
            # tests/unit/test_metrics.py; they must still parse.
            if run.prometheus.query_error(substitute(query.expr)) is not None:
                failures.append(f"{query.dashboard} / {query.panel}: does not parse: {query.expr}")
            continue
        expr = substitute(query.expr)
        error = run.prometheus.query_error(expr)
        if error is not None:
            failures.append(f"{query.dashboard} / {query.panel}: {expr}: {error}")
        elif not run.prometheus.query(expr):
            failures.append(f"{query.dashboard} / {query.panel}: no series: {expr}")
    assert not failures, "\n".join(failures)


def test_rules_load_and_evaluate(run):
    groups = run.prometheus.get("/api/v1/rules")["data"]["groups"]
    loaded = {rule["name"]: rule for group in groups for rule in group["rules"]}
    expected = [r.get("record") or r["alert"] for r in recording_rules() + alert_rules()]
    assert set(expected) <= set(loaded), "rules Prometheus did not load"
    unhealthy = {name: rule.get("lastError") for name, rule in loaded.items() if rule["health"] != "ok"}
    assert not unhealthy, unhealthy
    failures = []
    for rule in recording_rules():
        if run.prometheus.query_error(rule["expr"]) is not None:
            failures.append(f"{rule['record']}: does not evaluate")
        elif not run.prometheus.query(rule["record"]):
            failures.append(f"{rule['record']}: no series recorded")
    for rule in alert_rules():
        error = run.prometheus.query_error(rule["expr"])
        if error is not None:
            failures.append(f"{rule['alert']}: {error}")
    assert not failures, "\n".join(failures)


def test_healthy_run_fires_no_speculation_alerts(run):
    """Not a test of thresholds (some need minutes), but a guard: a drafter up with drafts flowing is not 'down'."""
    firing = [a["labels"]["alertname"] for a in run.prometheus.get("/api/v1/alerts")["data"]["alerts"]]
    assert "MineDraftDrafterDown" not in firing
    assert "MineDraftNoReadyEngines" not in firing


def test_prometheus_acceptance_rate_equals_the_engines_counters(run):
    prometheus, totals = run.prometheus, run.totals
    raw = prometheus.value("sum(minedraft_engine_accepted_tokens_total) / sum(minedraft_engine_draft_tokens_total)")
    assert raw == pytest.approx(totals.acceptance_rate, rel=1e-12)
    length = prometheus.value("1 + sum(minedraft_engine_accepted_tokens_total) / sum(minedraft_engine_drafts_total)")
    assert length == pytest.approx(totals.mean_accepted_length, rel=1e-12)
    # Overlap: the unclamped ratio first (a stronger check than two clamped zeros), then the clamped figure.
    wait_per_draft = prometheus.value("sum(minedraft_engine_verifier_wait_seconds_sum) / "
                                      "sum(minedraft_engine_draft_seconds_sum)")
    assert wait_per_draft == pytest.approx(totals.wait_seconds / totals.draft_seconds, rel=1e-9)
    overlap = prometheus.value("clamp(1 - sum(minedraft_engine_verifier_wait_seconds_sum) / "
                               "sum(minedraft_engine_draft_seconds_sum), 0, 1)")
    assert overlap == pytest.approx(totals.overlap_fraction, rel=1e-9, abs=1e-12)
    # The recording rule (a 1-minute rate of each counter; both extrapolated alike, so their ratio is exact) at an
    # evaluation after the final counts arrived, while the whole load is still inside its window.
    if time.time() - run.load_started > 55:
        pytest.skip("the load no longer fits the rule's 1-minute window (a slow machine)")
    finished_at = time.time()
    deadline = time.monotonic() + 10
    while True:
        result = prometheus.query("minedraft:engine_acceptance_rate:rate1m")
        stamp = prometheus.value("timestamp(minedraft:engine_acceptance_rate:rate1m)")
        if result and stamp is not None and stamp > finished_at:
            break
        assert time.monotonic() < deadline, "no evaluation of the recording rule after the load"
        time.sleep(0.2)
    assert len(result) == 1
    recorded = float(result[0]["value"][1])
    assert recorded == pytest.approx(totals.acceptance_rate, rel=1e-9)
    print(f"acceptance: engine {totals.acceptance_rate:.6f} ({totals.accepted_tokens}/{totals.draft_tokens}), "
          f"prometheus counters {raw:.6f}, recording rule {recorded:.6f}; overlap {overlap:.4f}")


def test_gateway_counts_streams_by_status(run):
    value = run.prometheus.value
    ok = run.codes.get("OK", 0)
    assert value('sum(minedraft_gateway_streams_finished_total{code="OK"})') == ok == ROUNDS * NUM_REQUESTS
    assert value('sum(minedraft_gateway_streams_finished_total{code="INVALID_ARGUMENT"})') == ROUNDS
    assert value('sum(minedraft_gateway_streams_finished_total{code="CANCELLED"})') == ROUNDS
    assert value("sum(minedraft_gateway_streams_started_total)") == ROUNDS * (NUM_REQUESTS + 2)
    assert value("sum(minedraft_gateway_streams_in_flight)") == 0
    # The engine saw each cancelled stream as an aborted request.
    assert value("sum(minedraft_engine_requests_aborted_total)") == ROUNDS
    assert value("sum(minedraft_engine_time_to_first_token_seconds_count)") == ROUNDS * (NUM_REQUESTS + 1)


@pytest.mark.skipif(not WRITE_PREVIEWS, reason="set MINEDRAFT_WRITE_PREVIEWS=1 to render")
def test_render_dashboard_previews(run):
    """Each dashboard's panels, from this run's data, as one PNG per dashboard (no Grafana can run here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    PREVIEW_DIR.mkdir(parents=True, exist_ok=True)
    start, end = run.load_started - 5, time.time()
    by_dashboard: dict[str, dict[str, list[Any]]] = {}
    for query in dashboard_queries():
        by_dashboard.setdefault(query.dashboard, {}).setdefault(query.panel, []).append(query)
    for dashboard, panels in by_dashboard.items():
        columns = 3
        rows = (len(panels) + columns - 1) // columns
        figure, axes = plt.subplots(rows, columns, figsize=(15, 3.2 * rows), squeeze=False)
        for ax, (title, queries) in zip(axes.flat, panels.items(), strict=False):
            for query in queries:
                for series in run.prometheus.query_range(substitute(query.expr), start, end, 1):
                    times = [float(t) - start for t, _ in series["values"]]
                    values = [float(v) for _, v in series["values"]]
                    legend = query.legend
                    for key, label in series["metric"].items():
                        legend = legend.replace("{{" + key + "}}", label)
                    ax.plot(times, values, label=legend[:40])
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("seconds", fontsize=7)
            ax.set_ylabel(UNIT_LABELS.get(queries[0].unit or "", queries[0].unit or ""), fontsize=7)
            ax.tick_params(labelsize=7)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=6, loc="best")
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        figure.suptitle(f"{dashboard} — panel queries from a test run (Prometheus query_range, 1 s step)")
        figure.tight_layout()
        figure.savefig(PREVIEW_DIR / dashboard.replace(".json", ".png"), dpi=80)
        plt.close(figure)
