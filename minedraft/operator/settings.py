"""The operator's settings: built once from flags (which default to environment variables), then passed down."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from minedraft.operator import spec as s
from minedraft.operator.render import RenderOptions

ENV_PREFIX = "MINEDRAFT_OPERATOR_"
ENGINE_IMAGE_ROLLOUTS = ("OneAtATime", "OnRequest", "All")
MONITORING_CHOICES = ("auto", "on", "off")
# A registry host (with an optional port) and optional path, as `docker push` accepts them: no scheme, no tag.
IMAGE_REGISTRY_PATTERN = re.compile(
    r"^[a-zA-Z0-9]([a-zA-Z0-9.-]*[a-zA-Z0-9])?(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*$")
IMAGE_TAG_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True)
class OperatorSettings:
    # Namespaces to watch; empty means every namespace (the chart's default, with a ClusterRole).
    namespaces: tuple[str, ...] = ()
    # How often each MineDraft is re-checked for drift and its status refreshed, even without changes.
    drift_interval_seconds: float = 60.0
    # kopf's liveness endpoint (GET /healthz) and the Prometheus metrics endpoint; 0 disables the latter.
    health_port: int = 8080
    metrics_port: int = 9402
    # "auto": render PodMonitors when the cluster serves monitoring.coreos.com/v1 podmonitors.
    monitoring: str = "auto"
    network_policy: bool = True
    # Prometheus HTTP API the autoscaler queries when a MineDraft names none (None: scrape engine pods directly).
    prometheus_url: str | None = None
    # How often each autoscaled MineDraft is checked; it is evaluated when its spec.autoscaling.intervalSeconds
    # have passed since the last evaluation.
    autoscale_tick_seconds: float = 5.0
    prometheus_namespace_selector: Mapping[str, str] = field(
        default_factory=lambda: dict(RenderOptions().prometheus_namespace_selector))
    prometheus_pod_selector: Mapping[str, str] = field(
        default_factory=lambda: dict(RenderOptions().prometheus_pod_selector))
    # The operator's own namespace and pod labels, so NetworkPolicies let it scrape pods (empty: not let in).
    operator_namespace_selector: Mapping[str, str] = field(default_factory=dict)
    operator_pod_selector: Mapping[str, str] = field(default_factory=dict)
    # fsGroup of the engine pods (None: unset, as OpenShift needs); see RenderOptions.pod_fs_group.
    pod_fs_group: int | None = None
    # Where the engine and gateway images are (the chart's image.registry and image.tag): used for MineDrafts
    # that name no image of their own.
    image_registry: str = s.DEFAULT_IMAGE_REGISTRY
    image_tag: str = s.IMAGE_TAG
    # How MineDrafts that name no engine image move to a new one (a chart upgrade changes image.tag): OneAtATime
    # (one MineDraft's engines roll at a time, the next once it has rolled out), OnRequest (only a MineDraft
    # annotated minedraft.io/upgrade-engine-image), All (every one at once).
    engine_image_rollout: str = "OneAtATime"

    def __post_init__(self) -> None:
        if not IMAGE_REGISTRY_PATTERN.match(self.image_registry):
            raise ValueError(f"image_registry must be a registry host with an optional port and path, e.g. "
                             f"registry.example.com/minedraft, without a scheme or tag (got {self.image_registry!r})")
        if not IMAGE_TAG_PATTERN.match(self.image_tag):
            raise ValueError(f"image_tag must be an image tag (letters, digits, '_', '.', '-'; got {self.image_tag!r})")
        if self.monitoring not in MONITORING_CHOICES:
            raise ValueError(f"monitoring must be one of {', '.join(MONITORING_CHOICES)} (got {self.monitoring!r})")
        if self.engine_image_rollout not in ENGINE_IMAGE_ROLLOUTS:
            raise ValueError(f"engine_image_rollout must be one of {', '.join(ENGINE_IMAGE_ROLLOUTS)} "
                             f"(got {self.engine_image_rollout!r})")
        if self.drift_interval_seconds <= 0:
            raise ValueError("drift_interval_seconds must be positive")
        if self.autoscale_tick_seconds <= 0:
            raise ValueError("autoscale_tick_seconds must be positive")
        if self.pod_fs_group is not None and not 1 <= self.pod_fs_group <= 2**31 - 1:
            raise ValueError(f"pod_fs_group must be a GID between 1 and 2147483647 (got {self.pod_fs_group})")

    def render_options(self, monitoring_available: bool) -> RenderOptions:
        monitoring = self.monitoring == "on" or (self.monitoring == "auto" and monitoring_available)
        return RenderOptions(monitoring=monitoring, network_policy=self.network_policy,
                             prometheus_namespace_selector=dict(self.prometheus_namespace_selector),
                             prometheus_pod_selector=dict(self.prometheus_pod_selector),
                             operator_namespace_selector=dict(self.operator_namespace_selector),
                             operator_pod_selector=dict(self.operator_pod_selector),
                             operator_has_prometheus=bool(self.prometheus_url),
                             pod_fs_group=self.pod_fs_group,
                             image_registry=self.image_registry, image_tag=self.image_tag)


def parse_labels(text: str) -> dict[str, str]:
    """Labels from JSON ({"k": "v"}) or k=v,k2=v2."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        value = json.loads(text)
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ValueError(f"labels must map names to strings: {text!r}")
        return {str(k): v for k, v in value.items()}
    pairs = [p.split("=", 1) for p in text.split(",") if p.strip()]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"labels must look like k=v,k2=v2: {text!r}")
    return {k.strip(): v.strip() for k, v in pairs}
