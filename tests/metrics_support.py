"""What the metrics tests share: the dashboards' and rules' expressions, the metric names the code exports, and a
real Prometheus on loopback (Debian's package, installed by scripts/setup.sh)."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

from minedraft.engine.control.stats import EngineTotals, StepRecord

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD_DIR = ROOT / "dashboards"
RULES_FILE = DASHBOARD_DIR / "minedraft.rules.yaml"
DASHBOARD_FILES = sorted(DASHBOARD_DIR.glob("*.json"))

# Grafana's variables as a query sees them with every value selected.
VARIABLES = {"$__rate_interval": "1m", "$__range": "5m", "$__interval": "15s", "$namespace": ".*", "$instance": ".*"}
NAME = re.compile(r"\bminedraft[a-z0-9_:]*")


def substitute(expr: str) -> str:
    for variable, value in sorted(VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(variable, value)
    return expr


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    unit: str | None
    expr: str
    legend: str


def dashboard_queries() -> list[PanelQuery]:
    queries = []
    for path in DASHBOARD_FILES:
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
            for target in panel.get("targets", []):
                queries.append(PanelQuery(path.name, panel["title"], unit, target["expr"],
                                          target.get("legendFormat", "")))
    return queries


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES_FILE.read_text())["groups"] for rule in group["rules"]]


def recording_rules() -> list[dict[str, Any]]:
    return [r for r in rules() if "record" in r]


def alert_rules() -> list[dict[str, Any]]:
    return [r for r in rules() if "alert" in r]


def metric_names(expr: str) -> set[str]:
    """Metric and recording-rule names an expression references (ours only: minedraft prefixes)."""
    return set(NAME.findall(expr))


def sample_record(step: int, mode: str = "psd", group: int | None = 0) -> StepRecord:
    return StepRecord(
        step=step, started_at=0.0, mode=mode, verified_group=group, group_sizes=(3, 2), num_decode_requests=3,
        num_prefill_requests=0, num_requests_with_drafts=3, num_draft_tokens=9, num_accepted_tokens=5,
        drafted_per_position=(3, 3, 3), accepted_per_position=(3, 1, 1), num_output_tokens=8,
        num_scheduled_tokens=12, verify_seconds=0.02, wait_seconds=0.001, draft_seconds=0.015,
        drafter_idle_seconds=0.004, schedule_seconds=0.001, step_seconds=0.03, drafter_up=True, k=3)


def full_registry() -> CollectorRegistry:
    """A registry holding every metric the engine server and the gateway export, each with a sample."""
    from minedraft.gateway.metrics import GatewayMetrics, GatewayStateCollector
    from minedraft.gateway.policy import Admission, EndpointSet
    from minedraft.server.metrics import EngineSnapshot, RequestMetrics, RequestOutcome, SnapshotCollector, StepMetrics

    registry = CollectorRegistry()
    steps = StepMetrics(registry, "m", max_positions=3)
    steps.ingest([sample_record(1)])
    RequestMetrics(registry, "m").record(RequestOutcome("stop", 1.0, 0.1, 5, 0.5))
    snapshots = SnapshotCollector("m")
    snapshots.snapshot = EngineSnapshot(EngineTotals(), 1, 0, 0.1, "psd", 3, "psd", True, (("psd", 3, 100.0),))
    registry.register(snapshots)
    GatewayMetrics(registry)
    endpoints = EndpointSet()
    endpoints.replace(["127.0.0.1:1"])
    registry.register(GatewayStateCollector(endpoints, Admission(4)))
    return registry


def operator_registry() -> CollectorRegistry:
    """The operator's metrics, each with a sample (one MineDraft's autoscaler evaluated once)."""
    from minedraft.operator.autoscale.policy import SIGNALS
    from minedraft.operator.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    labels = ("ns", "md")
    for gauge in (metrics.ready, metrics.desired_replicas, metrics.ready_replicas, metrics.autoscaler_desired_replicas,
                  metrics.autoscaler_current_replicas, metrics.autoscaler_capacity, metrics.autoscaler_demand,
                  metrics.autoscaler_metrics_available, metrics.autoscaler_slots):
        gauge.labels(*labels).set(1)
    for signal in SIGNALS:
        metrics.autoscaler_signal.labels(*labels, signal).set(1 if signal == "kv" else 0)
    return metrics.registry


def drafter_registry() -> CollectorRegistry:
    """A registry holding every metric a shared drafter service (`minedraft drafter`) exports, each with a sample:
    the service's own collector over its counters (one engine's job answered)."""
    from types import SimpleNamespace

    from minedraft.engine.drafter.service import ServiceCounters
    from minedraft.server.drafter_metrics import DrafterServiceCollector

    registry = CollectorRegistry()
    collector = DrafterServiceCollector()
    counters = ServiceCounters(jobs_done=1, batches=1, batch_requests=2, drafting_seconds=0.01,
                               engine_jobs={"engine-a": 1}, engine_job_seconds={"engine-a": 0.02})
    collector.attach(SimpleNamespace(counters=counters, sessions={}, queued_jobs=0,
                                     server=SimpleNamespace(contexts={})))
    registry.register(collector)
    return registry


def drafter_service_registry() -> CollectorRegistry:
    """The metrics of a real drafter-service core (the service's session handling, batching and drafter job server,
    without sockets or a model): one engine opens an authenticated session and has one job drafted, so every pool
    series exists, as a `minedraft drafter` process exports them."""
    from minedraft.engine.drafter import protocol, wire
    from minedraft.engine.drafter.process import DrafterServer
    from minedraft.engine.drafter.service import ServiceCore
    from minedraft.server.drafter_metrics import DrafterServiceCollector

    class EchoBackend:  # drafts the context's last token k times
        cancelled: set[str] = set()

        def context_changed(self, request_id: str, num_tokens_kept: int) -> None:
            pass

        def draft(self, job: Any, poll_messages: Any, on_step: Any = lambda: None) -> Any:
            on_step()
            return ([protocol.DraftResult(i.request_id, len(i.token_ids), [i.token_ids[-1]] * i.num_draft_tokens)
                     for i in job.items], 0.01, 0.005)

    token, sent = b"a-token-of-enough-bytes", []
    core = ServiceCore(DrafterServer(EchoBackend(), vocab_size=1000), token, "draft",
                       lambda peer, message: sent.append(message))
    nonce = wire.new_nonce()
    core.on_message(b"engine-a", wire.Hello(wire.WIRE_VERSION, "engine-a", nonce, 5.0))
    challenge = sent[-1]
    core.on_message(b"engine-a", wire.Auth(wire.client_mac(token, nonce, challenge.server_nonce)))
    assert isinstance(sent[-1], wire.Welcome), sent[-1]
    core.on_message(b"engine-a", protocol.DraftJob(1, [protocol.DraftItem("r-1", [5, 6, 7], 3)]))
    while (batch := core.next_batch()) is not None:
        core.run_batch(batch, 0.0, lambda: None)
    registry = CollectorRegistry()
    collector = DrafterServiceCollector()
    collector.attach(core)
    registry.register(collector)
    return registry


def exported_sample_names(registry: CollectorRegistry) -> dict[str, str]:
    """Sample name -> metric type, for every sample of every family (histogram _bucket/_sum/_count included)."""
    names: dict[str, str] = {}
    for family in registry.collect():
        for sample in family.samples:
            # prometheus_client's creation-time samples: bookkeeping, not metrics anything should query.
            if not sample.name.endswith("_created"):
                names[sample.name] = family.type
    return names


# -- a real Prometheus ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def require_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise AssertionError(f"{name} not found: scripts/setup.sh installs Debian's prometheus package")
    return path


class Prometheus:
    """Prometheus on loopback, scraping `targets` (job -> host:port) every second, rules evaluated every second."""

    def __init__(self, directory: Path, targets: dict[str, str], rule_files: list[Path]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target]}]}
                               for job, target in targets.items()],
        }
        config_file = directory / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config))
        self.log = (directory / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [require_binary("prometheus"), f"--config.file={config_file}",
             f"--storage.tsdb.path={directory / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def get(self, path: str, **params: Any) -> Any:
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        body = self.get("/api/v1/query", **params)
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def query_error(self, expr: str) -> str | None:
        """None when the expression parses and evaluates, else Prometheus' error."""
        try:
            self.query(expr)
        except urllib.error.HTTPError as exc:
            return f"{exc.code}: {exc.read().decode()[:500]}"
        return None

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        body = self.get("/api/v1/query_range", query=expr, start=start, end=end, step=step)
        return list(body["data"]["result"])

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def wait_ready(self, timeout_seconds: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_seconds
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("prometheus did not become ready")
            time.sleep(0.05)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
