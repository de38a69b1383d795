"""Pure rendering: a MineDraft spec (plus the operator's own options) to the manifests the operator applies.

No I/O here; `minedraft operator render` and the tests call these functions directly. Every object carries an owner
reference to the MineDraft so deleting it garbage-collects everything, and the labels the operator selects on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from minedraft.operator import spec as s

Manifest = dict[str, Any]

ENGINE_GRPC_PORT = s.ENGINE_GRPC_PORT
ENGINE_METRICS_PORT = s.ENGINE_METRICS_PORT
LIVENESS_PERIOD_SECONDS = 10
# Seconds of the engine's termination grace period kept for its own shutdown after streams are drained.
ENGINE_SHUTDOWN_SECONDS = 10
GATEWAY_GRPC_PORT = 50051
GATEWAY_METRICS_PORT = 9401
GATEWAY_HTTP_PORT = 8080
GATEWAY_GRACE_SECONDS = 20
# What a cold engine start takes beyond the startup probe's window (which starts with the container): scheduling,
# a node scale-up, pulling a CUDA image of several GB. A stream waits at the gateway for the whole of it.
ENGINE_COLD_START_MARGIN_SECONDS = 600
# The gRPC health service names (grpc.health.v1): "" answers readiness (engine loaded and not draining; gateway has
# an engine to route to), LIVENESS_SERVICE answers liveness (the process's event loop answers) from the moment the
# port is bound until exit, including while loading, draining or with no engine.
READINESS_SERVICE = ""
LIVENESS_SERVICE = "minedraft.liveness"
FIELD_MANAGER = "minedraft-operator"
MANAGED_BY = "minedraft-operator"

# Mount points of the writable volumes; the root filesystem stays read-only.
TMP_DIR = "/tmp"
CACHE_DIR = "/var/cache/minedraft"
MODEL_CACHE_DIR = "/var/lib/minedraft/models"
MODEL_PVC_ROOT = "/mnt/models"
AUTH_DIR = "/etc/minedraft/auth"
# The MineDraft's internal credential (an operator-generated Secret, <name>-internal, key token): what the gateway
# presents to engines and what engines and the drafter pool accept, never a client's API token.
INTERNAL_DIR = "/etc/minedraft/internal"
INTERNAL_TOKEN_PATH = f"{INTERNAL_DIR}/token"
INTERNAL_TOKEN_KEY = "token"
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
    # The engine pods' fsGroup (None: not set). A freshly provisioned disk's root is owned by root, so without it the
    # engine (any non-root UID) cannot write a PVC model cache; the kubelet then makes the volume group-writable for
    # this GID, only when its root does not already match (OnRootMismatch: no recursive chown of a full cache at
    # every start). Left unset on OpenShift, whose SCC assigns the namespace's own fsGroup and refuses others.
    pod_fs_group: int | None = None
    # Where `make push` put the images, and their tag: engine and gateway pods whose MineDraft names no image of its
    # own run <image_registry>/engine:<image_tag> and <image_registry>/gateway:<image_tag>.
    image_registry: str = s.DEFAULT_IMAGE_REGISTRY
    image_tag: str = s.IMAGE_TAG

    def image(self, name: str) -> str:
        """The image `make images` builds from docker/<name>.Dockerfile, in this registry with this tag."""
        return f"{self.image_registry.rstrip('/')}/{name}:{self.image_tag}"


def with_images(spec: s.MineDraftSpec, options: RenderOptions) -> s.MineDraftSpec:
    """The spec with the operator's images filled in where the MineDraft names none."""
    return replace(spec, engine=replace(spec.engine, image=spec.engine.image or options.image("engine")),
                   gateway=replace(spec.gateway, image=spec.gateway.image or options.image("gateway")))


def names(meta: s.ObjectMeta) -> dict[str, str]:
    return {"engine": f"{meta.name}-engine", "gateway": f"{meta.name}-gateway", "monitor": meta.name,
            "drafter": f"{meta.name}-drafter", "internal": f"{meta.name}-internal"}


def needs_internal_secret(spec: s.MineDraftSpec) -> bool:
    """Whether the pods use the operator-generated internal credential: between gateway and engines whenever the
    gateway runs, and between engines and a drafter pool that names no Secret of its own."""
    return spec.gateway.enabled or (spec.drafter_pool is not None and spec.drafter_pool.token is None)


def internal_secret(meta: s.ObjectMeta, token: str) -> Manifest:
    """The internal credential's Secret, created once by the operator (never updated by it: a rotation is an edit of
    this Secret, see docs/kubernetes.md), owned by the MineDraft so it goes with it."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _metadata(meta, names(meta)["internal"], "internal"),
            "stringData": {INTERNAL_TOKEN_KEY: token + "\n"}}


def _internal_volume(meta: s.ObjectMeta) -> tuple[dict[str, Any], dict[str, Any]]:
    return ({"name": "internal", "secret": {"secretName": names(meta)["internal"], "defaultMode": 0o440,
                                            "items": [{"key": INTERNAL_TOKEN_KEY, "path": "token"}]}},
            {"name": "internal", "mountPath": INTERNAL_DIR, "readOnly": True})


def pool_token(spec: s.MineDraftSpec, meta: s.ObjectMeta) -> s.SecretKeyRef:
    """The Secret engines and the drafter pool authenticate each other with: the pool's own, else the internal one."""
    assert spec.drafter_pool is not None
    return spec.drafter_pool.token or s.SecretKeyRef(names(meta)["internal"], INTERNAL_TOKEN_KEY)


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
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def _pod_security(fs_group: int | None = None) -> dict[str, Any]:
    # No runAsUser/runAsGroup: PodSecurity "restricted" and OpenShift's restricted-v2 pick an arbitrary UID (and
    # fsGroup) per namespace, and a fixed one is refused there. The images run as a non-root user by default,
    # every writable path is a volume (emptyDir is world-writable), and HOME and the caches point into them. A
    # fsGroup only where the cluster does not assign one (RenderOptions.pod_fs_group): PVCs are not world-writable.
    out: dict[str, Any] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    if fs_group is not None:
        out.update(fsGroup=fs_group, fsGroupChangePolicy="OnRootMismatch")
    return out


def _grpc_check(port: int, service: str) -> dict[str, Any]:
    return {"grpc": {"port": port, "service": service}}


# -- engine ----------------------------------------------------------------------------------------------------------


def _model_location(role: str, model: s.ModelSpec) -> str:
    src = model.source
    if src.hugging_face_id is not None:
        return src.hugging_face_id
    if src.pvc_claim_name is not None:
        return f"{MODEL_PVC_ROOT}/{src.pvc_claim_name}" + (f"/{src.pvc_path.strip('/')}" if src.pvc_path else "")
    assert src.image_path is not None, f"{role}: the parser guarantees one source"
    return src.image_path


def engine_command(spec: s.MineDraftSpec, meta: s.ObjectMeta | None = None) -> list[str]:
    """The engine container's command line: the target on GPU 0, the drafter on GPU 1 (a device of its own)."""
    eng = spec.engine
    k = spec.speculation.num_speculative_tokens
    cmd = [
        "minedraft", "serve",
        "--host", "0.0.0.0",
        "--grpc-port", str(ENGINE_GRPC_PORT),
        "--metrics-port", str(ENGINE_METRICS_PORT),
        *(["--http-port", str(spec.engine_http_port)] if spec.engine_http_port else []),
        # Streams get most of the termination grace period to finish; the rest covers shutdown itself.
        "--grace-seconds", str(max(1, eng.termination_grace_period_seconds - ENGINE_SHUTDOWN_SECONDS)),
        "--model", _model_location("target", spec.target),
        "--draft", _model_location("draft", spec.draft),
        "--mode", spec.speculation.mode,
        "--num-speculative-tokens", str(k),
        "--num-extra-draft-tokens", str(spec.speculation.num_extra_draft_tokens),
        "--drafter-backend", eng.drafter_backend,
        "--max-num-seqs", str(eng.max_num_seqs),
    ]
    # Flags with the engine's own default (dtype auto, one GPU) are left out, so the command stays as short as what
    # was asked for.
    if eng.dtype != s.EngineSpec().dtype:
        cmd += ["--dtype", eng.dtype]
    if eng.target_gpus > 1:
        # The target is tensor parallel over all its GPUs.
        cmd += ["--tensor-parallel-size", str(eng.target_gpus)]
    if spec.drafter_pool is not None:
        # The MineDraft's drafter pool drafts for every engine: no drafter GPU here. Its Service, in the same
        # namespace (the short name resolves).
        assert meta is not None, "the drafter pool's address needs the MineDraft's name"
        cmd += ["--drafter-address", f"{names(meta)['drafter']}:{spec.drafter_pool.port}",
                "--drafter-token-file", f"{DRAFTER_TOKEN_DIR}/token"]
    elif spec.needs_drafter_gpu:
        # The device plugin exposes this pod's GPUs as 0..n-1; the target takes the first targetGPUs of them, so
        # the next one is the drafter's alone.
        cmd += ["--drafter-gpu", str(eng.target_gpus)]
    if eng.max_num_seqs_from_kv_tokens is not None:
        # The engine sizes its batch from the KV its target GPU holds, --max-num-seqs its ceiling: a drafter off
        # that GPU leaves it more than vllm-sd's colocated one, which a fixed limit would leave unused.
        cmd += ["--max-num-seqs-from-kv", str(eng.max_num_seqs_from_kv_tokens)]
    if spec.speculation.async_steps:
        # Each psd step scheduled while the target computes the one before (engine/vllm_adapter/overlap.py).
        cmd += ["--async-psd-steps"]
    if eng.max_model_len is not None:
        # Unset: the model's own context length (a fixed default would break models with shorter contexts).
        cmd += ["--max-model-len", str(eng.max_model_len)]
    if spec.speculation.mode == "auto":
        # auto mode switches among the allowed modes and draft lengths at run time; the engine is built for the
        # longest of them.
        modes = spec.auto_modes
        k_low, k_high = ((spec.autoscaling.speculation.min_speculative_tokens,
                          spec.autoscaling.speculation.max_speculative_tokens) if spec.autoscaling else (1, k))
        cmd += ["--max-num-speculative-tokens", str(max(k, k_high)),
                "--auto-modes", ",".join(m for m in s.AUTO_MODES if m in modes),
                "--auto-k", ",".join(str(n) for n in range(k_low, max(k, k_high) + 1))]
    if spec.speculation.lookahead_fanout is not None and spec.runs_lookahead:
        # Lookahead's ceiling on branches per request per round (the parser refuses it where lookahead never runs);
        # unset, the engine's own default.
        cmd += ["--lookahead-fanout", str(spec.speculation.lookahead_fanout)]
    if spec.served_model_names:
        cmd += ["--served-model-name", *spec.served_model_names]
    if engines_need_token(spec):
        # Behind the gateway the engines accept the internal credential (one token per line, re-read when the
        # Secret changes): an unauthenticated pod does not get past the gateway this way.
        cmd += ["--token-file", INTERNAL_TOKEN_PATH]
        if accepts_previous_credential(spec):
            cmd += ["--token-file", auth_token_path(spec)]
    # Everything else goes to vLLM's own engine arguments, one `--flag=value` word each (vLLM's parser checks them
    # at start-up; a typo shows in the MineDraft's Progressing condition through the container's termination message).
    for word in s.split_extra_args(eng.extra_args):
        own = s.extra_arg_flag(word) in s.ENGINE_OWN_EXTRA_FLAGS
        cmd.append(word if own else f"--vllm-arg={word}")
    return cmd


def engines_need_token(spec: s.MineDraftSpec) -> bool:
    """Behind the gateway, engines authenticate their callers with the internal credential, which the gateway
    presents (many clusters do not enforce the NetworkPolicy that would otherwise be all that keeps pods off them)."""
    return spec.gateway.enabled


def accepts_previous_credential(spec: s.MineDraftSpec) -> bool:
    """For this release only: engines also accept the clients' token, and the gateway offers it to an engine that
    refuses the internal credential. 0.1.0's gateways presented the clients' token to engines, which accepted only
    it; an upgrade rolls gateways and engines apart, so while old and new pods mix each side must take the other's
    (docs/kubernetes.md, Upgrades). The next release drops it: then only the internal credential passes."""
    return spec.gateway.enabled and spec.gateway.auth_token is not None


def auth_token_path(spec: s.MineDraftSpec) -> str:
    assert spec.gateway.auth_token is not None
    return f"{AUTH_DIR}/{spec.gateway.auth_token.key}"


def _auth_volume(spec: s.MineDraftSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """The gateway's token Secret as a volume (only its key) and its read-only mount: the kubelet updates a mounted
    Secret in place when it changes, and both processes re-read the file (no restart at rotation)."""
    token = spec.gateway.auth_token
    assert token is not None
    return ({"name": "auth", "secret": {"secretName": token.name, "defaultMode": 0o440,
                                        "items": [{"key": token.key, "path": token.key}]}},
            {"name": "auth", "mountPath": AUTH_DIR, "readOnly": True})


def _engine_volumes(spec: s.MineDraftSpec, drafter: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The engine pod's volumes and mounts; `drafter`: the drafter pool's (the draft's weights only, and no gateway
    token: it never reads one)."""
    eng = spec.engine
    # The pool caches only the draft's weights: its own size when the cache is an emptyDir.
    cache_size = spec.drafter_pool.model_cache_size_limit if drafter and spec.drafter_pool else \
        eng.model_cache.size_limit
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        # torch.compile, Triton and vLLM write compile caches under $HOME/.cache by default.
        {"name": "cache", "emptyDir": {}},
        # NCCL and vLLM's worker processes share tensors through /dev/shm; the container default (64 MiB) is too small.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": eng.shm_size}},
        {"name": "model-cache", **({"persistentVolumeClaim": {"claimName": eng.model_cache.claim_name}}
                                   if eng.model_cache.claim_name else {"emptyDir": {"sizeLimit": cache_size}})},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": TMP_DIR},
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "model-cache", "mountPath": MODEL_CACHE_DIR},
    ]
    models = (spec.draft,) if drafter else (spec.target, spec.draft)
    claims = sorted({m.source.pvc_claim_name for m in models if m.source.pvc_claim_name})
    for index, claim in enumerate(claims):
        volumes.append({"name": f"models-{index}",
                        "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": f"models-{index}", "mountPath": f"{MODEL_PVC_ROOT}/{claim}", "readOnly": True})
    return volumes, mounts


# Every path a process of the engine writes, each on a volume (the root filesystem is read-only, and with an
# arbitrary UID there is no home directory in /etc/passwd: HOME must be set).
WRITABLE_ENV = {
    "HOME": TMP_DIR,
    "TMPDIR": TMP_DIR,
    "XDG_CACHE_HOME": CACHE_DIR,
    "XDG_CONFIG_HOME": f"{CACHE_DIR}/config",
    "VLLM_CACHE_ROOT": f"{CACHE_DIR}/vllm",
    "VLLM_CONFIG_ROOT": f"{CACHE_DIR}/vllm-config",
    "TORCHINDUCTOR_CACHE_DIR": f"{CACHE_DIR}/torchinductor",
    "TRITON_CACHE_DIR": f"{CACHE_DIR}/triton",
    "CUDA_CACHE_PATH": f"{CACHE_DIR}/nv",
    "NUMBA_CACHE_DIR": f"{CACHE_DIR}/numba",
    "OUTLINES_CACHE_DIR": f"{CACHE_DIR}/outlines",
    "HF_HOME": f"{MODEL_CACHE_DIR}/huggingface",
}


def _engine_env(spec: s.MineDraftSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        *({"name": k, "value": v} for k, v in WRITABLE_ENV.items()),
        {"name": "VLLM_LOGGING_STREAM", "value": "ext://sys.stderr"},
        # `minedraft serve` reports it as its replica id.
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    tokens = {m.source.hugging_face_token for m in (spec.target, spec.draft) if m.source.hugging_face_token}
    if tokens:
        # One process downloads both models, so one token (the parser rejects two different ones).
        token = sorted(tokens, key=lambda t: (t.name, t.key))[0]
        # A secretKeyRef: the kubelet reads the Secret, the operator never does.
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}}})
    # The user's own variables last: they may override ours (e.g. VLLM_* tuning), knowingly.
    return env + [dict(e) for e in spec.engine.env]


def engine_gpus(spec: s.MineDraftSpec) -> int:
    """nvidia.com/gpu per engine pod: the target's, plus the drafter's own only for modes that draft on it."""
    own_drafter = spec.needs_drafter_gpu and spec.drafter_pool is None
    return spec.engine.target_gpus + (spec.engine.drafter_gpus if own_drafter else 0)


STARTUP_PERIOD_SECONDS = 10


def engine_probes(spec: s.MineDraftSpec) -> dict[str, dict[str, Any]]:
    """The engine container's probes, each asking the question its kind means.

    startup: has the model loaded (readiness service)? Its window is the MineDraft's startupTimeoutSeconds: a load
    that never finishes is restarted after that long, never sooner. liveness (after startup): does the process's
    event loop answer (the liveness service, SERVING through busy periods and drains)? Its window outlasts the
    termination grace period, so neither a slow replica under load nor a long drain is killed; a hung process is.
    readiness: loaded, engine loop alive and not draining: traffic stops at once on drain.
    """
    eng = spec.engine
    grace = eng.termination_grace_period_seconds
    return {
        "startupProbe": {**_grpc_check(ENGINE_GRPC_PORT, READINESS_SERVICE), "periodSeconds": STARTUP_PERIOD_SECONDS,
                         "failureThreshold": max(1, -(-eng.startup_timeout_seconds // STARTUP_PERIOD_SECONDS)),
                         "timeoutSeconds": 5},
        "readinessProbe": {**_grpc_check(ENGINE_GRPC_PORT, READINESS_SERVICE), "periodSeconds": 5,
                           "failureThreshold": 2, "timeoutSeconds": 5},
        "livenessProbe": {**_grpc_check(ENGINE_GRPC_PORT, LIVENESS_SERVICE), "periodSeconds": LIVENESS_PERIOD_SECONDS,
                          "failureThreshold": max(6, -(-grace // LIVENESS_PERIOD_SECONDS) + 1), "timeoutSeconds": 10},
    }


def engine_deployment(spec: s.MineDraftSpec, meta: s.ObjectMeta, options: RenderOptions | None = None) -> Manifest:
    eng = spec.engine
    options = options or RenderOptions()
    gpus = str(engine_gpus(spec))
    volumes, mounts = _engine_volumes(spec)
    volumes, mounts = volumes + _drafter_token_volumes(spec, meta), mounts + _drafter_token_mounts(spec)
    if engines_need_token(spec):
        volume, mount = _internal_volume(meta)
        volumes, mounts = [*volumes, volume], [*mounts, mount]
    if accepts_previous_credential(spec):
        volume, mount = _auth_volume(spec)
        volumes, mounts = [*volumes, volume], [*mounts, mount]
    requests = {"cpu": eng.cpu, "memory": eng.memory, "nvidia.com/gpu": gpus}
    limits = {"memory": eng.memory, "nvidia.com/gpu": gpus}
    _request_local_disk(eng, requests, limits)
    container = {
        "name": "engine",
        # render() fills in the operator's image; called on its own, the built-in default.
        "image": eng.image or RenderOptions().image("engine"),
        "imagePullPolicy": eng.image_pull_policy,
        "command": engine_command(spec, meta),
        "ports": [{"name": "grpc", "containerPort": ENGINE_GRPC_PORT, "protocol": "TCP"},
                  *([{"name": "http", "containerPort": spec.engine_http_port, "protocol": "TCP"}]
                    if spec.engine_http_port else []),
                  {"name": "metrics", "containerPort": ENGINE_METRICS_PORT, "protocol": "TCP"}],
        "env": _engine_env(spec),
        "resources": {"requests": requests, "limits": limits},
        **engine_probes(spec),
        # A crash (e.g. vLLM refusing an extraArgs flag) leaves its last log lines as the termination message,
        # which the operator copies into the MineDraft's Progressing condition.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
        "volumeMounts": mounts,
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": _pod_security(options.pod_fs_group),
        # Engines never call the Kubernetes API.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": eng.termination_grace_period_seconds,
        **_gpu_placement(eng),
    }
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    labels = _labels(meta, "engine")
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(meta, names(meta)["engine"], "engine"),
        "spec": {
            "replicas": spec.desired_replicas,
            # Its own component only (selectors are immutable: the operator replaces a Deployment whose selector
            # differs from this one).
            "selector": {"matchLabels": selector_labels(meta, "engine")},
            "strategy": engine_strategy(eng),
            "template": {
                "metadata": {"labels": labels,
                             "annotations": {"kubectl.kubernetes.io/default-container": "engine"}},
                "spec": pod_spec,
            },
        },
    }


def _request_local_disk(eng: s.EngineSpec, requests: dict[str, Any], limits: dict[str, Any]) -> None:
    if eng.ephemeral_storage is not None:
        requests["ephemeral-storage"] = limits["ephemeral-storage"] = eng.ephemeral_storage
    elif not eng.model_cache.claim_name:
        # The emptyDir cache lives on the node's disk: without a request the scheduler may place the pod where it
        # does not fit, and the kubelet evicts it once downloads fill the disk (the sizeLimit alone only evicts).
        requests["ephemeral-storage"] = eng.model_cache.size_limit


def _gpu_placement(eng: s.EngineSpec) -> dict[str, Any]:
    """Where pods that use GPUs go: the engine's node selector, tolerations, affinity, priority and runtime class
    (GPU nodes are often tainted and need the nvidia runtime class), for the drafter pool's GPU pods too."""
    out: dict[str, Any] = {}
    if eng.node_selector:
        out["nodeSelector"] = dict(eng.node_selector)
    if eng.tolerations:
        out["tolerations"] = [dict(t) for t in eng.tolerations]
    if eng.affinity:
        out["affinity"] = dict(eng.affinity)
    if eng.priority_class_name:
        out["priorityClassName"] = eng.priority_class_name
    if eng.runtime_class_name:
        out["runtimeClassName"] = eng.runtime_class_name
    return out


def _node_choice(eng: s.EngineSpec) -> dict[str, Any]:
    """The engine's node selector and tolerations alone (pods that use no GPU but must run on the same kind of node)."""
    placement = _gpu_placement(eng)
    return {key: placement[key] for key in ("nodeSelector", "tolerations") if key in placement}


def engine_strategy(eng: s.EngineSpec) -> dict[str, Any]:
    """Surge: a new pod must be ready before an old one goes (rollouts never drop capacity; without spare GPUs the
    new pod waits Pending, forever in a full pool). Replace: an old pod goes first, freeing its GPUs."""
    if eng.rollout_strategy == "Replace":
        return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def engine_service(spec: s.MineDraftSpec, meta: s.ObjectMeta) -> Manifest:
    """Headless: the gateway discovers each engine pod through its EndpointSlices and balances per stream."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(meta, names(meta)["engine"], "engine"),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(meta, "engine"),
            "ports": [{"name": "grpc", "port": ENGINE_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"},
                      *([{"name": "http", "port": spec.engine_http_port, "targetPort": "http", "protocol": "TCP",
                          "appProtocol": "http"}] if spec.engine_http_port else []),
                      {"name": "metrics", "port": ENGINE_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}],
        },
    }


def engine_pdb(meta: s.ObjectMeta, component: str = "engine") -> Manifest:
    # maxUnavailable rather than minAvailable: a one-replica MineDraft can still be drained.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(meta, names(meta)[component], component),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(meta, component)}},
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
    """Only this MineDraft's gateway reaches the engines' gRPC port (every client, when it runs without a gateway);
    only the metrics scrapers their metrics port. (The kubelet's probes come from the node, which NetworkPolicies
    always admit.)"""
    grpc: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": ENGINE_GRPC_PORT}]}
    if spec.gateway.enabled:
        grpc = {"from": [{"podSelector": {"matchLabels": selector_labels(meta, "gateway")}}], **grpc}
    elif spec.engine_http_port:
        # Without MineDraft's gateway clients call the engines directly, over
        # gRPC or HTTP. With it, the gateway speaks gRPC to engines and nothing needs their HTTP port.
        grpc["ports"].append({"protocol": "TCP", "port": spec.engine_http_port})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(meta, names(meta)["engine"], "engine"),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(meta, "engine")},
            "policyTypes": ["Ingress"],
            "ingress": [
                grpc,
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


def may_scale_to_zero(spec: s.MineDraftSpec) -> bool:
    return spec.autoscaling is not None and spec.autoscaling.min_replicas == 0


def engine_wait_timeout_seconds(spec: s.MineDraftSpec) -> int:
    """How long a stream waits at the gateway for an engine: a whole cold start (the engine's startup window plus
    scheduling and image pull), so the first request after zero replicas, or after every engine restarted, is served
    rather than refused while the engine it woke is still loading."""
    return spec.engine.startup_timeout_seconds + ENGINE_COLD_START_MARGIN_SECONDS


def gateway_command(spec: s.MineDraftSpec, meta: s.ObjectMeta) -> list[str]:
    gw = spec.gateway
    cmd = ["minedraft", "gateway",
           "--host", "0.0.0.0",
           "--port", str(GATEWAY_GRPC_PORT),
           "--metrics-port", str(GATEWAY_METRICS_PORT),
           "--kubernetes-service", f"{meta.namespace}/{names(meta)['engine']}",
           "--kubernetes-port-name", "grpc",
           "--max-in-flight", str(gw.max_in_flight),
           "--grace-seconds", str(GATEWAY_GRACE_SECONDS),
           "--engine-wait-timeout-s", str(engine_wait_timeout_seconds(spec))]
    if may_scale_to_zero(spec):
        # At zero engines the gateway must still be ready, or the Service (kube-proxy, a cloud load balancer)
        # refuses the first request before it reaches a gateway, and nothing ever wakes the engines.
        cmd.append("--ready-without-engines")
    if gw.http_port:
        cmd += ["--http-port", str(GATEWAY_HTTP_PORT)]
    if spec.served_model_names:
        cmd += ["--served-model-name", *spec.served_model_names]
    if gw.auth_token is not None:
        cmd += ["--token-file", auth_token_path(spec)]  # the clients' tokens, for clients only
    # What the gateway presents to engines: the internal credential's first token (re-read when it changes); an
    # engine of the previous release, which refuses it, is offered the clients' token next (its own credential).
    cmd += ["--engine-token-file", INTERNAL_TOKEN_PATH]
    if accepts_previous_credential(spec):
        cmd += ["--engine-token-file", auth_token_path(spec)]
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


def gateway_probes(spec: s.MineDraftSpec) -> dict[str, dict[str, Any]]:
    """liveness: the process answers (never whether an engine is up: engines load for minutes, and a gateway
    restarted meanwhile helps nobody); readiness: at least one engine to route to, or, for a MineDraft that may
    scale to zero (--ready-without-engines), able to accept and hold streams until one is. No startup probe: the
    gateway binds its port within seconds, well inside the liveness window.

    With TLS on, kubelet gRPC probes cannot do the handshake: liveness becomes a TCP connect (the process accepts
    connections), and readiness too (a weaker signal: a stream that finds no engine waits for one, bounded).
    """
    if spec.gateway.tls_secret_name is not None:
        live: dict[str, Any] = {"tcpSocket": {"port": GATEWAY_GRPC_PORT}}
        # The HTTP API serves /ready (same meaning as the gRPC readiness) and kubelet HTTPS probes skip certificate
        # checks: a real readiness signal over TLS when the HTTP port is on.
        ready: dict[str, Any] = ({"httpGet": {"path": "/ready", "port": GATEWAY_HTTP_PORT, "scheme": "HTTPS"}}
                                 if spec.gateway.http_port else {"tcpSocket": {"port": GATEWAY_GRPC_PORT}})
    else:
        live = _grpc_check(GATEWAY_GRPC_PORT, LIVENESS_SERVICE)
        ready = _grpc_check(GATEWAY_GRPC_PORT, READINESS_SERVICE)
    return {"readinessProbe": {**ready, "periodSeconds": 5, "failureThreshold": 2, "timeoutSeconds": 3},
            "livenessProbe": {**live, "periodSeconds": 10, "failureThreshold": 4, "timeoutSeconds": 5}}


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
        volume, mount = _auth_volume(spec)
        volumes.append(volume)
        mounts.append(mount)
    volume, mount = _internal_volume(meta)
    volumes.append(volume)
    mounts.append(mount)
    if gw.tls_secret_name is not None:
        volumes.append({"name": "tls", "secret": {"secretName": gw.tls_secret_name, "defaultMode": 0o440}})
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
    container = {
        "name": "gateway",
        "image": gw.image or RenderOptions().image("gateway"),
        "imagePullPolicy": gw.image_pull_policy,
        "command": gateway_command(spec, meta),
        "ports": [{"name": "grpc", "containerPort": GATEWAY_GRPC_PORT, "protocol": "TCP"},
                  *([{"name": "http", "containerPort": GATEWAY_HTTP_PORT, "protocol": "TCP"}]
                    if gw.http_port else []),
                  {"name": "metrics", "containerPort": GATEWAY_METRICS_PORT, "protocol": "TCP"}],
        "env": [{"name": "HOME", "value": TMP_DIR}],
        "resources": {"requests": {"cpu": gw.cpu, "memory": gw.memory}, "limits": {"memory": gw.memory}},
        **gateway_probes(spec),
        "terminationMessagePolicy": "FallbackToLogsOnError",
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
                    **({"imagePullSecrets": [{"name": n} for n in spec.image_pull_secrets]}
                       if spec.image_pull_secrets else {}),
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
                       "appProtocol": "grpc"},
                      *([{"name": "http", "port": spec.gateway.http_port, "targetPort": "http", "protocol": "TCP",
                          "appProtocol": "http"}] if spec.gateway.http_port else [])],
        },
    }


def engine_endpoint(meta: s.ObjectMeta) -> str:
    return f"{names(meta)['engine']}.{meta.namespace}.svc:{ENGINE_GRPC_PORT}"


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


# -- drafter pool ----------------------------------------------------------------------------------------------------

DRAFTER_TOKEN_DIR = "/etc/minedraft/drafter-token"
DRAFTER_METRICS_PORT = s.DRAFTER_METRICS_PORT


def _drafter_token_volumes(spec: s.MineDraftSpec, meta: s.ObjectMeta) -> list[dict[str, Any]]:
    if spec.drafter_pool is None:
        return []
    token = pool_token(spec, meta)
    # Mounted, never in an environment variable or the command line: the token stays out of `kubectl describe`.
    return [{"name": "drafter-token", "secret": {"secretName": token.name, "defaultMode": 0o440,
                                                 "items": [{"key": token.key, "path": "token"}]}}]


def _drafter_token_mounts(spec: s.MineDraftSpec) -> list[dict[str, Any]]:
    if spec.drafter_pool is None:
        return []
    return [{"name": "drafter-token", "mountPath": DRAFTER_TOKEN_DIR, "readOnly": True}]


def drafter_command(spec: s.MineDraftSpec) -> list[str]:
    pool = spec.drafter_pool
    assert pool is not None
    cmd = ["minedraft", "drafter", "--host", "0.0.0.0", "--port", str(pool.port),
           "--model", _model_location("draft", spec.draft), "--token-file", f"{DRAFTER_TOKEN_DIR}/token",
           "--backend", pool.backend, "--max-queued-jobs", str(pool.max_queued_jobs),
           "--metrics-port", str(DRAFTER_METRICS_PORT),
           # From bounds (maxNumSeqs, autoscaling.maxReplicas), never the live replica count: the pod template stays
           # the same when the engines scale, so the pool does not roll (and break its sessions) on every decision.
           "--max-num-seqs", str(s.pool_max_num_seqs(spec)),
           # Always passed: `auto` resolves in the drafter as the engines resolve it (a 16-bit dtype on a GPU).
           "--dtype", spec.engine.dtype]
    if pool.backend == "torch" and pool.gpus:
        cmd += ["--device", "cuda"]
    if pool.window:
        cmd += ["--window", str(pool.window)]
    if spec.engine.max_model_len is not None:
        cmd += ["--max-model-len", str(spec.engine.max_model_len)]
    overrides = _target_hf_overrides(spec.engine)
    if overrides is not None:
        # A target stretched by RoPE scaling needs a drafter that reads positions the same way and as far; the
        # drafter keeps only the context-stretching keys of the target's overrides.
        cmd += ["--hf-overrides", overrides]
    return cmd


def _target_hf_overrides(eng: s.EngineSpec) -> str | None:
    """The value of `--hf-overrides` in the engine's extraArgs (None without one)."""
    for word in s.split_extra_args(eng.extra_args):
        flag, _, value = word.partition("=")
        if flag.replace("_", "-") == "--hf-overrides" and value:
            return value
    return None


def drafter_replicas(spec: s.MineDraftSpec) -> int:
    """Pool pods to run: none while the engines are scaled to zero (their GPUs are freed too; the pool starts again
    with the first engine, which decodes without drafts until it is up), else the pool's own count."""
    assert spec.drafter_pool is not None
    if spec.desired_replicas == 0 and may_scale_to_zero(spec):
        return 0
    return spec.drafter_pool.desired_replicas


def drafter_deployment(spec: s.MineDraftSpec, meta: s.ObjectMeta, options: RenderOptions | None = None) -> Manifest:
    """The drafter pool: `minedraft drafter` on its own GPUs, shared by every engine replica."""
    pool = spec.drafter_pool
    assert pool is not None
    options = options or RenderOptions()
    volumes, mounts = _engine_volumes(spec, drafter=True)
    volumes, mounts = volumes + _drafter_token_volumes(spec, meta), mounts + _drafter_token_mounts(spec)
    requests: dict[str, Any] = {"cpu": pool.cpu, "memory": pool.memory}
    limits: dict[str, Any] = {"memory": pool.memory}
    if pool.gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(pool.gpus)
    if not spec.engine.model_cache.claim_name:
        # Its emptyDir cache on the node's disk, sized for the draft (the engines' own request is for the target).
        requests["ephemeral-storage"] = pool.model_cache_size_limit
    # The service binds its port once the draft model is loaded: an open port is readiness.
    tcp = {"tcpSocket": {"port": pool.port}}
    container = {
        "name": "drafter",
        # The engine's image (it has the drafter's dependencies); render() fills in the operator's.
        "image": spec.engine.image or RenderOptions().image("engine"),
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": drafter_command(spec),
        "ports": [{"name": "drafter", "containerPort": pool.port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": DRAFTER_METRICS_PORT, "protocol": "TCP"}],
        "env": [e for e in _engine_env(spec) if e["name"] != "POD_NAME"],
        "resources": {"requests": requests, "limits": limits},
        "startupProbe": {**tcp, "periodSeconds": STARTUP_PERIOD_SECONDS,
                         "failureThreshold": max(1, -(-spec.engine.startup_timeout_seconds // STARTUP_PERIOD_SECONDS))},
        "readinessProbe": {**tcp, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**tcp, "periodSeconds": LIVENESS_PERIOD_SECONDS, "failureThreshold": 6},
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
        "volumeMounts": mounts,
    }
    pod_spec: dict[str, Any] = {
        # The model cache may be a claim it writes: the engine pods' fsGroup.
        "containers": [container], "volumes": volumes, "securityContext": _pod_security(options.pod_fs_group),
        "automountServiceAccountToken": False, "enableServiceLinks": False,
        # A GPU pool goes where the engines go (their GPU nodes' taints, runtime class, affinity and priority); a CPU
        # pool keeps to the nodes the engines' selector and tolerations name (architecture, zone), nothing more.
        **(_gpu_placement(spec.engine) if pool.gpus else _node_choice(spec.engine)),
    }
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(meta, names(meta)["drafter"], "drafter"),
        "spec": {
            "replicas": drafter_replicas(spec),
            "selector": {"matchLabels": selector_labels(meta, "drafter")},
            # A GPU pool rolls as the engines do (Replace where no spare GPU is free for a surge pod); a CPU pool
            # surges.
            "strategy": engine_strategy(spec.engine) if pool.gpus else engine_strategy(
                replace(spec.engine, rollout_strategy="Surge")),
            "template": {"metadata": {"labels": _labels(meta, "drafter")}, "spec": pod_spec},
        },
    }


def drafter_service(spec: s.MineDraftSpec, meta: s.ObjectMeta) -> Manifest:
    pool = spec.drafter_pool
    assert pool is not None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(meta, names(meta)["drafter"], "drafter"),
        "spec": {"type": "ClusterIP", "selector": selector_labels(meta, "drafter"),
                 "ports": [{"name": "drafter", "port": pool.port, "targetPort": pool.port, "protocol": "TCP"}]},
    }


def drafter_network_policy(spec: s.MineDraftSpec, meta: s.ObjectMeta, options: RenderOptions) -> Manifest:
    """Only this MineDraft's engine pods reach the drafter pool, and only the metrics scrapers its metrics port (the
    kubelet's TCP probes come from the node, which NetworkPolicies always admit)."""
    pool = spec.drafter_pool
    assert pool is not None
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(meta, names(meta)["drafter"], "drafter"),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(meta, "drafter")},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": selector_labels(meta, "engine")}}],
                         "ports": [{"protocol": "TCP", "port": pool.port}]},
                        {"from": _metrics_scrapers(spec, options),
                         "ports": [{"protocol": "TCP", "port": DRAFTER_METRICS_PORT}]}],
        },
    }


def drafter_pod_monitor(meta: s.ObjectMeta) -> Manifest:
    """The drafter pool's metrics (minedraft_drafter_*), scraped like the engines'."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _metadata(meta, names(meta)["drafter"], "monitoring"),
        "spec": {
            "selector": {"matchLabels": selector_labels(meta, "drafter")},
            "podMetricsEndpoints": [{"port": "metrics", "interval": "15s"}],
        },
    }


def render(spec: s.MineDraftSpec, meta: s.ObjectMeta, options: RenderOptions | None = None) -> list[Manifest]:
    """Every object of one MineDraft, in apply order (RBAC before the pods that use it)."""
    options = options or RenderOptions()
    spec = with_images(spec, options)
    manifests = [engine_service(spec, meta), engine_deployment(spec, meta, options)]
    if spec.engine.pod_disruption_budget:
        manifests.append(engine_pdb(meta))
    if spec.gateway.enabled:
        manifests += [
            gateway_service_account(meta),
            gateway_role(meta),
            gateway_role_binding(meta),
            gateway_service(spec, meta),
            gateway_deployment(spec, meta),
        ]
    if options.network_policy:
        manifests.append(engine_network_policy(spec, meta, options))
        if spec.gateway.enabled:
            manifests.append(gateway_network_policy(spec, meta, options))
    if spec.drafter_pool is not None:
        manifests += [drafter_service(spec, meta), drafter_deployment(spec, meta, options)]
        if spec.engine.pod_disruption_budget:
            # A node drain takes one pool pod at a time (engines decode without drafts meanwhile, never all at once).
            manifests.append(engine_pdb(meta, "drafter"))
        if options.network_policy:
            manifests.append(drafter_network_policy(spec, meta, options))
        if options.monitoring:
            manifests.append(drafter_pod_monitor(meta))
    if options.monitoring:
        manifests.append(pod_monitor(meta))
    return manifests


def all_kinds_and_names(meta: s.ObjectMeta) -> list[tuple[str, str]]:
    """Every (kind, name) the operator may create for one MineDraft under any spec and options: what is not rendered
    now is deleted (after checking that this MineDraft owns it)."""
    n = names(meta)
    return [("Service", n["engine"]), ("Deployment", n["engine"]), ("PodDisruptionBudget", n["engine"]),
            ("ServiceAccount", n["gateway"]), ("Role", n["gateway"]), ("RoleBinding", n["gateway"]),
            ("Service", n["gateway"]), ("Deployment", n["gateway"]), ("NetworkPolicy", n["engine"]),
            ("NetworkPolicy", n["gateway"]), ("PodMonitor", n["monitor"]),
            ("Service", n["drafter"]), ("Deployment", n["drafter"]), ("NetworkPolicy", n["drafter"]),
            ("PodMonitor", n["drafter"]), ("PodDisruptionBudget", n["drafter"])]


def render_resource(resource: Mapping[str, Any], options: RenderOptions | None = None) -> list[Manifest]:
    """Render a whole MineDraft object as read from YAML or the API (raises SpecError on a bad spec)."""
    return render(s.parse_spec(resource.get("spec")), s.parse_meta(resource.get("metadata") or {}), options)
