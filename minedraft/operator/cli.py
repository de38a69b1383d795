"""`minedraft operator`: run the operator, print the manifests it would apply (`render`), or print the CRD (`crd`)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

from minedraft.operator.settings import (
    ENGINE_IMAGE_ROLLOUTS,
    ENV_PREFIX,
    IMAGE_REGISTRY_PATTERN,
    IMAGE_TAG_PATTERN,
    MONITORING_CHOICES,
    OperatorSettings,
    parse_labels,
)

EXIT_INVALID = 2


def _env(name: str, default: str) -> str:
    return os.environ.get(ENV_PREFIX + name, default)


def _matching(pattern: re.Pattern[str], what: str) -> Any:
    """An argparse type refusing values the settings would refuse (a usage error naming the flag, exit 2)."""

    def check(value: str) -> str:
        if not pattern.match(value):
            raise argparse.ArgumentTypeError(f"{value!r} is not {what}")
        return value

    return check


def settings_from_args(args: argparse.Namespace) -> OperatorSettings:
    return OperatorSettings(
        namespaces=tuple(n.strip() for n in args.namespaces.split(",") if n.strip()),
        drift_interval_seconds=args.drift_interval_seconds,
        health_port=args.health_port,
        metrics_port=args.metrics_port,
        monitoring=args.monitoring,
        network_policy=args.network_policy == "on",
        prometheus_url=args.prometheus_url or None,
        autoscale_tick_seconds=args.autoscale_tick_seconds,
        prometheus_namespace_selector=parse_labels(args.prometheus_namespace_labels),
        prometheus_pod_selector=parse_labels(args.prometheus_pod_labels),
        operator_namespace_selector=parse_labels(args.operator_namespace_labels),
        operator_pod_selector=parse_labels(args.operator_pod_labels),
        pod_fs_group=int(args.pod_fs_group) if args.pod_fs_group else None,
        image_registry=args.image_registry,
        image_tag=args.image_tag,
        engine_image_rollout=args.engine_image_rollout,
    )


def _add_operator_options(parser: argparse.ArgumentParser) -> None:
    d = OperatorSettings()
    parser.add_argument("--namespaces", default=_env("NAMESPACES", ""),
                        help="comma-separated namespaces to watch (default: all) [env MINEDRAFT_OPERATOR_NAMESPACES]")
    parser.add_argument("--drift-interval-seconds", type=float,
                        default=float(_env("DRIFT_INTERVAL_SECONDS", str(d.drift_interval_seconds))),
                        help="re-check every MineDraft this often")
    parser.add_argument("--health-port", type=int, default=int(_env("HEALTH_PORT", str(d.health_port))),
                        help="kopf liveness endpoint port (GET /healthz)")
    parser.add_argument("--metrics-port", type=int, default=int(_env("METRICS_PORT", str(d.metrics_port))),
                        help="Prometheus metrics port (0: off)")
    parser.add_argument("--monitoring", choices=MONITORING_CHOICES, default=_env("MONITORING", d.monitoring),
                        help="render PodMonitors: auto (when the Prometheus operator's CRDs exist), on or off")
    parser.add_argument("--network-policy", choices=("on", "off"), default=_env("NETWORK_POLICY", "on"),
                        help="render a NetworkPolicy letting only the gateway and Prometheus reach engine pods")
    parser.add_argument("--prometheus-url", default=_env("PROMETHEUS_URL", ""),
                        help="Prometheus HTTP API for the autoscaler when a MineDraft names none (default: scrape "
                        "engine pods directly)")
    parser.add_argument("--autoscale-tick-seconds", type=float,
                        default=float(_env("AUTOSCALE_TICK_SECONDS", str(d.autoscale_tick_seconds))),
                        help="how often autoscaled MineDrafts are checked (each is evaluated every "
                        "spec.autoscaling.intervalSeconds)")
    parser.add_argument("--prometheus-namespace-labels", default=_env(
        "PROMETHEUS_NAMESPACE_LABELS", "kubernetes.io/metadata.name=monitoring"),
        help="labels of the namespace Prometheus runs in (k=v,... or JSON)")
    parser.add_argument("--prometheus-pod-labels", default=_env(
        "PROMETHEUS_POD_LABELS", "app.kubernetes.io/name=prometheus"),
        help="labels of the Prometheus pods (k=v,... or JSON)")
    parser.add_argument("--operator-namespace-labels", default=_env("OPERATOR_NAMESPACE_LABELS", ""),
                        help="labels of the operator's own namespace, so NetworkPolicies let it scrape engine and "
                        "gateway pods when no Prometheus is configured (k=v,... or JSON; empty: not let in)")
    parser.add_argument("--operator-pod-labels", default=_env("OPERATOR_POD_LABELS", ""),
                        help="labels of the operator's own pods (k=v,... or JSON; empty: not let in)")
    parser.add_argument("--pod-fs-group", default=_env("POD_FS_GROUP", ""),
                        help="fsGroup of the engine pods, with fsGroupChangePolicy OnRootMismatch, so a PVC model "
                        "cache is writable by their non-root user (empty: unset, for OpenShift whose SCC assigns it)")
    parser.add_argument("--image-registry", default=_env("IMAGE_REGISTRY", d.image_registry),
                        type=_matching(IMAGE_REGISTRY_PATTERN, "a registry host[:port][/path] without scheme or tag"),
                        help="where `make push REGISTRY=...` put the images: MineDrafts that name no image run "
                        "REGISTRY/engine:TAG and REGISTRY/gateway:TAG [env MINEDRAFT_OPERATOR_IMAGE_REGISTRY]")
    parser.add_argument("--engine-image-rollout", choices=ENGINE_IMAGE_ROLLOUTS,
                        default=_env("ENGINE_IMAGE_ROLLOUT", d.engine_image_rollout),
                        help="how MineDrafts that name no engine image move to a new --image-tag: OneAtATime (one "
                        "MineDraft's engines roll at a time), OnRequest (only those annotated "
                        "minedraft.io/upgrade-engine-image), All [env MINEDRAFT_OPERATOR_ENGINE_IMAGE_ROLLOUT]")
    parser.add_argument("--image-tag", default=_env("IMAGE_TAG", d.image_tag),
                        type=_matching(IMAGE_TAG_PATTERN, "an image tag"),
                        help="tag of those images (default: this package's version, make's default TAG) "
                        "[env MINEDRAFT_OPERATOR_IMAGE_TAG]")


def cmd_run(args: argparse.Namespace) -> int:
    import asyncio

    from minedraft.operator.handlers import run_operator

    asyncio.run(run_operator(settings_from_args(args)))
    return 0


def render_documents(documents: list[Any], settings: OperatorSettings, monitoring_available: bool,
                     include_resource: bool = False) -> list[Any]:
    """Manifests for every MineDraft in a YAML stream, rendered from the MineDraft as the API server would store it
    (the CRD's defaults applied), preceded by that MineDraft when include_resource; raises SpecError naming the
    document and field.

    Each MineDraft first goes through what the API server does on create (the CRD's schema with unknown fields
    refused, and its CEL rules: minedraft.operator.admission), so this gives admission's answer: a file that
    renders here is one `kubectl apply` admits. The parser's own messages follow for fields admission did not name.
    """
    from minedraft.operator import spec as s
    from minedraft.operator.admission import admit
    from minedraft.operator.crd import defaulted
    from minedraft.operator.render import render_resource

    manifests: list[Any] = []
    errors: list[str] = []
    options = settings.render_options(monitoring_available)
    for index, doc in enumerate(d for d in documents if d is not None):
        if (not isinstance(doc, dict) or doc.get("kind") != s.KIND
                or doc.get("apiVersion") != f"{s.API_GROUP}/{s.API_VERSION}"):
            errors.append(f"document {index}: not a {s.KIND} ({s.API_GROUP}/{s.API_VERSION})")
            continue
        name = (doc.get("metadata") or {}).get("name", "?")
        refused = admit(doc)
        doc = defaulted(doc)
        try:
            rendered = render_resource(doc, options)
            if not refused:
                manifests += ([doc] if include_resource else []) + rendered
        except s.SpecError as exc:
            named = {e.split(":", 1)[0] for e in exc.errors}
            refused = [e for e in refused if e.split(":", 1)[0] not in named] + exc.errors
        errors += [f"{s.KIND} {name}: {e}" for e in refused]
    if errors:
        raise s.SpecError(errors)
    return manifests


def cmd_render(args: argparse.Namespace) -> int:
    import yaml

    from minedraft.operator.spec import SpecError

    text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    try:
        documents = list(yaml.safe_load_all(text))
        manifests = render_documents(documents, settings_from_args(args), args.monitoring == "on",
                                     include_resource=args.resource)
    except yaml.YAMLError as exc:
        print(f"{args.file}: invalid YAML: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except SpecError as exc:
        for error in exc.errors:
            print(f"{args.file}: {error}", file=sys.stderr)
        return EXIT_INVALID
    sys.stdout.write(yaml.safe_dump_all(manifests, sort_keys=False, width=120))
    return 0


def cmd_crd(args: argparse.Namespace) -> int:
    from minedraft.operator.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def add_subcommands(sub: Any) -> None:
    """Register `minedraft operator ...` on the top-level subparsers."""
    operator = sub.add_parser("operator", help="the Kubernetes operator (kopf): run, render, crd")
    _add_operator_options(operator)
    operator.set_defaults(func=cmd_run)
    commands = operator.add_subparsers(dest="operator_command")
    run = commands.add_parser("run", help="run the operator (the default)")
    _add_operator_options(run)
    run.set_defaults(func=cmd_run)
    render = commands.add_parser("render", help="print the manifests the operator would apply for a MineDraft file "
                                                "(YAML stream on stdout; validation errors on stderr, exit 2)")
    _add_operator_options(render)
    render.add_argument("-f", "--file", required=True, help="MineDraft YAML file ('-' for stdin)")
    render.add_argument("--resource", action="store_true",
                        help="also print each MineDraft as the API server stores it (the CRD's defaults applied), "
                        "before its objects")
    render.set_defaults(func=cmd_render)
    crd = commands.add_parser("crd", help="print the MineDraft CustomResourceDefinition")
    crd.set_defaults(func=cmd_crd)
