"""Metrics without I/O: step records -> counters and histograms, snapshots -> gauges, request timing, gateway stream
outcomes; the dashboards and rules checked against what the code exports (promtool needs no server)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from dataclasses import replace

import grpc
import pytest
import yaml
from prometheus_client import CollectorRegistry

from minedraft.engine.control.stats import EngineTotals, StepRecord, summarize
from minedraft.engine.requests import OutputDelta
from minedraft.gateway.metrics import GatewayMetrics, gateway_state_families, outcome_code
from minedraft.gateway.policy import Admission, EndpointSet
from minedraft.server.metrics import (
    EngineSnapshot,
    RequestMetrics,
    RequestTimer,
    StepMetrics,
    snapshot_families,
)
from tests.metrics_support import (
    DASHBOARD_FILES,
    ROOT,
    RULES_FILE,
    alert_rules,
    dashboard_queries,
    drafter_registry,
    exported_sample_names,
    full_registry,
    metric_names,
    operator_registry,
    recording_rules,
    require_binary,
    sample_record,
)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    result = registry.get_sample_value(name, labels)
    assert result is not None, f"{name}{labels} not exported"
    return result


# -- engine: step records --------------------------------------------------------------------------------------


def varied_records() -> list[StepRecord]:
    records = []
    for step in range(1, 11):
        record = sample_record(step, mode="psd" if step % 3 else "sd", group=step % 2)
        record = replace(record, num_accepted_tokens=step % 4, accepted_per_position=(min(1, step % 4), 0, 0)[:3],
                         wait_seconds=0.002 * step, draft_seconds=0.01 + 0.001 * step, verify_seconds=0.003 * step)
        records.append(record)
    # A prefill-only step: nothing drafted or verified against drafts.
    records.append(replace(sample_record(11, group=None), num_draft_tokens=0, num_accepted_tokens=0,
                           num_requests_with_drafts=0, drafted_per_position=(), accepted_per_position=(),
                           wait_seconds=0.0, draft_seconds=0.0, drafter_idle_seconds=0.0))
    return records


def test_step_counters_equal_the_engines_own_totals():
    registry = CollectorRegistry()
    steps = StepMetrics(registry, "m", max_positions=3)
    records = varied_records()
    assert steps.ingest(records) == len(records)
    totals = EngineTotals()
    for r in records:
        totals = totals + EngineTotals(steps=1, draft_tokens=r.num_draft_tokens, accepted_tokens=r.num_accepted_tokens,
                                       output_tokens=r.num_output_tokens)

    def total(name: str) -> float:
        return sum(value(registry, name, model="m", mode=mode) for mode in ("psd", "sd"))

    assert total("minedraft_engine_steps_total") == len(records)
    assert total("minedraft_engine_draft_tokens_total") == totals.draft_tokens
    assert total("minedraft_engine_accepted_tokens_total") == totals.accepted_tokens
    assert total("minedraft_engine_output_tokens_total") == totals.output_tokens
    # The engine's headline figures, recomputed from the exported counters as the recording rules do.
    summary = summarize(records)
    acceptance = total("minedraft_engine_accepted_tokens_total") / total("minedraft_engine_draft_tokens_total")
    assert acceptance == pytest.approx(summary["acceptance_rate"], rel=1e-12)
    accepted_length = 1 + total("minedraft_engine_accepted_tokens_total") / total("minedraft_engine_drafts_total")
    assert accepted_length == pytest.approx(summary["mean_accepted_length"], rel=1e-12)
    overlap = 1 - total("minedraft_engine_verifier_wait_seconds_sum") / total("minedraft_engine_draft_seconds_sum")
    assert overlap == pytest.approx(summary["overlap_fraction"], rel=1e-9)
    # Steps that verified a sub-batch are all observed (the prefill-only step is not).
    assert total("minedraft_engine_draft_seconds_count") == 10
    assert total("minedraft_engine_draft_steps_total") == 10
    assert value(registry, "minedraft_engine_accepted_tokens_per_position_total", model="m", mode="psd",
                 position="0") == sum(r.accepted_per_position[0] for r in records if r.mode == "psd" and r.step <= 10)
    # The last step's sub-batch sizes.
    assert value(registry, "minedraft_engine_subbatch_requests", model="m", subbatch="0") == 3


def test_records_are_counted_once_and_gaps_are_reported():
    registry = CollectorRegistry()
    steps = StepMetrics(registry, "m")
    steps.start_after(4)
    assert steps.ingest([sample_record(s) for s in range(1, 7)]) == 2  # 5 and 6 only
    assert steps.ingest([sample_record(s) for s in range(1, 7)]) == 0  # the same poll again: nothing new
    assert value(registry, "minedraft_engine_steps_total", model="m", mode="psd") == 2
    assert steps.ingest([sample_record(9), sample_record(10)]) == 2
    assert value(registry, "minedraft_engine_step_records_missed_total", model="m") == 2  # 7 and 8 fell out
    assert value(registry, "minedraft_engine_steps_total", model="m", mode="psd") == 4


def test_prefill_tokens_and_seconds_of_steps():
    """A decode-only step adds nothing; a step carrying a 2,048-token chunk beside 3 decoding requests with k=3
    drafts (3 + 9 tokens) counts 2,048 prompt tokens and 2048/2060 of its 0.5 s."""
    registry = CollectorRegistry()
    steps = StepMetrics(registry, "m")
    steps.ingest([sample_record(1), replace(sample_record(2), num_scheduled_tokens=2060, num_prefill_requests=1,
                                             step_seconds=0.5)])
    assert value(registry, "minedraft_engine_prefill_tokens_total", model="m", mode="psd") == 2048
    assert value(registry, "minedraft_engine_prefill_seconds_total", model="m", mode="psd") == pytest.approx(
        0.5 * 2048 / 2060)
    assert value(registry, "minedraft_engine_prefill_seconds_total", model="m", mode="ar") == 0


def test_series_exist_at_zero_before_the_first_step():
    """A counter first scraped non-zero loses that increase to rate(): every known series starts at 0."""
    registry = CollectorRegistry()
    StepMetrics(registry, "m", max_positions=4)
    for mode in ("psd", "sd"):
        assert value(registry, "minedraft_engine_draft_tokens_total", model="m", mode=mode) == 0
        assert value(registry, "minedraft_engine_accepted_tokens_per_position_total", model="m", mode=mode,
                     position="3") == 0
    assert value(registry, "minedraft_engine_steps_total", model="m", mode="ar") == 0


def test_lookahead_hit_rate_and_bonus_coverage_are_exported_as_the_engine_counts_them():
    registry = CollectorRegistry()
    steps = StepMetrics(registry, "m", max_positions=3)
    assert value(registry, "minedraft_engine_lookahead_branch_hits_total", model="m", mode="lookahead") == 0
    records = [replace(sample_record(1), mode="lookahead", num_branches_drafted=6, num_branch_hits=2,
                       num_branch_misses=1, num_bonus_after_full=2, num_bonus_covered_after_full=2,
                       num_bonus_after_reject=1, num_bonus_covered_after_reject=0),
               replace(sample_record(2), mode="lookahead", num_branches_drafted=5, num_branch_hits=3)]
    steps.ingest(records)
    totals = EngineTotals()
    for record in records:
        totals = totals + EngineTotals(branch_hits=record.num_branch_hits, branch_misses=record.num_branch_misses)

    def count(name: str, **labels: str) -> float:
        return value(registry, f"minedraft_engine_lookahead_{name}_total", model="m", mode="lookahead", **labels)

    hit_rate = count("branch_hits") / (count("branch_hits") + count("branch_misses"))
    assert hit_rate == pytest.approx(totals.branch_hit_rate) and hit_rate == 5 / 6
    assert count("branches_drafted") == 11
    assert count("bonus_outcomes", after="full", covered="true") == 2
    assert count("bonus_outcomes", after="reject", covered="false") == 1
    assert value(registry, "minedraft_engine_accepted_tokens_per_position_total", model="m", mode="lookahead",
                 position="0") == sum(r.accepted_per_position[0] for r in records)


# -- engine: snapshot gauges -----------------------------------------------------------------------------------


def test_snapshot_families():
    totals = EngineTotals(drafter_restarts=2, deadline_misses=5, preemptions=1, mode_switches=3)
    snapshot = EngineSnapshot(totals, running=6, waiting=2, kv_cache_usage=0.25, mode="sd", k=4,
                              configured_mode="auto", drafter_up=False,
                              predictions=(("ar", 0, 50.0), ("psd", 3, 120.0), ("sd", 3, 90.0)))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in snapshot_families(snapshot, "m") for s in family.samples}

    def get(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"model": "m", **labels}.items())))]

    assert get("minedraft_engine_drafter_restarts_total") == 2
    assert get("minedraft_engine_drafter_deadline_misses_total") == 5
    assert get("minedraft_engine_mode_switches_total") == 3
    assert get("minedraft_engine_running_requests") == 6
    assert get("minedraft_engine_waiting_requests") == 2
    assert get("minedraft_engine_mode", mode="sd") == 1
    assert get("minedraft_engine_mode", mode="psd") == 0
    assert get("minedraft_engine_num_speculative_tokens") == 4
    assert get("minedraft_engine_auto_mode") == 1
    assert get("minedraft_engine_drafter_up") == 0
    assert get("minedraft_engine_predicted_output_tokens_per_second", mode="psd", k="3") == 120
    assert get("minedraft_engine_predicted_best_output_tokens_per_second") == 120
    # An engine without a drafter (ar, vllm-sd) reports no drafter_up at all rather than a false "down".
    no_drafter = replace(snapshot, drafter_up=None, predictions=())
    names = {f.name for f in snapshot_families(no_drafter, "m")}
    assert "minedraft_engine_drafter_up" not in names
    assert "minedraft_engine_predicted_best_output_tokens_per_second" not in names


# -- engine: requests ------------------------------------------------------------------------------------------


def test_request_timer_arithmetic():
    timer = RequestTimer(started=10.0)
    timer.delta(10.0, 0, None)  # an empty delta does not count as the first token
    timer.delta(10.5, 1, None)
    timer.delta(10.9, 3, None)
    timer.delta(11.7, 2, "length")
    outcome = timer.outcome(12.0)
    assert outcome.finish_reason == "length"
    assert outcome.first_token_seconds == pytest.approx(0.5)
    assert outcome.duration_seconds == pytest.approx(2.0)
    assert outcome.num_output_tokens == 6
    assert outcome.time_per_output_token_seconds == pytest.approx((11.7 - 10.5) / 5)
    cancelled = RequestTimer(started=0.0)
    cancelled.delta(0.2, 1, None)
    assert cancelled.outcome(0.3).finish_reason == "abort"
    assert cancelled.outcome(0.3).time_per_output_token_seconds is None
    failed = RequestTimer(started=0.0, error=True)
    assert failed.outcome(1.0).finish_reason == "error"


async def test_request_observer_counts_and_closing_it_closes_the_engine_stream():
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry, "m")
    closed = asyncio.Event()

    async def engine_stream():
        try:
            yield OutputDelta("r", [1, 2], "ab")
            yield OutputDelta("r", [3], "c")
            yield OutputDelta("r", [4], "d", finish_reason="stop")
        finally:
            closed.set()

    tokens = [t async for d in metrics.observe(engine_stream(), 7) for t in d.token_ids]
    assert tokens == [1, 2, 3, 4]
    assert value(registry, "minedraft_engine_requests_finished_total", model="m", protocol="grpc",
                 finish_reason="stop") == 1
    assert value(registry, "minedraft_engine_streamed_tokens_total", model="m", protocol="grpc") == 4
    assert value(registry, "minedraft_engine_prompt_tokens_total", model="m", protocol="grpc") == 7
    assert value(registry, "minedraft_engine_time_to_first_token_seconds_count", model="m", protocol="grpc") == 1
    assert value(registry, "minedraft_engine_time_per_output_token_seconds_count", model="m", protocol="grpc") == 1

    closed.clear()
    observed = metrics.observe(engine_stream(), 7)
    await observed.__anext__()
    await observed.aclose()  # what the servicer does when the RPC is cancelled
    assert closed.is_set(), "the engine stream was not closed (its request would not be aborted)"
    assert value(registry, "minedraft_engine_requests_aborted_total", model="m", protocol="grpc") == 1
    assert value(registry, "minedraft_engine_requests_finished_total", model="m", protocol="grpc",
                 finish_reason="abort") == 1


# -- gateway ---------------------------------------------------------------------------------------------------


def test_outcome_codes():
    assert outcome_code(None, None) == "OK"
    assert outcome_code(grpc.aio.AbortError(), grpc.StatusCode.RESOURCE_EXHAUSTED) == "RESOURCE_EXHAUSTED"
    assert outcome_code(asyncio.CancelledError(), None) == "CANCELLED"
    assert outcome_code(GeneratorExit(), None) == "CANCELLED"
    assert outcome_code(asyncio.CancelledError(), None, deadline_passed=True) == "DEADLINE_EXCEEDED"
    assert outcome_code(RuntimeError(), None) == "UNKNOWN"


async def test_gateway_stream_observation():
    from minedraft.gateway.router import RouteError

    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)

    async def stream(items: list[int], fail: bool = False, deadline: float | None = None):
        with metrics.stream(deadline) as observed:
            for item in items:
                observed.responded()
                yield item
            if fail:
                raise RouteError(grpc.StatusCode.UNAVAILABLE, "engine failed")

    assert [x async for x in stream([1, 2])] == [1, 2]
    with pytest.raises(RouteError):
        _ = [x async for x in stream([], fail=True)]
    closed = stream([1, 2])
    await closed.__anext__()
    await closed.aclose()  # the caller went away mid-stream
    assert value(registry, "minedraft_gateway_streams_started_total", protocol="grpc") == 3
    assert value(registry, "minedraft_gateway_streams_finished_total", protocol="grpc", code="OK") == 1
    assert value(registry, "minedraft_gateway_streams_finished_total", protocol="grpc", code="UNAVAILABLE") == 1
    assert value(registry, "minedraft_gateway_streams_finished_total", protocol="grpc", code="CANCELLED") == 1
    # Only streams that responded have a time to first response, once each however many responses they sent.
    assert value(registry, "minedraft_gateway_time_to_first_response_seconds_count", protocol="grpc") == 2
    assert value(registry, "minedraft_gateway_stream_duration_seconds_count", protocol="grpc") == 3
    # Ended by the caller's deadline (already passed): DEADLINE_EXCEEDED, not CANCELLED.
    expired = stream([1, 2], deadline=asyncio.get_running_loop().time() - 1)
    await expired.__anext__()
    await expired.aclose()
    assert value(registry, "minedraft_gateway_streams_finished_total", protocol="grpc", code="DEADLINE_EXCEEDED") == 1
    assert value(registry, "minedraft_gateway_streams_finished_total", protocol="grpc", code="CANCELLED") == 1
    metrics.engine_called(0.001, 1)
    metrics.engine_called(0.002, 2)
    assert value(registry, "minedraft_gateway_retries_total") == 1
    assert value(registry, "minedraft_gateway_route_seconds_count") == 2


def test_gateway_state_gauges():
    endpoints = EndpointSet()
    endpoints.replace(["a:1", "b:2"])
    endpoints.set_healthy("a:1", True)
    endpoints.acquire("a:1")
    admission = Admission(8)
    admission.try_acquire()
    samples = {(s.name, tuple(s.labels.values())): s.value
               for f in gateway_state_families(list(endpoints), admission, 0.0) for s in f.samples}
    assert samples[("minedraft_gateway_streams_in_flight", ())] == 1
    assert samples[("minedraft_gateway_engine_outstanding_streams", ("a:1",))] == 1
    assert samples[("minedraft_gateway_engine_ready", ("b:2",))] == 0
    assert samples[("minedraft_gateway_endpoints_known", ())] == 2
    assert samples[("minedraft_gateway_endpoints_ready", ())] == 1


# -- dashboards and rules against the code ---------------------------------------------------------------------


def test_dashboards_and_rules_reference_only_what_the_code_exports():
    # Engines and gateways, and the shared drafter pool (its own pods and endpoint).
    exported = (exported_sample_names(full_registry()) | exported_sample_names(drafter_registry())
                | exported_sample_names(operator_registry()))
    recorded = {rule["record"] for rule in recording_rules()}
    expressions = [(f"{q.dashboard}: {q.panel}", q.expr) for q in dashboard_queries()]
    expressions += [(rule.get("record") or rule["alert"], rule["expr"]) for rule in recording_rules() + alert_rules()]
    unknown = []
    for where, expr in expressions:
        for name in metric_names(expr):
            known = name in recorded if ":" in name else name in exported
            if not known:
                unknown.append(f"{where}: {name}")
    assert not unknown, "references to metrics nobody exports:\n" + "\n".join(unknown)
    # Dashboards and rules use most of what is exported (a renamed metric would also show up here).
    referenced = {n for _, expr in expressions for n in metric_names(expr)}
    assert {"minedraft_engine_accepted_tokens_total", "minedraft_engine_draft_tokens_total",
            "minedraft_engine_verifier_wait_seconds_sum", "minedraft_gateway_streams_finished_total"} <= referenced
    # The drafter pool's row reads what the pool exports (its utilisation is what its autoscaling reads too).
    drafter = {n for n in exported_sample_names(drafter_registry()) if n.startswith("minedraft_drafter_")}
    assert {"minedraft_drafter_drafting_seconds_total", "minedraft_drafter_engine_job_seconds_total",
            "minedraft_drafter_queued_jobs"} <= referenced
    assert len(drafter & referenced) >= len(drafter) - 1, sorted(drafter - referenced)


def test_the_name_check_catches_a_typo():
    """The check above is not vacuous: a misspelt metric is not among the exported names."""
    exported = exported_sample_names(full_registry())
    assert "minedraft_engine_accepted_token_total" not in exported
    assert metric_names('rate(minedraft_engine_accepted_token_total{a="b"}[1m]) / minedraft:x:y') == {
        "minedraft_engine_accepted_token_total", "minedraft:x:y"}


def test_metric_names_follow_the_conventions():
    for name, kind in exported_sample_names(full_registry()).items():
        assert ":" not in name and not name.startswith("vllm")
        assert name.startswith(("minedraft_engine_", "minedraft_gateway_")), name
        if kind == "counter" and not name.endswith("_created"):
            assert name.endswith("_total"), name
        if kind == "histogram" and "_size" not in name:
            assert re.search(r"_seconds(_bucket|_sum|_count|_created)$", name), name


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_dashboard_structure(path):
    dashboard = json.loads(path.read_text())
    assert dashboard["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "instance"} <= set(variables)
    uids = set()
    for panel in dashboard["panels"]:
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{panel['title']} has no unit"
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            if "minedraft_engine_" in target["expr"] or "minedraft:engine" in target["expr"]:
                assert '$instance' in target["expr"] and '$namespace' in target["expr"], target["expr"]
        uids.add(panel["id"])
    assert len(uids) == len(dashboard["panels"])


def test_dashboards_are_generated():
    result = subprocess.run([str(ROOT / ".venv/bin/python") if (ROOT / ".venv/bin/python").exists() else "python",
                             str(ROOT / "scripts/gen_dashboards.py"), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_promtool_check_rules():
    result = subprocess.run([require_binary("promtool"), "check", "rules", str(RULES_FILE)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(recording_rules()) + len(alert_rules())} rules found" in result.stdout


def github_anchor(heading: str) -> str:
    slug = heading.strip().lower()
    slug = re.sub(r"[^\w\- ]", "", slug)
    return slug.replace(" ", "-")


def test_every_alert_has_a_summary_description_and_runbook_section():
    readme = (ROOT / "docs" / "operations.md").read_text()
    anchors = {github_anchor(line.lstrip("#")) for line in readme.splitlines() if line.startswith("#")}
    for rule in alert_rules():
        annotations = rule["annotations"]
        assert annotations["summary"] and annotations["description"], rule["alert"]
        anchor = annotations["runbook_url"].rpartition("#")[2]
        assert anchor == rule["alert"].lower()
        assert anchor in anchors, f"docs/operations.md has no runbook section for {rule['alert']}"
        assert rule["labels"]["severity"] in ("warning", "critical")


RULE_TESTS = ROOT / "tests/unit/rules/minedraft.rules.test.yaml"


def test_alert_rules_fire_on_synthetic_series():
    """promtool's rule unit tests (tests/unit/rules/): each alert fires on the series it is for, with its rendered
    summary and description, and stays quiet on the near misses beside them."""
    result = subprocess.run([require_binary("promtool"), "test", "rules", str(RULE_TESTS)], capture_output=True,
                            text=True, timeout=120, cwd=RULE_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    cases = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {t["alertname"] for case in cases for t in case.get("alert_rule_test", []) if t["exp_alerts"]}
    assert fired == {rule["alert"] for rule in alert_rules()}, "every alert needs a case where it fires"


def test_vllm_metrics_cross_from_an_engine_process_unchanged():
    """With the engine in a process of its own, vLLM's families are read there (poll_engine) and pickled across; the
    bridge then exposes what the last poll brought instead of this process's (empty) global registry."""
    import pickle

    from prometheus_client import Counter, generate_latest

    from minedraft.server.metrics import VllmMetricsBridge, vllm_metric_families

    engine_registry = CollectorRegistry()
    Counter("vllm:generation_tokens", "Generated tokens.", ["model_name"], registry=engine_registry).labels("m").inc(7)
    Counter("other_total", "Not vLLM's.", registry=engine_registry).inc()
    families = pickle.loads(pickle.dumps(vllm_metric_families(engine_registry)))
    assert [f.name for f in families] == ["vllm:generation_tokens"]
    server_registry = CollectorRegistry()
    bridge = VllmMetricsBridge(source=CollectorRegistry())
    server_registry.register(bridge)
    assert b"vllm:generation_tokens" not in generate_latest(server_registry)
    bridge.families = families
    assert 'vllm:generation_tokens_total{model_name="m"} 7.0' in generate_latest(server_registry).decode()
