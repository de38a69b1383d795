"""Generate the Grafana dashboards (dashboards/*.json) from the panel lists below: one place for every query.

    python scripts/gen_dashboards.py          # rewrite dashboards/*.json
    python scripts/gen_dashboards.py --check  # exit 1 if the committed JSON differs (a test runs this)

Every panel has a unit; every query filters on the `namespace` and `instance` variables; the datasource is the
`datasource` variable. Overview panels read the recording rules (dashboards/minedraft.rules.yaml) so each
formula is written once.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD_DIR = ROOT / "dashboards"
# Grafana 11/12 dashboard JSON schema version.
SCHEMA_VERSION = 41
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# Label filters, substituted into every query.
ENGINE = 'namespace=~"$namespace", instance=~"$instance"'
GATEWAY = 'namespace=~"$namespace"'
# The shared drafter pool's pods (minedraft drafter; their own PodMonitor): no engine instance to select.
DRAFTER = 'namespace=~"$namespace"'
# The operator's series carry the MineDraft's namespace and name (no engine instance).
OPERATOR = 'namespace=~"$namespace"'
RI = "$__rate_interval"


@dataclass
class Panel:
    title: str
    unit: str
    targets: list[tuple[str, str]]  # (expr, legend)
    description: str = ""
    kind: str = "timeseries"
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def q(quantile: float, metric: str, labels: str, by: str = "") -> str:
    group = f"le{', ' + by if by else ''}"
    return f"histogram_quantile({quantile}, sum by ({group}) (rate({metric}_bucket{{{labels}}}[{RI}])))"


def per_step(metric: str, labels: str = ENGINE, by: str = "instance") -> str:
    return (f"sum by ({by}) (rate({metric}_sum{{{labels}}}[{RI}])) / "
            f"sum by ({by}) (rate({metric}_count{{{labels}}}[{RI}]))")


OVERVIEW: list[Panel] = [
    Panel("Output tokens/s (all replicas)", "suffix: tok/s",
          [(f'sum(minedraft:engine_output_tokens_per_second:rate1m{{{ENGINE}}})', "total")],
          "Generated tokens streamed to clients per second, summed over the selected replicas.", kind="stat", width=6,
          height=5),
    Panel("Replicas", "short",
          [(f'count(minedraft_engine_running_requests{{{ENGINE}}})', "engines"),
           (f'sum(minedraft_gateway_endpoints_ready{{{GATEWAY}}})', "ready at the gateway")],
          "Engine replicas scraped, and engines the gateway can route to.", kind="stat", width=6, height=5),
    Panel("Acceptance rate", "percentunit",
          [(f'avg(minedraft:engine_acceptance_rate:rate1m{{{ENGINE}}})', "acceptance")],
          "Share of draft tokens accepted by the target (recording rule, 1m).", kind="stat", width=4, height=5,
          min=0, max=1),
    Panel("Mean accepted length", "short",
          [(f'avg(minedraft:engine_mean_accepted_length:rate1m{{{ENGINE}}})', "tokens per verification")],
          "Tokens a request gains per verification that carried drafts: accepted drafts + 1.", kind="stat", width=4,
          height=5),
    Panel("Overlap fraction", "percentunit",
          [(f'avg(minedraft:engine_overlap_fraction:rate1m{{{ENGINE}}})', "overlap")],
          "Share of drafting time hidden behind verification: 1 - wait / draft (1 = fully hidden, 0 = sequential).",
          kind="stat", width=4, height=5, min=0, max=1),
    Panel("Output tokens/s per replica", "suffix: tok/s",
          [(f'minedraft:engine_output_tokens_per_second:rate1m{{{ENGINE}}}', "{{instance}}"),
           (f'minedraft:engine_predicted_capacity_tokens_per_second:max{{{ENGINE}}}', "{{instance}} predicted best")],
          "Measured throughput against the cost model's best predicted throughput at the current load (capacity)."),
    Panel("Time to first token", "s",
          [(q(p, "minedraft_engine_time_to_first_token_seconds", ENGINE), f"p{round(p * 100)}")
           for p in (0.5, 0.95, 0.99)],
          "From a request's arrival at the engine server to its first token."),
    Panel("Time per output token", "s",
          [(q(p, "minedraft_engine_time_per_output_token_seconds", ENGINE), f"p{round(p * 100)}")
           for p in (0.5, 0.95, 0.99)],
          "Per request: (last token - first token) / (tokens - 1)."),
    Panel("End-to-end request latency", "s",
          [(q(p, "minedraft_engine_request_duration_seconds", ENGINE), f"p{round(p * 100)}") for p in (0.5, 0.95)],
          "From a request's arrival at the engine server to its end."),
    Panel("Acceptance rate and overlap per replica", "percentunit",
          [(f'minedraft:engine_acceptance_rate:rate1m{{{ENGINE}}}', "{{instance}} acceptance"),
           (f'minedraft:engine_overlap_fraction:rate1m{{{ENGINE}}}', "{{instance}} overlap")],
          "Recording rules minedraft:engine_acceptance_rate:rate1m and minedraft:engine_overlap_fraction:rate1m.",
          min=0, max=1),
    Panel("Queue", "short",
          [(f'sum by (instance) (minedraft_engine_running_requests{{{ENGINE}}})', "{{instance}} running"),
           (f'sum by (instance) (minedraft_engine_waiting_requests{{{ENGINE}}})', "{{instance}} waiting")],
          "Requests decoding and waiting for admission in each replica."),
    Panel("KV-cache usage", "percentunit",
          [(f'max by (instance) (minedraft_engine_kv_cache_usage_ratio{{{ENGINE}}})', "{{instance}}")],
          "Share of the target's KV cache in use.", min=0, max=1),
    Panel("Autoscaler: replicas and what decided", "short",
          [(f'max by (name) (minedraft_operator_autoscaler_desired_replicas{{{OPERATOR}}})', "{{name}} desired"),
           (f'max by (name) (minedraft_operator_autoscaler_current_replicas{{{OPERATOR}}})', "{{name}} current"),
           (f'max by (name) (minedraft_operator_autoscaler_slots_per_replica{{{OPERATOR}}})',
            "{{name}} requests a replica holds"),
           (f'max by (name, signal) (minedraft_operator_autoscaler_signal{{{OPERATOR}}}) == 1',
            "{{name}} decided by {{signal}}")],
          "Engine replicas the autoscaler asks for and has, the requests one replica holds as it sizes them "
          "(--max-num-seqs, or fewer where the KV cache holds fewer at today's lengths), and the signal that set its "
          "last recommendation: tokens (output tokens/s), prefill (prefill time), kv (KV cache), surge (requests in "
          "the system) or queue (a queue's drain). The reason of each change is in status.scaling and the "
          "MineDraft's events."),
    Panel("Autoscaler: prompts as load", "percentunit",
          [(f'avg(avg_over_time(minedraft_engine_kv_cache_usage_ratio{{{ENGINE}}}[1m]))', "KV cache in use (1m mean)"),
           (f'sum(rate(minedraft_engine_prefill_seconds_total{{{ENGINE}}}[{RI}])) / '
            f'count(minedraft_engine_running_requests{{{ENGINE}}})', "prefill share of a replica's time")],
          "What the autoscaler reads besides output tokens/s: the replicas' KV cache in use (it sizes for the target "
          "utilisation of it, and for the share a request will hold when new replicas serve while prompts grow) "
          "and the share of their time spent prefilling prompts (time they do not decode).", min=0, max=1),
    Panel("Requests finished by reason", "reqps",
          [(f'sum by (finish_reason) (rate(minedraft_engine_requests_finished_total{{{ENGINE}}}[{RI}]))',
            "{{finish_reason}}")],
          "Ended requests per second: stop, length, abort (client cancel, deadline), error."),
    Panel("Gateway streams by status", "reqps",
          [(f'sum by (protocol, code) (rate(minedraft_gateway_streams_finished_total{{{GATEWAY}}}[{RI}]))',
            "{{protocol}} {{code}}")],
          "Streams ended per second at the gateway, by API (grpc, http: the OpenAI API) and gRPC status code (an HTTP "
          "stream's status maps to one: 400 INVALID_ARGUMENT, 401 UNAUTHENTICATED, 429 RESOURCE_EXHAUSTED, 503 "
          "UNAVAILABLE, 504 DEADLINE_EXCEEDED)."),
    Panel("Requests by API", "reqps",
          [(f'sum by (protocol) (rate(minedraft_gateway_streams_started_total{{{GATEWAY}}}[{RI}]))',
            "gateway {{protocol}}"),
           (f'sum by (protocol) (rate(minedraft_engine_requests_finished_total{{{ENGINE}}}[{RI}]))',
            "engines direct {{protocol}}")],
          "Streams started per second at the gateways and requests ended per second at the engines, by the API they "
          "came through (grpc, or http: the OpenAI API). The gateway speaks gRPC to engines, so engines count HTTP "
          "only from clients that call them directly (a MineDraft without the gateway)."),
]

SPECULATION: list[Panel] = [
    Panel("Acceptance per draft position", "percentunit",
          [(f'sum by (position) (rate(minedraft_engine_accepted_tokens_per_position_total{{{ENGINE}}}[{RI}])) / '
            f'sum by (position) (rate(minedraft_engine_drafted_tokens_per_position_total{{{ENGINE}}}[{RI}]))',
            "position {{position}}")],
          "Share of drafted tokens accepted at each draft position (0 = first drafted token).", min=0, max=1),
    Panel("Draft vs verify time per step", "s",
          [(per_step("minedraft_engine_verify_seconds"), "{{instance}} verify"),
           (per_step("minedraft_engine_draft_seconds"), "{{instance}} draft"),
           (per_step("minedraft_engine_verifier_wait_seconds"), "{{instance}} wait for drafts"),
           (per_step("minedraft_engine_step_seconds"), "{{instance}} step")],
          "Mean seconds per step: target verification, drafting (in the drafter), the verifier's wait, whole step. "
          "PSD hides drafting when draft <= verify."),
    Panel("Step phases p95", "s",
          [(q(0.95, "minedraft_engine_verify_seconds", ENGINE), "verify p95"),
           (q(0.95, "minedraft_engine_draft_seconds", ENGINE), "draft p95"),
           (q(0.95, "minedraft_engine_verifier_wait_seconds", ENGINE), "wait p95"),
           (q(0.95, "minedraft_engine_step_seconds", ENGINE), "step p95")],
          "95th percentile of each per-step phase."),
    Panel("Verifier waiting share", "percentunit",
          [(f'minedraft:engine_verifier_wait_ratio:rate5m{{{ENGINE}}}', "{{instance}}")],
          "Share of step time the target waited for drafts (MineDraftVerifierStarved fires above 30%).", min=0, max=1),
    Panel("Drafter idle per step", "s",
          [(per_step("minedraft_engine_drafter_idle_seconds"), "{{instance}}")],
          "Mean time the drafter sat idle per step: headroom for more or longer drafts."),
    Panel("Sub-batch balance", "short",
          [(f'max by (instance, subbatch) (minedraft_engine_subbatch_requests{{{ENGINE}}})',
            "{{instance}} sub-batch {{subbatch}}"),
           (q(0.5, "minedraft_engine_subbatch_size", ENGINE), "verified sub-batch p50")],
          "Requests in each PSD sub-batch (sizes stay within one of each other) and the verified sub-batch's size."),
    Panel("Drafter health", "short",
          [(f'max by (instance) (minedraft_engine_drafter_up{{{ENGINE}}})', "{{instance}} up"),
           (f'sum by (instance) (increase(minedraft_engine_drafter_restarts_total{{{ENGINE}}}[{RI}]))',
            "{{instance}} restarts"),
           (f'sum by (instance) (increase(minedraft_engine_drafter_deadline_misses_total{{{ENGINE}}}[{RI}]))',
            "{{instance}} deadline misses"),
           (f'sum by (instance) (increase(minedraft_engine_drafter_errors_total{{{ENGINE}}}[{RI}]))',
            "{{instance}} failed jobs")],
          "Drafter up (1/0), and restarts, missed draft deadlines and failed jobs per interval."),
    Panel("Mode and k", "short",
          [(f'max by (instance, mode) (minedraft_engine_mode{{{ENGINE}}}) == 1', "{{instance}} {{mode}}"),
           (f'max by (instance) (minedraft_engine_num_speculative_tokens{{{ENGINE}}})', "{{instance}} k"),
           (f'sum by (instance) (increase(minedraft_engine_mode_switches_total{{{ENGINE}}}[{RI}]))',
            "{{instance}} auto switches")],
          "The mode the engine runs (a series per mode while it runs), k, and auto mode's switches per interval."),
    Panel("Predicted goodput per mode", "suffix: tok/s",
          [(f'max by (mode, k) (minedraft_engine_predicted_output_tokens_per_second{{{ENGINE}}})',
            "{{mode}} k={{k}}")],
          "The engine's cost model: predicted output tokens/s of each mode and k at the current load."),
    Panel("Speculation tokens/s", "suffix: tok/s",
          [(f'sum by (mode) (rate(minedraft_engine_draft_tokens_total{{{ENGINE}}}[{RI}]))', "{{mode}} drafted"),
           (f'sum by (mode) (rate(minedraft_engine_accepted_tokens_total{{{ENGINE}}}[{RI}]))', "{{mode}} accepted"),
           (f'sum by (mode) (rate(minedraft_engine_output_tokens_total{{{ENGINE}}}[{RI}]))', "{{mode}} committed")],
          "Draft tokens verified and accepted, and tokens the target committed, per second by mode."),
    # A row for the shared drafter pool (spec.drafterPool, `minedraft drafter`): empty where engines draft locally.
    Panel("Drafter pool: jobs and batches", "ops",
          [(f'sum by (pod) (rate(minedraft_drafter_jobs_total{{{DRAFTER}}}[{RI}]))', "{{pod}} jobs"),
           (f'sum by (pod) (rate(minedraft_drafter_batches_total{{{DRAFTER}}}[{RI}]))', "{{pod}} batches"),
           (f'sum by (pod) (rate(minedraft_drafter_shared_batches_total{{{DRAFTER}}}[{RI}]))',
            "{{pod}} batches of several engines"),
           (f'sum by (pod) (rate(minedraft_drafter_busy_total{{{DRAFTER}}}[{RI}]))', "{{pod}} answered busy"),
           (f'sum by (pod) (rate(minedraft_drafter_optional_items_dropped_total{{{DRAFTER}}}[{RI}]))',
            "{{pod}} extra branches dropped")],
          "Per pool replica: draft jobs answered, batched forwards, those carrying more than one engine's jobs, "
          "jobs answered busy (queue full or queued past the engine's deadline: that engine drafts less), and "
          "lookahead branches beyond a request's likeliest left out of shared batches.", width=8),
    Panel("Drafter pool: utilisation", "percentunit",
          [(f'sum by (pod) (rate(minedraft_drafter_drafting_seconds_total{{{DRAFTER}}}[{RI}]))',
            "{{pod}} utilisation"),
           (f'sum by (pod) (rate(minedraft_drafter_optional_drafting_seconds_total{{{DRAFTER}}}[{RI}]))',
            "{{pod}} on lookahead's extra branches")],
          "Share of time each pool replica spends drafting, and the part of it on lookahead's extra branches "
          "(drafted only when no other job waits; the pool's autoscaling reads the rest).", width=8, min=0, max=1),
    Panel("Drafter pool: mean batch size", "short",
          [(f'sum by (pod) (rate(minedraft_drafter_batch_requests_total{{{DRAFTER}}}[{RI}])) / '
            f'sum by (pod) (rate(minedraft_drafter_batches_total{{{DRAFTER}}}[{RI}]))', "{{pod}} requests/batch")],
          "Requests drafted per batched forward: a GPU drafter's loop is nearly flat in batch, so larger is cheaper "
          "per request.", width=8),
    Panel("Drafter pool: queue and sessions", "short",
          [(f'sum by (pod) (minedraft_drafter_queued_jobs{{{DRAFTER}}})', "{{pod}} queued jobs"),
           (f'sum by (pod) (minedraft_drafter_sessions{{{DRAFTER}}})', "{{pod}} engine sessions"),
           (f'sum by (pod) (minedraft_drafter_requests_held{{{DRAFTER}}})', "{{pod}} requests held"),
           (f'sum by (pod) (increase(minedraft_drafter_sessions_expired_total{{{DRAFTER}}}[{RI}]))',
            "{{pod}} sessions expired")],
          "Jobs waiting, engine sessions open, requests whose context the drafter holds, sessions dropped after a "
          "silence (per interval)."),
    Panel("Drafter pool: job latency per engine", "s",
          [(f'sum by (engine) (rate(minedraft_drafter_engine_job_seconds_total{{{DRAFTER}}}[{RI}])) / '
            f'sum by (engine) (rate(minedraft_drafter_engine_jobs_total{{{DRAFTER}}}[{RI}]))', "{{engine}}")],
          "Mean seconds from a job's arrival at the pool to its answer, per engine (queueing included): compare "
          "with the engines' verify time per step, which drafting must stay under to be hidden."),
    Panel("Gateway streams", "short",
          [(f'sum(minedraft_gateway_streams_in_flight{{{GATEWAY}}})', "in flight"),
           (f'sum by (engine) (minedraft_gateway_engine_outstanding_streams{{{GATEWAY}}})', "to {{engine}}"),
           (f'sum(minedraft_gateway_endpoints_known{{{GATEWAY}}})', "engines known"),
           (f'sum(minedraft_gateway_endpoints_ready{{{GATEWAY}}})', "engines ready")],
          "Streams in flight at the gateway, open to each engine, and engines known/ready."),
    Panel("Gateway retries and rejections", "reqps",
          [(f'sum(rate(minedraft_gateway_retries_total{{{GATEWAY}}}[{RI}]))', "retries"),
           (f'sum(rate(minedraft_gateway_admission_rejected_total{{{GATEWAY}}}[{RI}]))', "rejected (admission)"),
           (f'sum(rate(minedraft_gateway_streams_started_total{{{GATEWAY}}}[{RI}]))', "started")],
          "Engine retries before the first token, streams refused at the in-flight limit, and streams started."),
    Panel("Gateway added latency", "s",
          [(q(0.99, "minedraft_gateway_route_seconds", GATEWAY), "route p99"),
           (q(0.95, "minedraft_gateway_time_to_first_response_seconds", GATEWAY, "protocol"),
            "{{protocol}} first response p95"),
           (q(0.95, "minedraft_gateway_stream_duration_seconds", GATEWAY, "protocol"), "{{protocol}} stream p95")],
          "The gateway's own latency before an engine is called, and first-response and whole-stream latency "
          "seen at the gateway."),
]


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit}
    if panel.min is not None:
        defaults["min"] = panel.min
    if panel.max is not None:
        defaults["max"] = panel.max
    targets = [{"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i),
                "range": True} for i, (expr, legend) in enumerate(panel.targets)]
    options: dict[str, Any] = (
        {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}, "colorMode": "value",
         "graphMode": "area", "textMode": "auto"}
        if panel.kind == "stat"
        else {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
              "tooltip": {"mode": "multi", "sort": "none"}})
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
        "targets": targets,
        **panel.extra,
    }


def _variables() -> list[dict[str, Any]]:
    def query_variable(name: str, label: str, query: str) -> dict[str, Any]:
        return {
            "name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "definition": query, "query": {"query": query, "refId": f"{name}-variable"},
            "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2, "sort": 1,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        }

    return [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1},
        query_variable("namespace", "Namespace", "label_values(minedraft_engine_steps_total, namespace)"),
        query_variable("instance", "Engine", 'label_values(minedraft_engine_steps_total{namespace=~"$namespace"}, '
                                             'instance)'),
    ]


def dashboard(uid: str, title: str, panels: list[Panel], description: str) -> dict[str, Any]:
    laid_out: list[dict[str, Any]] = []
    x = y = row_height = 0
    for i, panel in enumerate(panels, start=1):
        if x + panel.width > 24:
            x, y, row_height = 0, y + row_height, 0
        laid_out.append(_panel_json(panel, i, x, y))
        x += panel.width
        row_height = max(row_height, panel.height)
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["minedraft"],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "timezone": "browser",
        "templating": {"list": _variables()},
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "name": "Annotations & Alerts", "type": "dashboard"}]},
        "links": [],
        "panels": laid_out,
    }


DASHBOARDS = {
    "minedraft-overview.json": dashboard(
        "minedraft-overview", "MineDraft overview", OVERVIEW,
        "Throughput, latency percentiles, acceptance, accepted length, overlap, replicas and queue."),
    "minedraft-speculation.json": dashboard(
        "minedraft-speculation", "MineDraft speculation detail", SPECULATION,
        "Per-position acceptance, draft vs verify time, waits, sub-batch balance, drafter health, mode, the shared "
        "drafter pool, gateway."),
}


def render(content: dict[str, Any]) -> str:
    return json.dumps(content, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed dashboards differ")
    args = parser.parse_args(argv)
    stale = []
    for name, content in DASHBOARDS.items():
        path = DASHBOARD_DIR / name
        text = render(content)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale dashboards: {', '.join(stale)}; run python scripts/gen_dashboards.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
