"""Pure rendering: a MineDraft spec (plus the operator's own options) to the manifests the operator applies.

No I/O here; `minedraft operator render` and the tests call these functions directly. Every object carries an owner
reference to the MineDraft so deleting it garbage-collects everything, and the labels the operator selects on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from minedraft.operator import spec as s

Manifest = dict[str, Any]

ENGINE_GRPC_PORT = 50051
ENGINE_METRICS_PORT = 9400
LIVENESS_PERIOD_SECONDS = 10
# Seconds of the engine's termination grace period kept for its own shutdown after streams are drained.
ENGINE_SHUTDOWN_SECONDS = 10
GATEWAY_GRPC_PORT = 50051
GATEWAY_METRICS_PORT = 9401
GATEWAY_GRACE_SECONDS = 20
# Unprivileged ids baked into the images (docker/*.Dockerfile); pods refuse to run as root.
RUN_AS_USER = 1000
FIELD_MANAGER = "minedraft-operator"
MANAGED_BY = "minedraft-operator"

# Mount points of the writable volumes; the root filesystem stays read-only.
TMP_DIR = "/tmp"
CACHE_DIR = "/var/cache/minedraft"
MODEL_CACHE_DIR = "/var/lib/minedraft/models"
MODEL_PVC_ROOT = "/mnt/models"
AUTH_DIR = "/etc/minedraft/auth"
TLS_DIR = "/etc/minedraft/tls"


@dataclass(frozen=True)
class RenderOptions:
    """Cluster-level choices that are not part of a MineDraft: set once from the operator's flags and discovery."""

    # The Prometheus operator's CRDs exist (discovered at runtime): render a PodMonitor.
    monitoring: bool = False
    # Render a NetworkPolicy letting only the gateway and Prometheus reach the engine pods.
    network_policy: bool = True
    prometheus_namespace_selector: Mapping[str, str] = field(
        default_factory=lambda: {"kubernetes.io/metadata.name": "monitoring"})
    prometheus_pod_selector: Mapping[str, str] = field(
        default_factory=lambda: {"app.kubernetes.io/name": "prometheus"})
    # Where the operator's own pods run (the chart passes its release namespace and pod labels; empty: unknown, so
    # never let in). An autoscaled MineDraft with no Prometheus to query has its pods' metrics scraped by the
    # operator itself, which the NetworkPolicies must then allow.
    operator_namespace_selector: Mapping[str, str] = field(default_factory=dict)
    operator_pod_selector: Mapping[str, str] = field(default_factory=dict)
    # The operator has a default Prometheus (--prometheus-url): it never scrapes pods itself.
    operator_has_prometheus: bool = False


def names(meta: s.ObjectMeta) -> dict[str, str]:
    return {"engine": f"{meta.name}-engine", "gateway": f"{meta.name}-gateway", "monitor": meta.name}


def selector_labels(meta: s.ObjectMeta, component: str) -> dict[str, str]:
    """The labels Deployments, Services, PDBs and the /scale selector select on (never changed after creation)."""
    return {"minedraft.io/instance": meta.name, "minedraft.io/component": component}


def engine_selector(meta: s.ObjectMeta) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(meta, "engine").items())


def _labels(meta: s.ObjectMeta, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "minedraft",
        "app.kubernetes.io/instance": meta.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        **selector_labels(meta, component),
    }


def owner_reference(meta: s.ObjectMeta) -> dict[str, Any]:
    return {"apiVersion": f"{s.API_GROUP}/{s.API_VERSION}", "kind": s.KIND, "name": meta.name, "uid": meta.uid,
            "controller": True, "blockOwnerDeletion": True}


def _metadata(meta: s.ObjectMeta, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": meta.namespace, "labels": _labels(meta, component),
            "ownerReferences": [owner_reference(meta)]}


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}}


def _pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER, "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"}}


# -- engine ----------------------------------------------------------------------------------------------------------


def _model_location(role: str, model: s.ModelSpec) -> str:
    src = model.source
    if src.hugging_face_id is not None:
        return src.hugging_face_id
    if src.pvc_claim_name is not None:
        return f"{MODEL_PVC_ROOT}/{src.pvc_claim_name}" + (f"/{src.pvc_path.strip('/')}" if src.pvc_path else "")
    assert src.image_path is not None, f"{role}: the parser guarantees one source"
    return src.image_path


def engine_command(spec: s.MineDraftSpec) -> list[str]:
    """The engine container's command line: the target on GPU 0, the drafter on GPU 1 (a device of its own)."""
    eng = spec.engine
    k = spec.speculation.num_speculative_tokens
    cmd = [
        "minedraft", "serve",
        "--host", "0.0.0.0",
        "--grpc-port", str(ENGINE_GRPC_PORT),
        "--metrics-port", str(ENGINE_METRICS_PORT),
        # Streams get most of the termination grace period to finish; the rest covers shutdown itself.
        "--grace-seconds", str(max(1, eng.termination_grace_period_seconds - ENGINE_SHUTDOWN_SECONDS)),
        "--model", _model_location("target", spec.target),
        "--draft", _model_location("draft", spec.draft),
        "--mode", spec.speculation.mode,
        "--num-speculative-tokens", str(k),
        "--num-extra-draft-tokens", str(spec.speculation.num_extra_draft_tokens),
        # The device plugin exposes this pod's GPUs as 0..n-1; the target takes the first targetGPUs of them, so
        # the last one is the drafter's alone.
        "--drafter-gpu", str(eng.target_gpus),
        "--drafter-backend", eng.drafter_backend,
        "--max-num-seqs", str(eng.max_num_seqs),
        "--max-model-len", str(eng.max_model_len),
    ]
    if spec.speculation.mode == "auto":
        # auto mode may lengthen drafts at run time up to this bound (the autoscaling bounds when given).
        bound = spec.autoscaling.speculation.max_speculative_tokens if spec.autoscaling else k
        cmd += ["--max-num-speculative-tokens", str(max(k, bound))]
    return cmd + list(eng.extra_args)


def _engine_volumes(spec: s.MineDraftSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    eng = spec.engine
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        # torch.compile, Triton and vLLM write compile caches under $HOME/.cache by default.
        {"name": "cache", "emptyDir": {}},
        # NCCL and vLLM's worker processes share tensors through /dev/shm; the container default (64 MiB) is too small.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": eng.shm_size}},
        {"name": "model-cache", **({"persistentVolumeClaim": {"claimName": eng.model_cache.claim_name}}
                                   if eng.model_cache.claim_name else {"emptyDir": {"sizeLimit":
                                                                                    eng.model_cache.size_limit}})},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": TMP_DIR},
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "model-cache", "mountPath": MODEL_CACHE_DIR},
    ]
    claims = sorted({m.source.pvc_claim_name for m in (spec.target, spec.draft) if m.source.pvc_claim_name})
    for index, claim in enumerate(claims):
        volumes.append({"name": f"models-{index}",
                        "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": f"models-{index}", "mountPath": f"{MODEL_PVC_ROOT}/{claim}", "readOnly": True})
    return volumes, mounts


def _engine_env(spec: s.MineDraftSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": TMP_DIR},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        {"name": "VLLM_CACHE_ROOT", "value": f"{CACHE_DIR}/vllm"},
        {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
        {"name": "HF_HOME", "value": f"{MODEL_CACHE_DIR}/huggingface"},
        {"name": "VLLM_LOGGING_STREAM", "value": "ext://sys.stderr"},
        # `minedraft serve` reports it as its replica id.
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    tokens = {m.source.hugging_face_token for m in (spec.target, spec.draft) if m.source.hugging_face_token}
    if tokens:
        # One process downloads both models, so one token (the parser rejects two different ones).
        token = sorted(tokens, key=lambda t: (t.name, t.key))[0]
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}}})
    return env


def _grpc_probe(period_seconds: int, failure_threshold: int) -> dict[str, Any]:
    return {"grpc": {"port": ENGINE_GRPC_PORT}, "periodSeconds": period_seconds,
            "failureThreshold": failure_threshold, "timeoutSeconds": 5}


def engine_deployment(spec: s.MineDraftSpec, meta: s.ObjectMeta) -> Manifest:
    eng = spec.engine
    gpus = eng.target_gpus + eng.drafter_gpus
    volumes, mounts = _engine_volumes(spec)
    startup_period = 10
    container = {
        "name": "engine",
        "image": eng.image,
        "imagePullPolicy": eng.image_pull_policy,
        "command": engine_command(spec),
        "ports": [{"name": "grpc", "containerPort": ENGINE_GRPC_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": ENGINE_METRICS_PORT, "protocol": "TCP"}],
        "env": _engine_env(spec),
        "resources": {
            "requests": {"cpu": eng.cpu, "memory": eng.memory, "nvidia.com/gpu": str(gpus)},
            "limits": {"memory": eng.memory, "nvidia.com/gpu": str(gpus)},
        },
        # Loading weights takes minutes: the startup probe holds liveness off until the health service says SERVING.
        "startupProbe": _grpc_probe(startup_period, max(1, eng.startup_timeout_seconds // startup_period)),
        "readinessProbe": _grpc_probe(5, 2),
        # The health service goes NOT_SERVING while draining on SIGTERM; the liveness window outlasts the whole
        # termination grace period so a long drain is never cut short by a restart (a hang is still caught).
        "livenessProbe": _grpc_probe(LIVENESS_PERIOD_SECONDS,
                                     max(6, -(-eng.termination_grace_period_seconds // LIVENESS_PERIOD_SECONDS) + 1)),
        "securityContext": _container_security(),
        "volumeMounts": mounts,
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": _pod_security(),
        # Engines never call the Kubernetes API.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": eng.termination_grace_period_seconds,
    }
    if eng.node_selector:
        pod_spec["nodeSelector"] = dict(eng.node_selector)
    if eng.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in eng.tolerations]
    if eng.affinity:
        pod_spec["affinity"] = dict(eng.affinity)
    if eng.priority_class_name:
        pod_spec["priorityClassName"] = eng.priority_class_name
    labels = _labels(meta, "engine")
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(meta, names(meta)["engine"], "engine"),
        "spec": {
            "replicas": spec.desired_replicas,
            "selector": {"matchLabels": {"minedraft.io/instance": meta.name},
                         "matchExpressions": [{"key": "minedraft.io/component", "operator": "In",
                                               "values": ["engine", "gateway"]}]},
            # A new pod must be ready before an old one goes: rollouts never drop capacity. Without spare GPUs the
            # new pod waits Pending while the old ones keep serving.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": labels,
                             "annotations": {"kubectl.kubernetes.io/default-container": "engine"}},
                "spec": pod_spec,
            },
        },
    }


def engine_service(meta: s.ObjectMeta) -> Manifest:
    """Headless: the gateway discovers each engine pod through its EndpointSlices and balances per stream."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(meta, names(meta)["engine"], "engine"),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(meta, "engine"),
            "ports": [{"name": "grpc", "port": ENGINE_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"},
                      {"name": "metrics", "port": ENGINE_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}],
        },
    }


def engine_pdb(meta: s.ObjectMeta) -> Manifest:
    # maxUnavailable rather than minAvailable: a one-replica MineDraft can still be drained.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(meta, names(meta)["engine"], "engine"),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(meta, "engine")}},
    }


def _metrics_scrapers(spec: s.MineDraftSpec, options: RenderOptions) -> list[dict[str, Any]]:
    """NetworkPolicy peers that read a MineDraft's metrics ports: Prometheus, and the operator when it scrapes."""
    peers: list[dict[str, Any]] = [{"namespaceSelector": {"matchLabels": dict(options.prometheus_namespace_selector)},
                                    "podSelector": {"matchLabels": dict(options.prometheus_pod_selector)}}]
    operator_scrapes = (spec.autoscaling is not None and not spec.autoscaling.prometheus_address
                        and not options.operator_has_prometheus)
    if operator_scrapes and options.operator_namespace_selector and options.operator_pod_selector:
        peers.append({"namespaceSelector": {"matchLabels": dict(options.operator_namespace_selector)},
                      "podSelector": {"matchLabels": dict(options.operator_pod_selector)}})
    return peers


def engine_network_policy(spec: s.MineDraftSpec, meta: s.ObjectMeta, options: RenderOptions) -> Manifest:
    """Only this MineDraft's gateway reaches the engines' gRPC port; only the metrics scrapers their metrics port.
    (The kubelet's probes come from the node, which NetworkPolicies always admit.)"""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(meta, names(meta)["engine"], "engine"),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(meta, "engine")},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": selector_labels(meta, "gateway")}}],
                 "ports": [{"protocol": "TCP", "port": ENGINE_GRPC_PORT}]},
                {"from": _metrics_scrapers(spec, options),
                 "ports": [{"protocol": "TCP", "port": ENGINE_METRICS_PORT}]},
            ],
        },
    }


def gateway_network_policy(spec: s.MineDraftSpec, meta: s.ObjectMeta, options: RenderOptions) -> Manifest:
    """Clients (anywhere) reach every gateway port but metrics; only the metrics scrapers reach that."""
    container = gateway_deployment(spec, meta)["spec"]["template"]["spec"]["containers"][0]
    serving = [{"protocol": p["protocol"], "port": p["containerPort"]} for p in container["ports"]
               if p["name"] != "metrics"]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(meta, names(meta)["gateway"], "gateway"),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(meta, "gateway")},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": serving},
                {"from": _metrics_scrapers(spec, options),
                 "ports": [{"protocol": "TCP", "port": GATEWAY_METRICS_PORT}]},
            ],
        },
    }


# -- gateway ---------------------------------------------------------------------------------------------------------


def gateway_command(spec: s.MineDraftSpec, meta: s.ObjectMeta) -> list[str]:
    gw = spec.gateway
    cmd = ["minedraft", "gateway",
           "--host", "0.0.0.0",
           "--port", str(GATEWAY_GRPC_PORT),
           "--metrics-port", str(GATEWAY_METRICS_PORT),
           "--kubernetes-service", f"{meta.namespace}/{names(meta)['engine']}",
           "--kubernetes-port-name", "grpc",
           "--max-in-flight", str(gw.max_in_flight),
           "--grace-seconds", str(GATEWAY_GRACE_SECONDS)]
    if gw.auth_token is not None:
        cmd += ["--token-file", f"{AUTH_DIR}/{gw.auth_token.key}"]
    if gw.tls_secret_name is not None:
        cmd += ["--tls-cert", f"{TLS_DIR}/tls.crt", "--tls-key", f"{TLS_DIR}/tls.key"]
    return cmd


def gateway_service_account(meta: s.ObjectMeta) -> Manifest:
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": _metadata(meta, names(meta)["gateway"], "gateway"),
            "automountServiceAccountToken": False}


def gateway_role(meta: s.ObjectMeta) -> Manifest:
    """The gateway only watches its engines' EndpointSlices, in its own namespace."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": _metadata(meta, names(meta)["gateway"], "gateway"),
            "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                       "verbs": ["get", "list", "watch"]}]}


def gateway_role_binding(meta: s.ObjectMeta) -> Manifest:
    name = names(meta)["gateway"]
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": _metadata(meta, name, "gateway"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": meta.namespace}]}


def gateway_deployment(spec: s.MineDraftSpec, meta: s.ObjectMeta) -> Manifest:
    gw = spec.gateway
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        # The token is mounted only into the gateway container (projected, not automounted into every container).
        {"name": "kube-api-access", "projected": {"sources": [
            {"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}},
            {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            {"downwardAPI": {"items": [{"path": "namespace",
                                        "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
        ]}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": TMP_DIR},
        {"name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": True},
    ]
    if gw.auth_token is not None:
        volumes.append({"name": "auth", "secret": {"secretName": gw.auth_token.name, "defaultMode": 0o440,
                                                   "items": [{"key": gw.auth_token.key, "path": gw.auth_token.key}]}})
        mounts.append({"name": "auth", "mountPath": AUTH_DIR, "readOnly": True})
    if gw.tls_secret_name is not None:
        volumes.append({"name": "tls", "secret": {"secretName": gw.tls_secret_name, "defaultMode": 0o440}})
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
    # With TLS on, a kubelet gRPC probe cannot complete the handshake: fall back to a TCP check.
    check: dict[str, Any] = ({"tcpSocket": {"port": GATEWAY_GRPC_PORT}} if gw.tls_secret_name is not None
                             else {"grpc": {"port": GATEWAY_GRPC_PORT}})
    container = {
        "name": "gateway",
        "image": gw.image,
        "imagePullPolicy": gw.image_pull_policy,
        "command": gateway_command(spec, meta),
        "ports": [{"name": "grpc", "containerPort": GATEWAY_GRPC_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": GATEWAY_METRICS_PORT, "protocol": "TCP"}],
        "env": [{"name": "HOME", "value": TMP_DIR}],
        "resources": {"requests": {"cpu": gw.cpu, "memory": gw.memory}, "limits": {"memory": gw.memory}},
        "readinessProbe": {**check, "periodSeconds": 5, "failureThreshold": 3, "timeoutSeconds": 3},
        "livenessProbe": {**check, "periodSeconds": 10, "failureThreshold": 3, "timeoutSeconds": 3},
        "securityContext": _container_security(),
        "volumeMounts": mounts,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(meta, names(meta)["gateway"], "gateway"),
        "spec": {
            "replicas": gw.replicas,
            "selector": {"matchLabels": selector_labels(meta, "gateway")},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": _labels(meta, "gateway")},
                "spec": {
                    "serviceAccountName": names(meta)["gateway"],
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "containers": [container],
                    "volumes": volumes,
                    "securityContext": _pod_security(),
                    "terminationGracePeriodSeconds": GATEWAY_GRACE_SECONDS + 10,
                },
            },
        },
    }


def gateway_service(spec: s.MineDraftSpec, meta: s.ObjectMeta) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(meta, names(meta)["gateway"], "gateway"),
        "spec": {
            "type": spec.gateway.service_type,
            "selector": selector_labels(meta, "gateway"),
            "ports": [{"name": "grpc", "port": spec.gateway.port, "targetPort": "grpc", "protocol": "TCP",
                       "appProtocol": "grpc"}],
        },
    }


def gateway_endpoint(spec: s.MineDraftSpec, meta: s.ObjectMeta) -> str:
    return f"{names(meta)['gateway']}.{meta.namespace}.svc:{spec.gateway.port}"


def pod_monitor(meta: s.ObjectMeta) -> Manifest:
    """One PodMonitor for the engines and the gateway: both name their metrics port "metrics"."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _metadata(meta, names(meta)["monitor"], "monitoring"),
        "spec": {
            "selector": {"matchLabels": {"minedraft.io/instance": meta.name},
                         "matchExpressions": [{"key": "minedraft.io/component", "operator": "In",
                                               "values": ["engine", "gateway"]}]},
            "podMetricsEndpoints": [{"port": "metrics", "interval": "15s"}],
        },
    }


def render(spec: s.MineDraftSpec, meta: s.ObjectMeta, options: RenderOptions | None = None) -> list[Manifest]:
    """Every object of one MineDraft, in apply order (RBAC before the pods that use it)."""
    options = options or RenderOptions()
    manifests = [
        engine_service(meta),
        engine_deployment(spec, meta),
        engine_pdb(meta),
        gateway_service_account(meta),
        gateway_role(meta),
        gateway_role_binding(meta),
        gateway_service(spec, meta),
        gateway_deployment(spec, meta),
    ]
    if options.network_policy:
        manifests += [engine_network_policy(spec, meta, options), gateway_network_policy(spec, meta, options)]
    if options.monitoring:
        manifests.append(pod_monitor(meta))
    return manifests


def render_resource(resource: Mapping[str, Any], options: RenderOptions | None = None) -> list[Manifest]:
    """Render a whole MineDraft object as read from YAML or the API (raises SpecError on a bad spec)."""
    return render(s.parse_spec(resource.get("spec")), s.parse_meta(resource.get("metadata") or {}), options)
