"""The operator's own Prometheus metrics (``minedraft_operator_*``), in a registry of its own (no global state)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from minedraft.operator.autoscale.policy import SIGNALS


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.reconciles = Counter(
            "minedraft_operator_reconciles", "Reconcile passes by trigger and result.",
            ["trigger", "result"], registry=self.registry)
        self.reconcile_seconds = Histogram(
            "minedraft_operator_reconcile_seconds", "Duration of one reconcile pass.", registry=self.registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.applies = Counter(
            "minedraft_operator_applies", "Objects checked against the render, by kind and action "
            "(created, updated, unchanged).", ["kind", "action"], registry=self.registry)
        self.errors = Counter(
            "minedraft_operator_errors", "Reconcile passes that found a problem, by condition reason.",
            ["reason"], registry=self.registry)
        self.ready = Gauge(
            "minedraft_operator_minedraft_ready", "1 when a MineDraft's Ready condition is True.",
            ["namespace", "name"], registry=self.registry)
        self.desired_replicas = Gauge(
            "minedraft_operator_desired_replicas", "Engine replicas a MineDraft asks for.",
            ["namespace", "name"], registry=self.registry)
        self.ready_replicas = Gauge(
            "minedraft_operator_ready_replicas", "Engine replicas ready.", ["namespace", "name"],
            registry=self.registry)

        # The autoscaler's view (only MineDrafts with spec.autoscaling).
        self.autoscaler_desired_replicas = Gauge(
            "minedraft_operator_autoscaler_desired_replicas", "Engine replicas the autoscaler's last evaluation "
            "asked for.", ["namespace", "name"], registry=self.registry)
        self.autoscaler_current_replicas = Gauge(
            "minedraft_operator_autoscaler_current_replicas", "Engine replicas (spec.replicas, starting ones "
            "included) at the autoscaler's last evaluation.", ["namespace", "name"], registry=self.registry)
        self.autoscaler_capacity = Gauge(
            "minedraft_operator_autoscaler_capacity_tokens_per_second", "Estimated output tokens/s of one replica "
            "at the batch it would run (the autoscaler's capacity).", ["namespace", "name"], registry=self.registry)
        self.autoscaler_demand = Gauge(
            "minedraft_operator_autoscaler_demand_tokens_per_second", "Output tokens/s the requests in the system "
            "need, as the autoscaler estimates it.", ["namespace", "name"], registry=self.registry)
        self.autoscaler_signal = Gauge(
            "minedraft_operator_autoscaler_signal", "1 for the signal that set the autoscaler's last recommendation "
            "(tokens: output tokens/s, prefill: prefill time, kv: KV cache, surge: requests in the system, queue: a "
            "queue's drain), 0 for the others.", ["namespace", "name", "signal"], registry=self.registry)
        self.autoscaler_slots = Gauge(
            "minedraft_operator_autoscaler_slots_per_replica", "Requests one replica can hold as the autoscaler "
            "sizes it: --max-num-seqs, or fewer where the KV cache holds fewer at today's prompt and output "
            "lengths.", ["namespace", "name"], registry=self.registry)
        self.autoscaler_metrics_available = Gauge(
            "minedraft_operator_autoscaler_metrics_available", "1 when the last evaluation had usable engine "
            "metrics.", ["namespace", "name"], registry=self.registry)
        self.autoscaler_decisions = Counter(
            "minedraft_operator_autoscaler_decisions", "Autoscaler evaluations by result (scale_up, scale_down, "
            "hold, no_metrics, scale_failed).", ["namespace", "name", "result"], registry=self.registry)

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted MineDraft's series so dashboards do not show it forever."""
        for gauge in (self.ready, self.desired_replicas, self.ready_replicas, self.autoscaler_desired_replicas,
                      self.autoscaler_current_replicas, self.autoscaler_capacity, self.autoscaler_demand,
                      self.autoscaler_metrics_available, self.autoscaler_slots):
            with contextlib.suppress(KeyError):  # never reported: nothing to drop
                gauge.remove(namespace, name)
        for signal in SIGNALS:
            with contextlib.suppress(KeyError):
                self.autoscaler_signal.remove(namespace, name, signal)
