"""What the API server checks on built-in objects beyond their OpenAPI schemas, as a pure function.

Kubernetes' published JSON schemas (kubernetes-validate) check types and field names only. The API server's own
validation code (k8s.io/apimachinery/pkg/util/validation and pkg/apis/*/validation) also checks name and label
syntax and lengths, port names, enums the schemas leave as plain strings, and cross-field rules. This module
repeats the checks that a rendered MineDraft object can fail; `object_problems(manifest)` returns one message per
violation (empty: the API server would take it, as far as modelled here). Only what the operator renders is
modelled: Services, Deployments (their pod templates), PodDisruptionBudgets, NetworkPolicies, RBAC objects.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
IANA_SVC_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
CONFIG_MAP_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
TOLERATION_OPERATORS = {"Exists", "Equal"}
TAINT_EFFECTS = {"NoSchedule", "PreferNoSchedule", "NoExecute"}
ENV_SOURCES = {"fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef", "fileKeyRef"}
# Kinds whose names are DNS-1035 labels (Services) or DNS-1123 labels; the rest are DNS-1123 subdomains.
DNS1035_KINDS = {"Service"}


def _name_problems(value: Any, what: str, pattern: re.Pattern[str], max_len: int) -> list[str]:
    if not isinstance(value, str) or not value:
        return [f"{what}: required"]
    out = []
    if len(value) > max_len:
        out.append(f"{what}: {value!r} is longer than {max_len} characters")
    if not pattern.match(value):
        out.append(f"{what}: {value!r} does not match {pattern.pattern}")
    return out


def label_key_problems(key: str, what: str) -> list[str]:
    prefix, _, name = key.rpartition("/")
    out = _name_problems(name, f"{what} key {key!r} (name part)", QUALIFIED_NAME, 63)
    if prefix:
        out += _name_problems(prefix, f"{what} key {key!r} (prefix)", DNS1123_SUBDOMAIN, 253)
    return out


def labels_problems(labels: Mapping[str, Any] | None, what: str) -> list[str]:
    out: list[str] = []
    for key, value in (labels or {}).items():
        out += label_key_problems(key, what)
        if not isinstance(value, str) or len(value) > 63 or not LABEL_VALUE.match(value):
            out.append(f"{what}[{key}]: {value!r} is not a label value (at most 63 characters, alphanumerics, "
                       "'-', '_', '.', alphanumeric at both ends)")
    return out


def _selector_problems(selector: Mapping[str, Any] | None, what: str) -> list[str]:
    return labels_problems((selector or {}).get("matchLabels"), f"{what}.matchLabels")


def _containers(pod: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for kind in ("initContainers", "containers"):
        yield from pod.get(kind) or []


def _env_problems(env: list[Mapping[str, Any]], where: str) -> list[str]:
    out: list[str] = []
    for index, var in enumerate(env):
        at = f"{where}.env[{index}]"
        name = var.get("name")
        if not isinstance(name, str) or not ENV_NAME.match(name):
            out.append(f"{at}.name: {name!r} is not a valid environment variable name")
        source = var.get("valueFrom")
        if source is None:
            continue
        if var.get("value"):
            out.append(f"{at}.valueFrom: may not be specified when `value` is not empty")
        kinds = [k for k in ENV_SOURCES if k in (source or {})]
        if len(kinds) != 1:
            out.append(f"{at}.valueFrom: must specify exactly one of {sorted(ENV_SOURCES)} (got {kinds})")
            continue
        ref = source[kinds[0]]
        if not isinstance(ref, Mapping):
            out.append(f"{at}.valueFrom.{kinds[0]}: must be an object")
        elif kinds[0] in ("secretKeyRef", "configMapKeyRef"):
            out += _name_problems(ref.get("name"), f"{at}.valueFrom.{kinds[0]}.name", DNS1123_SUBDOMAIN, 253)
            out += _name_problems(ref.get("key"), f"{at}.valueFrom.{kinds[0]}.key", CONFIG_MAP_KEY, 253)
        elif kinds[0] == "fieldRef" and not ref.get("fieldPath"):
            out.append(f"{at}.valueFrom.fieldRef.fieldPath: required")
        elif kinds[0] == "resourceFieldRef" and not ref.get("resource"):
            out.append(f"{at}.valueFrom.resourceFieldRef.resource: required")
    return out


def _toleration_problems(tolerations: list[Mapping[str, Any]], where: str) -> list[str]:
    out: list[str] = []
    for index, t in enumerate(tolerations):
        at = f"{where}.tolerations[{index}]"
        operator = t.get("operator", "Equal")
        if operator not in TOLERATION_OPERATORS:
            out.append(f"{at}.operator: {operator!r} is not Exists or Equal")
        if operator == "Exists" and t.get("value"):
            out.append(f"{at}.operator: value must be empty when operator is Exists")
        if not t.get("key") and operator != "Exists":
            out.append(f"{at}.operator: must be Exists when key is empty")
        if t.get("key"):
            out += label_key_problems(str(t["key"]), f"{at}.key")
        effect = t.get("effect")
        if effect not in (None, "", *TAINT_EFFECTS):
            out.append(f"{at}.effect: {effect!r} is not a taint effect")
        if t.get("tolerationSeconds") is not None and effect != "NoExecute":
            out.append(f"{at}.effect: must be NoExecute when tolerationSeconds is set")
    return out


def pod_problems(pod: Mapping[str, Any], where: str) -> list[str]:
    out: list[str] = []
    volumes = [v.get("name") for v in pod.get("volumes") or []]
    for name in volumes:
        out += _name_problems(name, f"{where}.volumes[{name}].name", DNS1123_LABEL, 63)
    if len(set(volumes)) != len(volumes):
        out.append(f"{where}.volumes: duplicate names {volumes}")
    for volume in pod.get("volumes") or []:
        for source in ("secret", "configMap"):
            for item in (volume.get(source) or {}).get("items") or []:
                out += _name_problems(item.get("key"), f"{where}.volumes[{volume['name']}].{source}.items.key",
                                      CONFIG_MAP_KEY, 253)
                if item.get("key") in (".", "..") or str(item.get("key", "")).startswith(".."):
                    out.append(f"{where}.volumes[{volume['name']}].{source}.items.key: must not be '.' or '..' "
                               "nor start with '..'")
                path = str(item.get("path", ""))
                if path.startswith("/") or ".." in path.split("/") or path.startswith(".."):
                    out.append(f"{where}.volumes[{volume['name']}].{source}.items.path: {path!r} must be a relative "
                               "path without '..' that does not start with '..'")
    for name in ("runtimeClassName", "priorityClassName"):
        if name in pod:
            out += _name_problems(pod[name], f"{where}.{name}", DNS1123_SUBDOMAIN, 253)
    for index, secret in enumerate(pod.get("imagePullSecrets") or []):
        out += _name_problems(secret.get("name"), f"{where}.imagePullSecrets[{index}].name", DNS1123_SUBDOMAIN, 253)
    out += labels_problems(pod.get("nodeSelector"), f"{where}.nodeSelector")
    out += _toleration_problems(pod.get("tolerations") or [], where)
    for container in _containers(pod):
        at = f"{where}.containers[{container.get('name')}]"
        out += _name_problems(container.get("name"), f"{at}.name", DNS1123_LABEL, 63)
        numbers = [p["containerPort"] for p in container.get("ports") or []]
        if len(set(numbers)) != len(numbers):
            out.append(f"{at}.ports: one port declared twice {numbers} (the process cannot bind it twice)")
        for port in container.get("ports") or []:
            if not 1 <= port["containerPort"] <= 65535:
                out.append(f"{at}.ports: {port['containerPort']} is not a port number")
            if "name" in port:
                out += _name_problems(port["name"], f"{at}.ports.name", IANA_SVC_NAME, 15)
        out += _env_problems(container.get("env") or [], at)
        mounts = container.get("volumeMounts") or []
        for mount in mounts:
            if mount.get("name") not in volumes:
                out.append(f"{at}.volumeMounts: {mount.get('name')!r} is no volume of the pod")
        paths = [m.get("mountPath") for m in mounts]
        if len(set(paths)) != len(paths):
            out.append(f"{at}.volumeMounts: duplicate mount paths {paths}")
        resources = container.get("resources") or {}
        requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
        for resource, value in requests.items():
            if "/" in resource and "kubernetes.io/" not in resource and limits.get(resource) != value:
                out.append(f"{at}.resources: extended resource {resource} must have a limit equal to its request")
    return out


def object_problems(manifest: Mapping[str, Any]) -> list[str]:
    """The API server's name, label and semantic checks for one rendered object (see the module's docstring)."""
    kind = manifest.get("kind", "?")
    meta = manifest.get("metadata") or {}
    where = f"{kind}/{meta.get('name')}"
    pattern, max_len = (DNS1035_LABEL, 63) if kind in DNS1035_KINDS else (DNS1123_SUBDOMAIN, 253)
    out = _name_problems(meta.get("name"), f"{where}.metadata.name", pattern, max_len)
    out += labels_problems(meta.get("labels"), f"{where}.metadata.labels")
    spec = manifest.get("spec") or {}
    if kind == "Deployment":
        template = spec.get("template") or {}
        labels = (template.get("metadata") or {}).get("labels") or {}
        out += labels_problems(labels, f"{where}.spec.template.metadata.labels")
        out += _selector_problems(spec.get("selector"), f"{where}.spec.selector")
        wanted = (spec.get("selector") or {}).get("matchLabels") or {}
        if any(labels.get(k) != v for k, v in wanted.items()):
            out.append(f"{where}.spec.selector: does not match the template's labels")
        out += pod_problems(template.get("spec") or {}, f"{where}.spec.template.spec")
    elif kind in ("Service", "PodDisruptionBudget", "NetworkPolicy"):
        out += labels_problems(spec.get("selector") if kind == "Service" else None, f"{where}.spec.selector")
        if kind != "Service":
            out += _selector_problems(spec.get("selector") or spec.get("podSelector"), f"{where}.spec.selector")
        for port in spec.get("ports") or []:
            if "name" in port:
                out += _name_problems(port["name"], f"{where}.spec.ports.name", DNS1123_LABEL, 63)
            if not 1 <= port.get("port", 0) <= 65535:
                out.append(f"{where}.spec.ports: {port.get('port')} is not a port number")
        numbers = [(p.get("port"), p.get("protocol", "TCP")) for p in spec.get("ports") or []]
        if len(set(numbers)) != len(numbers):
            out.append(f"{where}.spec.ports: duplicate port {numbers}")
    return out
