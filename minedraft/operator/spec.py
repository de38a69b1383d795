"""The MineDraft custom resource's spec as plain dataclasses, parsed and checked without any I/O.

The CRD's structural schema and CEL rules reject most bad input at the API server; this parser repeats the checks
that matter for rendering (so `minedraft operator render` gives the same answer offline) and names the field of
every error, e.g. ``spec.speculation.numSpeculativeTokens: must be between 1 and 16``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

API_GROUP = "minedraft.io"
API_VERSION = "v1alpha1"
KIND = "MineDraft"
PLURAL = "minedrafts"

MODES = ("psd", "sd", "lookahead", "ar", "vllm-sd", "auto")
# The modes `auto` switches between at run time (the engine's --auto-modes); vllm-sd is vLLM's own, fixed at start.
# All four by default, as `minedraft serve` allows them.
AUTO_MODES = ("psd", "sd", "lookahead", "ar")
# Modes whose drafter runs in a process of its own and needs a GPU of its own next to the target's (lookahead
# pre-drafts the next round while the target verifies, like psd: on a device of its own, or a drafterPool).
DRAFTER_GPU_MODES = ("psd", "sd", "lookahead")
# Modes that keep extra drafts for top-C selection (numExtraDraftTokens): lookahead drafts exactly k per branch.
EXTRA_DRAFT_MODES = ("psd", "sd")
# Modes whose engines can run psd steps (fixed, switched to, or chosen by auto): where asyncSteps means something.
ASYNC_STEP_MODES = ("psd", "sd", "auto")
DRAFTER_BACKENDS = ("vllm", "torch")
# Lookahead's most branches (accepted length x bonus token) pre-drafted per request per round: the engine's
# --lookahead-fanout bounds (engine/settings.py MAX_LOOKAHEAD_FANOUT; unset, the engine's own default applies).
MIN_LOOKAHEAD_FANOUT = 1
MAX_LOOKAHEAD_FANOUT = 16
DTYPES = ("auto", "bfloat16", "float16", "float32")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
# How engine rollouts replace pods: Surge starts a new pod before an old one goes (needs a spare pod's GPUs: in a
# full GPU pool the new pod stays Pending and the rollout never ends); Replace stops one old pod first (one replica's
# capacity is missing while the new one loads, and no spare GPUs are needed).
ROLLOUT_STRATEGIES = ("Surge", "Replace")

# Draft length bounds: k=0 is plain decoding (mode ar), and past 16 acceptance of the last positions is negligible
# for any real pair while the verify cost keeps growing.
MIN_SPECULATIVE_TOKENS = 1
MAX_SPECULATIVE_TOKENS = 16
MAX_EXTRA_DRAFT_TOKENS = 16
# Target GPUs are the target's tensor-parallel size; one node has at most 8 GPUs and the drafter needs one more.
MAX_TARGET_GPUS = 8
MAX_REPLICAS = 1000
# A replica's capacity prior below one output token/s is a unit mistake (tokens per minute, or per request), not a
# deployment: refused rather than planned for.
MIN_REPLICA_CAPACITY_TOKENS_PER_SECOND = 1.0
# Context length bounds (vLLM's max_model_len): below 16 nothing useful fits; above 2^24 no model has been trained.
MIN_MODEL_LEN = 16
MAX_MODEL_LEN = 1 << 24
# Flags the operator sets itself on `minedraft serve` from the MineDraft's own fields, and vLLM arguments the engine
# sets or refuses (they break its one-schedule-one-update cycle): extraArgs must not carry them.
RESERVED_ENGINE_FLAGS = ("--host", "--grpc-port", "--metrics-port", "--grace-seconds", "--model", "--draft", "--mode",
                         "--num-speculative-tokens", "--num-extra-draft-tokens", "--drafter-gpu", "--drafter-backend",
                         "--max-num-seqs", "--max-num-seqs-from-kv", "--max-model-len", "--dtype",
                         "--tensor-parallel-size", "-tp", "--target-gpus", "--max-num-speculative-tokens",
                         "--auto-modes", "--auto-k", "--lookahead-fanout",
                         "--speculative-config", "--scheduler-cls", "--pipeline-parallel-size", "-pp",
                         "--data-parallel-size", "-dp", "--async-scheduling", "--served-model-name", "--token-file",
                         "--http-port")
# RESERVED_ENGINE_FLAGS as admission spells them: each also with '_' for '-' inside its name (vLLM's parser takes
# --max_model_len for --max-model-len). A list, not a regular expression: the API server prices a regex over every
# extraArgs item by the item's and the pattern's lengths, close to its cost limit for a CRD; the parser also catches
# mixed spellings (--max_model-len).
RESERVED_FLAG_SPELLINGS = tuple(dict.fromkeys(
    spelling for f in RESERVED_ENGINE_FLAGS
    for spelling in ((f, "--" + f[2:].replace("-", "_")) if f.startswith("--") else (f,))))
# extraArgs that are `minedraft serve` flags of their own (the engine sets these vLLM arguments itself from them):
# passed as they are, not as --vllm-arg.
ENGINE_OWN_EXTRA_FLAGS = ("--gpu-memory-utilization", "--drafter-gpu-memory-utilization", "--seed",
                          "--draft-deadline-seconds", "--no-lookahead-backups")

# The operator's own default for where the images are, when neither its --image-registry nor the chart's
# image.registry says (`make push REGISTRY=...` pushes them; nothing publishes them here), and their tag: the package
# version, as `make images` tags them (a test checks pyproject.toml, the chart and the Makefile agree).
DEFAULT_IMAGE_REGISTRY = "ghcr.io/minedraft"
IMAGE_TAG = "0.1.0"

# Ports of the engine container that are not MineDraft fields (the engine Service carries them too): the engine's
# httpPort must be neither.
ENGINE_GRPC_PORT = 50051
ENGINE_METRICS_PORT = 9400
DEFAULT_ENGINE_HTTP_PORT = 8000
# Most GPUs one node holds (8 on every GPU node type sold today): a pod asking for more stays Pending forever.
MAX_GPUS_PER_POD = 8

_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
# A Hugging Face repository id, [namespace/]name of letters, digits, '-', '_' and '.': a URL or a name with spaces
# would pass on to the engine and fail its download at every start.
HUB_ID_PATTERN = r"^[A-Za-z0-9_][-A-Za-z0-9_.]*(/[A-Za-z0-9_][-A-Za-z0-9_.]*)?$"
_HUB_ID = re.compile(HUB_ID_PATTERN)
MAX_HUB_ID_LENGTH = 256
# Object names (Secrets, PVCs, RuntimeClasses, PriorityClasses): RFC 1123 subdomains, as the API server checks them.
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]+(-+[a-z0-9]+)*(\.[a-z0-9]+(-+[a-z0-9]+)*)*$"
_DNS_SUBDOMAIN = re.compile(DNS_SUBDOMAIN_PATTERN)
# Keys of a Secret's data (the API server's IsConfigMapKey: these characters, and not ".", ".." or "..anything",
# which a Secret volume's item path refuses too).
SECRET_KEY_PATTERN = r"^([-_a-zA-Z0-9]|\.[-_a-zA-Z0-9])[-._a-zA-Z0-9]*$"
_SECRET_KEY = re.compile(SECRET_KEY_PATTERN)
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
# Label keys ([prefix/]name: a DNS subdomain prefix, a name of at most 63 characters) and values (at most 63), as
# the API server checks nodeSelector entries; and Toleration's enums.
LABEL_KEY_PATTERN = (r"^([a-z0-9]+(-+[a-z0-9]+)*([.][a-z0-9]+(-+[a-z0-9]+)*)*/)?"
                     r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$")
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
_LABEL_KEY = re.compile(LABEL_KEY_PATTERN)
_LABEL_VALUE = re.compile(LABEL_VALUE_PATTERN)
TOLERATION_OPERATORS = ("Exists", "Equal")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
# The sources of an EnvVar's valueFrom (core/v1 EnvVarSource), exactly one per variable.
ENV_VALUE_SOURCES = ("fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef")
# The drafter pool's own metrics port (its `port` must differ).
DRAFTER_METRICS_PORT = 9402
MAX_GATEWAY_IN_FLIGHT = 1_000_000
MAX_DRAFTER_WINDOW = 1_000_000
# A served model name (OpenAI's `model`): any printable text without spaces, e.g. qwen3-8b or Qwen/Qwen3-8B.
SERVED_NAME_PATTERN = r"^[!-,.-~][!-~]{0,255}$"
_SERVED_NAME = re.compile(SERVED_NAME_PATTERN)
MAX_SERVED_MODEL_NAMES = 16
# An engine environment variable's value (bounded so the CEL rules that read it have a price the API server accepts).
MAX_ENV_VALUE_LENGTH = 1 << 20
# Tensor-parallel sizes that divide the KV heads of every 8-KV-head model (most served models have 8): 3, 5, 6 and 7
# divide none, and vLLM refuses them only after the GPUs are allocated.
TARGET_TP_SIZES = (1, 2, 4, 8)
# The pool's requests per pod with fixed engine replicas and no drafterPool.maxNumSeqs: four engines' batches.
DEFAULT_POOL_ENGINES_PER_POD = 4
MAX_POOL_NUM_SEQS = 1 << 16
# What the windowed torch drafter keeps besides the window (torch_window's attention sinks).
DRAFTER_SINK_TOKENS = 4
# Service names are DNS-1035 labels: a letter first (a Service named "7b-engine" is refused).
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_ENV_NAME = re.compile(ENV_NAME_PATTERN)
# Room for the longest suffix we add ("-gateway") within a 63-character DNS label (Services need labels).
MAX_NAME_LENGTH = 63 - len("-gateway")


class SpecError(ValueError):
    """A spec that cannot be rendered; ``errors`` holds one ``field: message`` line per problem."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


@dataclass(frozen=True)
class SecretKeyRef:
    """A key of a Secret in the MineDraft's namespace; only the name travels, never the value."""

    name: str
    key: str


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: exactly one of a Hugging Face id, a PVC path or a path inside the image."""

    hugging_face_id: str | None = None
    hugging_face_token: SecretKeyRef | None = None
    pvc_claim_name: str | None = None
    pvc_path: str = ""
    image_path: str | None = None


@dataclass(frozen=True)
class ModelSpec:
    source: ModelSource


@dataclass(frozen=True)
class SpeculationSpec:
    # auto, as `minedraft serve` defaults to: the engine picks the mode and k from its measured costs.
    mode: str = "auto"
    num_speculative_tokens: int = 3
    num_extra_draft_tokens: int = 0
    # speculation.asyncSteps: psd steps scheduled while the target computes the step before (the engine's
    # --async-psd-steps), at any targetGPUs.
    async_steps: bool = False
    # speculation.lookaheadFanout: lookahead's most branches per request per round (--lookahead-fanout), for mode
    # lookahead or auto allowed to choose it; None: the engine's default.
    lookahead_fanout: int | None = None


@dataclass(frozen=True)
class ModelCacheSpec:
    """Where vLLM keeps downloaded weights and compile caches: a PVC when set, else an emptyDir of size_limit."""

    size_limit: str = "100Gi"
    claim_name: str | None = None


@dataclass(frozen=True)
class EngineSpec:
    # None: the operator's engine image (<its image registry>/engine:<its image tag>).
    image: str | None = None
    image_pull_policy: str = "IfNotPresent"
    target_gpus: int = 1
    drafter_gpus: int = 1
    cpu: str = "8"
    memory: str = "64Gi"
    shm_size: str = "16Gi"
    # Node-local scratch (logs, /tmp, compile caches) requested and capped per pod; unset: no request.
    ephemeral_storage: str | None = None
    dtype: str = "auto"
    drafter_backend: str = "vllm"
    max_num_seqs: int = 256
    # engine.maxNumSeqsFromKV.requestTokens: the engine sizes its batch from the KV its target GPU holds at this many
    # tokens per request (--max-num-seqs-from-kv), max_num_seqs its ceiling; None: max_num_seqs as it is.
    max_num_seqs_from_kv_tokens: int | None = None
    # None: the model's own context length (capped by the KV cache), i.e. no --max-model-len flag.
    max_model_len: int | None = None
    extra_args: tuple[str, ...] = ()
    # Extra container environment (core/v1 EnvVar objects, passed through as written).
    env: tuple[Mapping[str, Any], ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None
    priority_class_name: str | None = None
    runtime_class_name: str | None = None
    model_cache: ModelCacheSpec = field(default_factory=ModelCacheSpec)
    termination_grace_period_seconds: int = 120
    startup_timeout_seconds: int = 1800
    pod_disruption_budget: bool = True
    rollout_strategy: str = "Surge"
    # The engine's own OpenAI-compatible HTTP port (0: not served; None: DEFAULT_ENGINE_HTTP_PORT without the
    # gateway, closed behind it: MineDraft's gateway reaches engines over gRPC, and an open port would be a way
    # around it).
    http_port: int | None = None


@dataclass(frozen=True)
class SpeculationBounds:
    """What the autoscaling issue lets each engine choose between (passed down, not decided here)."""

    allowed_modes: tuple[str, ...] = AUTO_MODES
    min_speculative_tokens: int = 1
    max_speculative_tokens: int = 8


@dataclass(frozen=True)
class AutoscalingSpec:
    min_replicas: int = 1
    max_replicas: int = 4
    target_utilization: float = 0.8
    interval_seconds: int = 15
    scale_down_stabilization_seconds: int = 300
    max_scale_up_step: int = 2
    speculation: SpeculationBounds = field(default_factory=SpeculationBounds)
    prometheus_address: str | None = None
    # Output tokens/s one engine replica gives with its batch full, used until the autoscaler has measured a speed
    # (after an operator restart while idle, or at zero replicas). None: no prior (nothing scales up on capacity
    # until the engines have decoded something).
    replica_capacity_tokens_per_second: float | None = None


@dataclass(frozen=True)
class GatewaySpec:
    enabled: bool = True
    replicas: int = 2
    # None: the operator's gateway image (<its image registry>/gateway:<its image tag>).
    image: str | None = None
    image_pull_policy: str = "IfNotPresent"
    service_type: str = "ClusterIP"
    port: int = 50051
    # The OpenAI-compatible HTTP API's Service port (0: not served).
    http_port: int = 8080
    auth_token: SecretKeyRef | None = None
    tls_secret_name: str | None = None
    max_in_flight: int = 1024
    cpu: str = "1"
    memory: str = "1Gi"


@dataclass(frozen=True)
class DrafterPoolSpec:
    """A drafter service shared by all engine replicas (`minedraft drafter`): engines then request only the target's
    GPUs and draft through it over authenticated sessions (a shared token from a Secret)."""

    # The Secret engines and pool authenticate each other with; None: the MineDraft's operator-generated internal
    # credential (Secret <name>-internal, key token).
    token: SecretKeyRef | None
    replicas: int = 1
    gpus: int = 1
    backend: str = "vllm"
    # torch backend only: each draft step reads at most the last `window` tokens (plus 4 sink tokens); 0: all.
    window: int = 0
    cpu: str = "4"
    memory: str = "32Gi"
    # The pool's model cache when the engines' is an emptyDir (the draft's weights only: far less than the target's);
    # requested as ephemeral storage.
    model_cache_size_limit: str = "20Gi"
    max_queued_jobs: int = 64
    port: int = 50061
    # Autoscaling the pool on its own utilisation (both bounds set), apart from the engines; None: fixed `replicas`.
    min_replicas: int | None = None
    max_replicas: int | None = None
    # The busy share of each pool replica to plan for.
    target_utilization: float = 0.7
    # Requests one pool pod holds at once (all the engines it serves); None: pool_max_num_seqs's bound. Never the
    # live engine count: the pod template must not change when the engines scale.
    max_num_seqs: int | None = None
    # Memory of each pool GPU: what the torch backend's preallocated KV must fit in (checked at admission).
    gpu_memory: str = "80Gi"

    @property
    def autoscaled(self) -> bool:
        return self.min_replicas is not None and self.max_replicas is not None

    @property
    def desired_replicas(self) -> int:
        """Pool replicas to run: `replicas` (written by the pool's autoscaler), clamped into min..max when autoscaled
        (narrowed bounds take effect at once, as for the engines)."""
        if self.min_replicas is not None and self.max_replicas is not None:
            return min(max(self.replicas, self.min_replicas), self.max_replicas)
        return self.replicas


@dataclass(frozen=True)
class MineDraftSpec:
    target: ModelSpec
    draft: ModelSpec
    speculation: SpeculationSpec = field(default_factory=SpeculationSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    replicas: int | None = None
    autoscaling: AutoscalingSpec | None = None
    gateway: GatewaySpec = field(default_factory=GatewaySpec)
    # Secrets (by name, in the MineDraft's namespace) the kubelet uses to pull both images.
    image_pull_secrets: tuple[str, ...] = ()
    # The names clients address the model by (the first is its name, the others aliases); empty: the target's
    # hub id or path.
    served_model_names: tuple[str, ...] = ()
    # A shared drafter service instead of a drafter GPU in every engine pod (None: each engine drafts on its own).
    drafter_pool: DrafterPoolSpec | None = None

    @property
    def desired_replicas(self) -> int:
        """Engine replicas to run now: spec.replicas (the /scale target) else the autoscaling floor else 1.

        With autoscaling, spec.replicas is clamped into minReplicas..maxReplicas: a user who narrows the bounds after
        the autoscaler wrote replicas gets the nearest allowed count at once, not a rejected edit.
        """
        if self.autoscaling is not None:
            a = self.autoscaling
            wanted = a.min_replicas if self.replicas is None else self.replicas
            return min(max(wanted, a.min_replicas), a.max_replicas)
        return 1 if self.replicas is None else self.replicas

    @property
    def engine_http_port(self) -> int:
        """The engines' HTTP port (0: closed): as set, else open only when clients reach engines directly."""
        if self.engine.http_port is not None:
            return self.engine.http_port
        return 0 if self.gateway.enabled else DEFAULT_ENGINE_HTTP_PORT

    @property
    def needs_drafter_gpu(self) -> bool:
        """Whether the drafter runs on a GPU of its own: psd, sd and lookahead always; auto when it may pick one of
        them."""
        mode = self.speculation.mode
        if mode == "auto":
            return any(m in DRAFTER_GPU_MODES for m in self.auto_modes)
        return mode in DRAFTER_GPU_MODES

    @property
    def runs_lookahead(self) -> bool:
        return runs_lookahead(self.speculation.mode, self.auto_modes)

    @property
    def auto_modes(self) -> tuple[str, ...]:
        """The modes auto mode may choose: the autoscaling bounds' allowedModes, else all it knows."""
        if self.autoscaling is not None:
            return self.autoscaling.speculation.allowed_modes
        return AUTO_MODES

    def secret_refs(self) -> list[tuple[str, SecretKeyRef | str]]:
        """Every Secret the spec names, with the field that names it (for existence checks and their messages)."""
        refs: list[tuple[str, SecretKeyRef | str]] = []
        for role, model in (("target", self.target), ("draft", self.draft)):
            if model.source.hugging_face_token is not None:
                refs.append((f"spec.{role}.source.huggingFace.tokenSecretRef", model.source.hugging_face_token))
        if self.gateway.auth_token is not None:
            refs.append(("spec.gateway.authTokenSecretRef", self.gateway.auth_token))
        if self.gateway.tls_secret_name is not None:
            refs.append(("spec.gateway.tlsSecretRef", self.gateway.tls_secret_name))
        if self.drafter_pool is not None and self.drafter_pool.token is not None:
            refs.append(("spec.drafterPool.tokenSecretRef", self.drafter_pool.token))
        return refs


# -- parsing ---------------------------------------------------------------------------------------------------------


class _Reader:
    """Reads typed values out of nested dicts, collecting errors with field paths instead of stopping at the first."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def fail(self, path: str, message: str) -> None:
        self.errors.append(f"{path}: {message}")

    def obj(self, data: Mapping[str, Any], key: str, path: str, required: bool = False) -> Mapping[str, Any] | None:
        value = data.get(key)
        if value is None:
            if required:
                self.fail(f"{path}.{key}", "required")
            return None
        if not isinstance(value, Mapping):
            self.fail(f"{path}.{key}", "must be an object")
            return None
        return value

    def str_(self, data: Mapping[str, Any], key: str, path: str, default: str | None = None,
             required: bool = False, choices: tuple[str, ...] | None = None) -> str | None:
        value = data.get(key)
        if value is None:
            if required:
                self.fail(f"{path}.{key}", "required")
            return default
        if not isinstance(value, str) or not value:
            self.fail(f"{path}.{key}", "must be a non-empty string")
            return default
        if choices is not None and value not in choices:
            self.fail(f"{path}.{key}", f"must be one of {', '.join(choices)} (got {value!r})")
            return default
        return value

    def int_(self, data: Mapping[str, Any], key: str, path: str, default: int | None,
             low: int, high: int) -> int | None:
        value = data.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(f"{path}.{key}", "must be an integer")
            return default
        if not low <= value <= high:
            self.fail(f"{path}.{key}", f"must be between {low} and {high} (got {value})")
            return default
        return value

    def quantity(self, data: Mapping[str, Any], key: str, path: str, default: str) -> str:
        value = data.get(key, default)
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not _QUANTITY.match(value):
            self.fail(f"{path}.{key}", f"must be a Kubernetes quantity such as 8, 500m or 64Gi (got {value!r})")
            return default
        return value

    def name(self, data: Mapping[str, Any], key: str, path: str, required: bool = True) -> str | None:
        value = self.str_(data, key, path, required=required)
        if value is not None and not (_DNS_SUBDOMAIN.match(value) and len(value) <= 253):
            self.fail(f"{path}.{key}", f"must be a DNS subdomain name (got {value!r})")
            return None
        return value


def _secret_key_ref(r: _Reader, data: Mapping[str, Any] | None, path: str, default_key: str) -> SecretKeyRef | None:
    if data is None:
        return None
    name = r.name(data, "name", path)
    key = r.str_(data, "key", path, default=default_key) or default_key
    if not (_SECRET_KEY.match(key) and len(key) <= 253):
        r.fail(f"{path}.key", f"must be a Secret key (letters, digits, '-', '_', '.') (got {key!r})")
    return SecretKeyRef(name, key) if name else None


def runs_lookahead(mode: str, auto_modes: tuple[str, ...]) -> bool:
    """Whether the engines may run lookahead: mode lookahead, or auto with lookahead among its modes."""
    return mode == "lookahead" or (mode == "auto" and "lookahead" in auto_modes)


def _model(r: _Reader, data: Mapping[str, Any] | None, path: str) -> ModelSpec:
    """`data` is None when the caller already reported the model missing."""
    source = r.obj(data, "source", path, required=True) if data is not None else None
    src_path = f"{path}.source"
    kinds = [k for k in ("huggingFace", "persistentVolumeClaim", "image") if (source or {}).get(k) is not None]
    if source is not None and len(kinds) != 1:
        r.fail(src_path, "exactly one of huggingFace, persistentVolumeClaim or image must be set "
                         f"(got {', '.join(kinds) or 'none'})")
    model_source = ModelSource()
    if source is not None and len(kinds) == 1:
        kind = kinds[0]
        sub = r.obj(source, kind, src_path) or {}
        if kind == "huggingFace":
            model_source = ModelSource(
                hugging_face_id=_hub_id(r, sub, f"{src_path}.huggingFace"),
                hugging_face_token=_secret_key_ref(r, r.obj(sub, "tokenSecretRef", f"{src_path}.huggingFace"),
                                                   f"{src_path}.huggingFace.tokenSecretRef", "token"),
            )
        elif kind == "persistentVolumeClaim":
            # "" (the CRD's default, the volume's root) is a path here, unlike the names str_ reads.
            model_path = sub.get("path", "")
            if not isinstance(model_path, str):
                r.fail(f"{src_path}.persistentVolumeClaim.path", "must be a string")
                model_path = ""
            elif model_path.startswith("/") or ".." in model_path.split("/"):
                r.fail(f"{src_path}.persistentVolumeClaim.path", "must be relative to the volume, without '..'")
            model_source = ModelSource(
                pvc_claim_name=r.name(sub, "claimName", f"{src_path}.persistentVolumeClaim"),
                pvc_path=model_path,
            )
        else:
            image_path = r.str_(sub, "path", f"{src_path}.image", required=True)
            if image_path is not None and not image_path.startswith("/"):
                r.fail(f"{src_path}.image.path", "must be an absolute path inside the engine image")
            model_source = ModelSource(image_path=image_path)
    return ModelSpec(source=model_source)


def _hub_id(r: _Reader, data: Mapping[str, Any], path: str) -> str | None:
    hub_id = r.str_(data, "id", path, required=True)
    if hub_id is not None and not (_HUB_ID.match(hub_id) and len(hub_id) <= MAX_HUB_ID_LENGTH):
        r.fail(f"{path}.id", f"must be a Hugging Face repository id such as Qwen/Qwen3-8B (not a URL) (got {hub_id!r})")
        return None
    return hub_id


def _or(value: int | None, default: int) -> int:
    """The value when given (0 included), else the default: `x or default` would turn a 0 into the default."""
    return default if value is None else value


def extra_arg_flag(word: str) -> str:
    """The flag of one extraArgs word: up to the first `=` or space (`--max-model-len 4096` written as one word is
    the flag --max-model-len, as a shell would not split it but users mean it)."""
    return re.split(r"[= ]", word, maxsplit=1)[0]


def split_extra_args(args: tuple[str, ...] | list[str]) -> list[str]:
    """extraArgs as `--flag=value` words: users write vLLM flags either way (`--x 1`, `--x=1`, or one word
    `"--x 1"`) and each becomes one pass-through argument of the engine (a following word that is not a flag is the
    flag's value). A value is kept byte for byte: spaces inside it (JSON-valued flags) stay."""
    out: list[str] = []
    for word in args:
        flag = extra_arg_flag(word)
        if word.startswith("--") and len(flag) < len(word) and word[len(flag)] == " ":
            word = f"{flag}={word[len(flag) + 1:].lstrip(' ')}"
        if out and not word.startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out


def _engine_extra_args(r: _Reader, data: Mapping[str, Any], p: str) -> tuple[str, ...]:
    extra = data.get("extraArgs", [])
    if not isinstance(extra, list) or not all(isinstance(a, str) and a for a in extra):
        r.fail(f"{p}.extraArgs", "must be a list of non-empty strings")
        return ()
    for word in split_extra_args(extra):
        flag = extra_arg_flag(word)
        if not flag.startswith("--"):
            r.fail(f"{p}.extraArgs", f"{word!r} is not a vLLM engine argument (they start with --)")
        elif flag in RESERVED_ENGINE_FLAGS or flag.replace("_", "-") in RESERVED_ENGINE_FLAGS:
            r.fail(f"{p}.extraArgs", f"{flag} is set by the operator from the MineDraft's own fields; set that field "
                                     "instead")
    return tuple(extra)


def _engine_env_vars(r: _Reader, data: Mapping[str, Any], p: str) -> tuple[Mapping[str, Any], ...]:
    env = data.get("env", [])
    if not isinstance(env, list) or not all(isinstance(e, Mapping) for e in env):
        r.fail(f"{p}.env", "must be a list of objects (core/v1 EnvVar)")
        return ()
    for index, var in enumerate(env):
        name = var.get("name")
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            r.fail(f"{p}.env[{index}].name", f"must be a C identifier-like environment variable name (got {name!r})")
        if "value" in var and not isinstance(var["value"], str):
            # The API server refuses a Deployment whose env value is a number or boolean: quote it.
            r.fail(f"{p}.env[{index}].value", f"must be a string (quote it: {str(var['value'])!r}) "
                                             f"(got {type(var['value']).__name__})")
        source = var.get("valueFrom")
        if source is None:
            continue
        at = f"{p}.env[{index}].valueFrom"
        if var.get("value"):
            r.fail(at, "must not be set together with a non-empty value")
        kinds = [k for k in ENV_VALUE_SOURCES if isinstance(source, Mapping) and k in source]
        if not isinstance(source, Mapping) or len(kinds) != 1 or set(source) - set(ENV_VALUE_SOURCES):
            r.fail(at, f"must set exactly one of {', '.join(ENV_VALUE_SOURCES)}")
            continue
        ref = source[kinds[0]]
        if not isinstance(ref, Mapping):
            r.fail(f"{at}.{kinds[0]}", "must be an object")
        elif kinds[0] in ("configMapKeyRef", "secretKeyRef"):
            r.name(ref, "name", f"{at}.{kinds[0]}")
            key = r.str_(ref, "key", f"{at}.{kinds[0]}", required=True)
            if key is not None and not (_SECRET_KEY.match(key) and len(key) <= 253):
                r.fail(f"{at}.{kinds[0]}.key", f"must be a key (letters, digits, '-', '_', '.') (got {key!r})")
        elif kinds[0] == "fieldRef":
            r.str_(ref, "fieldPath", f"{at}.fieldRef", required=True)
        else:
            r.str_(ref, "resource", f"{at}.resourceFieldRef", required=True)
    return tuple(dict(e) for e in env)


def _engine_tolerations(r: _Reader, data: Mapping[str, Any], p: str) -> tuple[Mapping[str, Any], ...]:
    """core/v1 Tolerations as the API server checks them (a bad one would fail only in the derived Deployment)."""
    tolerations = data.get("tolerations", [])
    if not isinstance(tolerations, list) or not all(isinstance(t, Mapping) for t in tolerations):
        r.fail(f"{p}.tolerations", "must be a list of objects")
        return ()
    fields = {"key": str, "operator": str, "value": str, "effect": str, "tolerationSeconds": int}
    for index, t in enumerate(tolerations):
        at = f"{p}.tolerations[{index}]"
        wrong = [k for k in t if k not in fields or not isinstance(t[k], fields[k]) or isinstance(t[k], bool)]
        if wrong:
            r.fail(at, f"{', '.join(wrong)}: not a core/v1 Toleration field of that type (key, operator, value, "
                       "effect: strings; tolerationSeconds: an integer)")
            continue
        operator, key = t.get("operator", "Equal"), t.get("key", "")
        if operator not in TOLERATION_OPERATORS:
            r.fail(f"{at}.operator", f"must be one of {', '.join(TOLERATION_OPERATORS)} (got {operator!r})")
        elif operator == "Exists" and t.get("value"):
            r.fail(f"{at}.value", "must be empty when operator is Exists")
        if not key and operator != "Exists":
            r.fail(f"{at}.operator", "must be Exists when key is empty (tolerating every taint)")
        if key and not _LABEL_KEY.match(key):
            r.fail(f"{at}.key", f"must be a label key (got {key!r})")
        if t.get("effect", "") not in ("", *TAINT_EFFECTS):
            r.fail(f"{at}.effect", f"must be one of {', '.join(TAINT_EFFECTS)} (got {t['effect']!r})")
        if "tolerationSeconds" in t and t.get("effect") != "NoExecute":
            r.fail(f"{at}.tolerationSeconds", "needs effect NoExecute")
    return tuple(dict(t) for t in tolerations)


AFFINITY_KINDS = ("nodeAffinity", "podAffinity", "podAntiAffinity")


def _engine_affinity(r: _Reader, data: Mapping[str, Any], p: str) -> Mapping[str, Any] | None:
    """core/v1 Affinity: its three kinds, each an object (what lies inside is the API server's to check)."""
    affinity = r.obj(data, "affinity", p)
    if affinity is None:
        return None
    for kind, value in affinity.items():
        if kind not in AFFINITY_KINDS or not isinstance(value, Mapping):
            r.fail(f"{p}.affinity.{kind}", f"must be one of {', '.join(AFFINITY_KINDS)}, each an object")
    return affinity


def _engine(r: _Reader, data: Mapping[str, Any]) -> EngineSpec:
    p = "spec.engine"
    d = EngineSpec()
    cache = r.obj(data, "modelCache", p) or {}
    node_selector = data.get("nodeSelector", {})
    if not isinstance(node_selector, Mapping) or not all(isinstance(v, str) for v in node_selector.values()):
        r.fail(f"{p}.nodeSelector", "must map label names to strings")
        node_selector = {}
    for key, value in node_selector.items():
        if not (isinstance(key, str) and _LABEL_KEY.match(key) and len(key) <= 317 and _LABEL_VALUE.match(value)):
            r.fail(f"{p}.nodeSelector", f"{key!r}: {value!r} is not a label key and value (a value has at most 63 "
                                        "letters, digits, '-', '_' or '.', alphanumeric at both ends)")
    tolerations = _engine_tolerations(r, data, p)
    drafter_gpus = r.int_(data, "drafterGPUs", p, d.drafter_gpus, 1, 1)
    pdb = data.get("podDisruptionBudget", d.pod_disruption_budget)
    if not isinstance(pdb, bool):
        r.fail(f"{p}.podDisruptionBudget", "must be true or false")
        pdb = d.pod_disruption_budget
    ephemeral = data.get("ephemeralStorage")
    max_model_len = r.int_(data, "maxModelLen", p, None, MIN_MODEL_LEN, MAX_MODEL_LEN)
    return EngineSpec(
        image=r.str_(data, "image", p, default=d.image) or d.image,
        image_pull_policy=r.str_(data, "imagePullPolicy", p, default=d.image_pull_policy,
                                 choices=PULL_POLICIES) or d.image_pull_policy,
        target_gpus=r.int_(data, "targetGPUs", p, d.target_gpus, 1, MAX_TARGET_GPUS) or d.target_gpus,
        drafter_gpus=drafter_gpus or d.drafter_gpus,
        cpu=r.quantity(data, "cpu", p, d.cpu),
        memory=r.quantity(data, "memory", p, d.memory),
        shm_size=r.quantity(data, "shmSize", p, d.shm_size),
        ephemeral_storage=None if ephemeral is None else r.quantity(data, "ephemeralStorage", p, "0"),
        dtype=r.str_(data, "dtype", p, default=d.dtype, choices=DTYPES) or d.dtype,
        drafter_backend=r.str_(data, "drafterBackend", p, default=d.drafter_backend, choices=DRAFTER_BACKENDS)
        or d.drafter_backend,
        max_num_seqs=_or(r.int_(data, "maxNumSeqs", p, d.max_num_seqs, 1, 65536), d.max_num_seqs),
        max_num_seqs_from_kv_tokens=_kv_sized_batch(r, data, p, max_model_len),
        max_model_len=max_model_len,
        http_port=r.int_(data, "httpPort", p, None, 0, 65535),
        extra_args=_engine_extra_args(r, data, p),
        env=_engine_env_vars(r, data, p),
        node_selector=dict(node_selector),
        tolerations=tolerations,
        affinity=_engine_affinity(r, data, p),
        priority_class_name=r.name(data, "priorityClassName", p, required=False),
        runtime_class_name=r.name(data, "runtimeClassName", p, required=False),
        model_cache=ModelCacheSpec(
            size_limit=r.quantity(cache, "sizeLimit", f"{p}.modelCache", ModelCacheSpec().size_limit),
            claim_name=r.name(cache, "claimName", f"{p}.modelCache", required=False),
        ),
        termination_grace_period_seconds=_or(r.int_(data, "terminationGracePeriodSeconds", p,
                                                    d.termination_grace_period_seconds, 0, 3600),
                                             d.termination_grace_period_seconds),
        startup_timeout_seconds=r.int_(data, "startupTimeoutSeconds", p, d.startup_timeout_seconds, 60, 86400)
        or d.startup_timeout_seconds,
        pod_disruption_budget=pdb,
        rollout_strategy=r.str_(data, "rolloutStrategy", p, default=d.rollout_strategy, choices=ROLLOUT_STRATEGIES)
        or d.rollout_strategy,
    )


def _kv_sized_batch(r: _Reader, data: Mapping[str, Any], p: str, max_model_len: int | None) -> int | None:
    """engine.maxNumSeqsFromKV.requestTokens: the request length (prompt + output) the engine sizes its batch at."""
    sized = r.obj(data, "maxNumSeqsFromKV", p)
    if sized is None:
        return None
    where = f"{p}.maxNumSeqsFromKV"
    tokens = r.int_(sized, "requestTokens", where, None, 1, MAX_MODEL_LEN)
    if "requestTokens" not in sized:
        r.fail(f"{where}.requestTokens", "required")
    elif tokens is not None and max_model_len is not None and tokens > max_model_len:
        r.fail(f"{where}.requestTokens", f"must not exceed maxModelLen ({tokens} > {max_model_len}): no request "
                                         "is longer than the context")
        tokens = None
    return tokens


def _autoscaling(r: _Reader, data: Mapping[str, Any] | None) -> AutoscalingSpec | None:
    if data is None:
        return None
    p = "spec.autoscaling"
    d = AutoscalingSpec()
    min_replicas = r.int_(data, "minReplicas", p, d.min_replicas, 0, MAX_REPLICAS)
    max_replicas = r.int_(data, "maxReplicas", p, d.max_replicas, 1, MAX_REPLICAS)
    if min_replicas is not None and max_replicas is not None and min_replicas > max_replicas:
        r.fail(f"{p}.minReplicas", f"must not exceed maxReplicas ({min_replicas} > {max_replicas})")
    utilization = data.get("targetUtilization", d.target_utilization)
    if isinstance(utilization, bool) or not isinstance(utilization, int | float) or not 0 < utilization <= 1:
        r.fail(f"{p}.targetUtilization", f"must be a number in (0, 1] (got {utilization!r})")
        utilization = d.target_utilization
    spec_bounds = r.obj(data, "speculation", p) or {}
    sp = f"{p}.speculation"
    modes = spec_bounds.get("allowedModes", list(SpeculationBounds().allowed_modes))
    if not isinstance(modes, list) or not modes or any(m not in AUTO_MODES for m in modes):
        r.fail(f"{sp}.allowedModes", f"must be a non-empty list of {', '.join(AUTO_MODES)} (the modes auto "
                                     "switches between)")
        modes = list(SpeculationBounds().allowed_modes)
    k_min = r.int_(spec_bounds, "minSpeculativeTokens", sp, SpeculationBounds().min_speculative_tokens,
                   MIN_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS)
    k_max = r.int_(spec_bounds, "maxSpeculativeTokens", sp, SpeculationBounds().max_speculative_tokens,
                   MIN_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS)
    if k_min is not None and k_max is not None and k_min > k_max:
        r.fail(f"{sp}.minSpeculativeTokens", f"must not exceed maxSpeculativeTokens ({k_min} > {k_max})")
    prometheus = r.obj(data, "prometheus", p) or {}
    capacity = data.get("replicaCapacityTokensPerSecond")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int | float)
                                 or not capacity >= MIN_REPLICA_CAPACITY_TOKENS_PER_SECOND):  # NaN too
        r.fail(f"{p}.replicaCapacityTokensPerSecond",
               f"must be a number >= {MIN_REPLICA_CAPACITY_TOKENS_PER_SECOND:g} (got {capacity!r})")
        capacity = None
    return AutoscalingSpec(
        min_replicas=min_replicas if min_replicas is not None else d.min_replicas,
        max_replicas=max_replicas or d.max_replicas,
        target_utilization=float(utilization),
        interval_seconds=r.int_(data, "intervalSeconds", p, d.interval_seconds, 5, 3600) or d.interval_seconds,
        scale_down_stabilization_seconds=r.int_(data, "scaleDownStabilizationSeconds", p,
                                                d.scale_down_stabilization_seconds, 0, 86400)
        or 0,
        max_scale_up_step=r.int_(data, "maxScaleUpStep", p, d.max_scale_up_step, 1, MAX_REPLICAS)
        or d.max_scale_up_step,
        speculation=SpeculationBounds(tuple(modes), k_min or 1, k_max or 1),
        prometheus_address=_prometheus_address(r, prometheus, f"{p}.prometheus"),
        replica_capacity_tokens_per_second=float(capacity) if capacity is not None else None,
    )


PROMETHEUS_ADDRESS_PATTERN = r"^https?://[^\s/]+"


def _prometheus_address(r: _Reader, data: Mapping[str, Any], p: str) -> str | None:
    address = r.str_(data, "address", p)
    if address is not None and not re.match(PROMETHEUS_ADDRESS_PATTERN, address):
        r.fail(f"{p}.address", f"must be an http:// or https:// URL such as http://prometheus.monitoring:9090 "
                               f"(got {address!r})")
        return None
    return address


def _gateway(r: _Reader, data: Mapping[str, Any]) -> GatewaySpec:
    p = "spec.gateway"
    d = GatewaySpec()
    tls = r.obj(data, "tlsSecretRef", p)
    enabled = data.get("enabled", d.enabled)
    if not isinstance(enabled, bool):
        r.fail(f"{p}.enabled", "must be true or false")
        enabled = d.enabled
    return GatewaySpec(
        enabled=enabled,
        replicas=_or(r.int_(data, "replicas", p, d.replicas, 0, 100), d.replicas),
        image=r.str_(data, "image", p, default=d.image) or d.image,
        image_pull_policy=r.str_(data, "imagePullPolicy", p, default=d.image_pull_policy,
                                 choices=PULL_POLICIES) or d.image_pull_policy,
        service_type=r.str_(data, "serviceType", p, default=d.service_type, choices=SERVICE_TYPES)
        or d.service_type,
        port=r.int_(data, "port", p, d.port, 1, 65535) or d.port,
        http_port=_or(r.int_(data, "httpPort", p, d.http_port, 0, 65535), d.http_port),
        auth_token=_secret_key_ref(r, r.obj(data, "authTokenSecretRef", p), f"{p}.authTokenSecretRef", "token"),
        tls_secret_name=r.name(tls, "name", f"{p}.tlsSecretRef") if tls is not None else None,
        max_in_flight=r.int_(data, "maxInFlight", p, d.max_in_flight, 1, MAX_GATEWAY_IN_FLIGHT) or d.max_in_flight,
        cpu=r.quantity(data, "cpu", p, d.cpu),
        memory=r.quantity(data, "memory", p, d.memory),
    )


def _drafter_pool(r: _Reader, data: Mapping[str, Any] | None, mode: str) -> DrafterPoolSpec | None:
    if data is None:
        return None
    p = "spec.drafterPool"
    d = DrafterPoolSpec(SecretKeyRef("", ""))
    if mode not in (*DRAFTER_GPU_MODES, "auto"):
        r.fail(p, f"mode {mode} does not draft with the minedraft drafter: a drafter pool needs psd, sd, lookahead "
                  "or auto")
    token_data = r.obj(data, "tokenSecretRef", p)
    token = _secret_key_ref(r, token_data, f"{p}.tokenSecretRef", "token") if token_data is not None else None
    backend = r.str_(data, "backend", p, default=d.backend, choices=DRAFTER_BACKENDS) or d.backend
    window = _or(r.int_(data, "window", p, d.window, 0, MAX_DRAFTER_WINDOW), d.window)
    if window and backend != "torch":
        r.fail(f"{p}.window", "the drafter window is the torch backend's (vLLM's sliding window keeps no sink tokens "
                              "and is not applied to Qwen3 models): set backend torch or window 0")
    min_replicas = r.int_(data, "minReplicas", p, None, 1, 64)
    max_replicas = r.int_(data, "maxReplicas", p, None, 1, 64)
    if (min_replicas is None) != (max_replicas is None):
        r.fail(f"{p}.minReplicas" if min_replicas is None else f"{p}.maxReplicas",
               "autoscaling the pool needs both minReplicas and maxReplicas")
    elif min_replicas is not None and max_replicas is not None and min_replicas > max_replicas:
        r.fail(f"{p}.minReplicas", f"must not exceed maxReplicas ({min_replicas} > {max_replicas})")
    utilization = data.get("targetUtilization", d.target_utilization)
    if isinstance(utilization, bool) or not isinstance(utilization, int | float) or not 0 < utilization <= 1:
        r.fail(f"{p}.targetUtilization", f"must be a number in (0, 1] (got {utilization!r})")
        utilization = d.target_utilization
    gpus = _or(r.int_(data, "gpus", p, d.gpus, 0, 8), d.gpus)
    if gpus > 1:
        r.fail(f"{p}.gpus", f"the drafter has no tensor parallelism: a pool pod drafts on one GPU (got {gpus}; "
                            "scale drafterPool.replicas instead)")
    if gpus == 0 and backend != "torch":
        r.fail(f"{p}.backend", "a CPU pool (gpus 0) needs backend torch: the vLLM drafter needs a GPU")
    port = r.int_(data, "port", p, d.port, 1, 65535) or d.port
    if port == DRAFTER_METRICS_PORT:
        r.fail(f"{p}.port", f"must differ from the drafter's metrics port ({DRAFTER_METRICS_PORT})")
    return DrafterPoolSpec(
        token=token,
        replicas=_or(r.int_(data, "replicas", p, d.replicas, 0, 64), d.replicas),
        gpus=gpus,
        backend=backend,
        window=window,
        cpu=r.quantity(data, "cpu", p, d.cpu),
        memory=r.quantity(data, "memory", p, d.memory),
        model_cache_size_limit=r.quantity(data, "modelCacheSizeLimit", p, d.model_cache_size_limit),
        max_queued_jobs=r.int_(data, "maxQueuedJobs", p, d.max_queued_jobs, 1, 100_000) or d.max_queued_jobs,
        port=port,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        target_utilization=float(utilization),
        max_num_seqs=r.int_(data, "maxNumSeqs", p, None, 1, MAX_POOL_NUM_SEQS),
        gpu_memory=r.quantity(data, "gpuMemory", p, d.gpu_memory),
    )


def parse_spec(spec: Mapping[str, Any] | None) -> MineDraftSpec:
    """The dataclass form of a MineDraft's ``spec``; raises SpecError listing every problem found."""
    r = _Reader()
    if not isinstance(spec, Mapping):
        raise SpecError(["spec: required"])
    target = _model(r, r.obj(spec, "target", "spec", required=True), "spec.target")
    draft = _model(r, r.obj(spec, "draft", "spec", required=True), "spec.draft")
    speculation_data = r.obj(spec, "speculation", "spec") or {}
    d = SpeculationSpec()
    mode = r.str_(speculation_data, "mode", "spec.speculation", default=d.mode, choices=MODES) or d.mode
    k = r.int_(speculation_data, "numSpeculativeTokens", "spec.speculation", d.num_speculative_tokens,
               MIN_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS)
    extra = r.int_(speculation_data, "numExtraDraftTokens", "spec.speculation", d.num_extra_draft_tokens,
                   0, MAX_EXTRA_DRAFT_TOKENS)
    if mode not in EXTRA_DRAFT_MODES and extra:
        r.fail("spec.speculation.numExtraDraftTokens", f"extra drafts need mode psd or sd (mode is {mode})")
    if k is not None and extra is not None and k + extra > MAX_SPECULATIVE_TOKENS:
        r.fail("spec.speculation.numExtraDraftTokens", f"numSpeculativeTokens + numExtraDraftTokens must be at most "
                                                       f"{MAX_SPECULATIVE_TOKENS} (got {k} + {extra})")
    async_steps = speculation_data.get("asyncSteps", d.async_steps)
    if not isinstance(async_steps, bool):
        r.fail("spec.speculation.asyncSteps", "must be true or false")
        async_steps = d.async_steps
    elif async_steps and mode not in ASYNC_STEP_MODES:
        r.fail("spec.speculation.asyncSteps", f"async steps need mode psd, sd or auto (mode is {mode}: it never runs "
                                              "psd steps)")
    replicas = r.int_(spec, "replicas", "spec", None, 0, MAX_REPLICAS)
    # With autoscaling, spec.replicas (written through /scale) is clamped into the bounds (desired_replicas), so
    # narrowing minReplicas/maxReplicas afterwards is admitted and takes effect at once.
    autoscaling = _autoscaling(r, r.obj(spec, "autoscaling", "spec"))
    if mode == "auto" and autoscaling is not None:
        bounds = autoscaling.speculation
        if k is not None and not bounds.min_speculative_tokens <= k <= bounds.max_speculative_tokens:
            r.fail("spec.speculation.numSpeculativeTokens",
                   f"auto mode starts at k within autoscaling.speculation {bounds.min_speculative_tokens}.."
                   f"{bounds.max_speculative_tokens} (got {k})")
    elif autoscaling is not None and mode in AUTO_MODES and mode not in autoscaling.speculation.allowed_modes:
        r.fail("spec.autoscaling.speculation.allowedModes", f"must include the fixed mode {mode} (or use mode auto)")
    fanout = r.int_(speculation_data, "lookaheadFanout", "spec.speculation", None, MIN_LOOKAHEAD_FANOUT,
                    MAX_LOOKAHEAD_FANOUT)
    auto_modes = autoscaling.speculation.allowed_modes if autoscaling is not None else AUTO_MODES
    if fanout is not None and not runs_lookahead(mode, auto_modes):
        # Refused rather than dropped: a fan-out no engine runs with would read as set.
        r.fail("spec.speculation.lookaheadFanout", "needs mode lookahead, or auto with lookahead in "
                                                   f"autoscaling.speculation.allowedModes (mode is {mode}"
                                                   f"{', allowed ' + ', '.join(auto_modes) if mode == 'auto' else ''})")
    tokens = {m.source.hugging_face_token for m in (target, draft) if m.source.hugging_face_token is not None}
    if len(tokens) > 1:
        # One engine process downloads both models with one HF_TOKEN.
        r.fail("spec.draft.source.huggingFace.tokenSecretRef", "must equal the target's tokenSecretRef")
    engine = _engine(r, r.obj(spec, "engine", "spec") or {})
    if engine.drafter_backend == "torch":
        # Engine pods always run on GPUs, and the torch drafter runs on CPUs only.
        r.fail("spec.engine.drafterBackend", "torch is the CPU drafter; engine pods run on GPUs: use vllm")
    gateway = _gateway(r, r.obj(spec, "gateway", "spec") or {})
    drafter_pool = _drafter_pool(r, r.obj(spec, "drafterPool", "spec"), mode)
    pull_secrets = spec.get("imagePullSecrets", [])
    if not isinstance(pull_secrets, list) or not all(isinstance(x, Mapping) for x in pull_secrets):
        r.fail("spec.imagePullSecrets", "must be a list of {name: ...} objects")
        pull_secrets = []
    pull_names = tuple(n for i, x in enumerate(pull_secrets)
                       if (n := r.name(x, "name", f"spec.imagePullSecrets[{i}]")) is not None)
    served = spec.get("servedModelNames", [])
    if (not isinstance(served, list) or not all(isinstance(n, str) and _SERVED_NAME.match(n) for n in served)
            or len(set(served)) != len(served) or len(served) > MAX_SERVED_MODEL_NAMES):
        r.fail("spec.servedModelNames", f"must be a list of at most {MAX_SERVED_MODEL_NAMES} distinct names without "
                                        f"spaces (got {served!r})")
        served = []
    if r.errors:
        raise SpecError(r.errors)
    result = MineDraftSpec(
        target=target, draft=draft,
        speculation=SpeculationSpec(mode, k or d.num_speculative_tokens, extra or 0, bool(async_steps), fanout),
        engine=engine, replicas=replicas, autoscaling=autoscaling, gateway=gateway,
        image_pull_secrets=pull_names, served_model_names=tuple(served), drafter_pool=drafter_pool,
    )
    _check_combinations(r, result)
    if r.errors:
        raise SpecError(r.errors)
    return result


def _check_combinations(r: _Reader, spec: MineDraftSpec) -> None:
    """Fields that are fine alone and fail together, later (an invalid derived object, a pod Pending forever, a
    setting silently dropped): the CRD's CEL rules refuse the same at admission."""
    eng, gw = spec.engine, spec.gateway
    if eng.http_port in (ENGINE_GRPC_PORT, ENGINE_METRICS_PORT):
        r.fail("spec.engine.httpPort", f"must differ from the engine's gRPC ({ENGINE_GRPC_PORT}) and metrics "
                                       f"({ENGINE_METRICS_PORT}) ports (got {eng.http_port})")
    if gw.http_port and gw.http_port == gw.port:
        r.fail("spec.gateway.httpPort", f"must differ from gateway.port (both {gw.port})")
    # With a drafter pool the engine pods draft through it and request the target's GPUs only.
    gpus = eng.target_gpus + (eng.drafter_gpus if spec.needs_drafter_gpu and spec.drafter_pool is None else 0)
    if gpus > MAX_GPUS_PER_POD:
        r.fail("spec.engine.targetGPUs", f"targetGPUs plus the drafter's GPU ({gpus}) must fit on one node of at "
                                         f"most {MAX_GPUS_PER_POD} GPUs (mode {spec.speculation.mode} drafts on a "
                                         "GPU of its own)")
    if eng.target_gpus not in TARGET_TP_SIZES:
        r.fail("spec.engine.targetGPUs", f"must be 1, 2, 4 or 8: the target's tensor-parallel size must divide its "
                                         f"KV heads, and {eng.target_gpus} divides none of an 8-KV-head model's")
    _check_pool(r, spec)
    if gw.enabled and gw.replicas == 0 and spec.autoscaling is not None and spec.autoscaling.min_replicas == 0:
        r.fail("spec.autoscaling.minReplicas", "0 (scale to zero) needs gateway.replicas of at least 1: a gateway "
                                               "pod holds the first request and is what wakes the engines")
    if not gw.enabled:
        if spec.autoscaling is not None and spec.autoscaling.min_replicas == 0:
            r.fail("spec.autoscaling.minReplicas", "0 (scale to zero) needs the gateway: it holds the first request "
                                                   "while an engine starts")
        if gw.auth_token is not None:
            r.fail("spec.gateway.authTokenSecretRef", "needs gateway.enabled: without the gateway nothing checks "
                                                      "the token")
        if gw.tls_secret_name is not None:
            r.fail("spec.gateway.tlsSecretRef", "needs gateway.enabled: without the gateway nothing serves TLS")


_QUANTITY_FACTORS = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
                     "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes quantity (already checked against _QUANTITY) in bytes. Pure."""
    match = re.match(r"^([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)$", quantity)
    assert match is not None, quantity
    return int(float(match.group(1)) * _QUANTITY_FACTORS[match.group(2)])


# Published configurations the operator can judge a pool by without reading the model (Hugging Face id, lower
# case -> architecture preset, and the model's own context length, config.json's max_position_embeddings).
KNOWN_MODELS: dict[str, tuple[str | None, int]] = {
    "qwen/qwen3-0.6b": ("qwen3-0.6b", 40960), "qwen/qwen3-1.7b": ("qwen3-1.7b", 40960),
    "qwen/qwen3-8b": (None, 40960), "qwen/qwen3-32b": ("qwen3-32b", 40960)}


def _known(model: ModelSpec) -> tuple[str | None, int] | None:
    hub_id = model.source.hugging_face_id
    return KNOWN_MODELS.get(hub_id.lower()) if hub_id else None


def engine_context_tokens(spec: MineDraftSpec) -> int | None:
    """The engines' longest context: maxModelLen, else the target's own when the operator knows it (None: not
    known before the engines load)."""
    if spec.engine.max_model_len is not None:
        return spec.engine.max_model_len
    known = _known(spec.target)
    return known[1] if known else None


def pool_max_num_seqs(spec: MineDraftSpec) -> int:
    """Requests one pool pod holds at once, from bounds only (never the live engine replica count, so the pool's pod
    template does not change when the engines scale): drafterPool.maxNumSeqs, else every engine's batch at the
    autoscaler's maxReplicas, else (fixed replicas) DEFAULT_POOL_ENGINES_PER_POD engines' batches. Pure."""
    pool = spec.drafter_pool
    assert pool is not None
    if pool.max_num_seqs is not None:
        return pool.max_num_seqs
    engines = spec.autoscaling.max_replicas if spec.autoscaling is not None else DEFAULT_POOL_ENGINES_PER_POD
    return min(MAX_POOL_NUM_SEQS, spec.engine.max_num_seqs * engines)


def pool_dtype_bytes(spec: MineDraftSpec) -> int:
    """Bytes per KV element of the pool's drafter: engine.dtype, or what `--dtype auto` resolves to (a 16-bit dtype
    on a GPU, float32 on CPUs), as the engines resolve it. Pure."""
    pool = spec.drafter_pool
    assert pool is not None
    dtype = spec.engine.dtype
    if dtype == "auto":
        dtype = "bfloat16" if pool.gpus else "float32"
    return 4 if dtype == "float32" else 2


def pool_dtype_summary(spec: MineDraftSpec) -> str:
    """The pool's dtype as the operator can tell it (the drafter resolves `auto` as the engines do; its exact choice
    is the minedraft_drafter_info metric's dtype label). Pure."""
    pool = spec.drafter_pool
    assert pool is not None
    if spec.engine.dtype != "auto":
        return spec.engine.dtype
    return "auto: the draft's 16-bit dtype on its GPU" if pool.gpus else "auto: float32 on CPUs"


def torch_pool_kv_bytes(spec: MineDraftSpec) -> int | None:
    """The KV the torch pool preallocates per pod (2 * maxNumSeqs + 8 slots, each the window plus its sink tokens or
    the whole context), when the operator knows the draft's shape; None otherwise (the drafter checks at start-up).
    Pure."""
    from minedraft.profile.architecture import PRESETS

    pool = spec.drafter_pool
    if pool is None or pool.backend != "torch":
        return None
    known = _known(spec.draft)
    if known is None:
        return None
    preset, own_context = known
    if preset is None:
        return None
    context = pool.window + DRAFTER_SINK_TOKENS if pool.window else (spec.engine.max_model_len or own_context)
    arch = PRESETS[preset]
    per_token = 2 * arch.layers * arch.kv_heads * arch.head_dim * pool_dtype_bytes(spec)
    return (2 * pool_max_num_seqs(spec) + 8) * context * per_token


def _check_pool(r: _Reader, spec: MineDraftSpec) -> None:
    pool = spec.drafter_pool
    if pool is None:
        return
    p = "spec.drafterPool"
    context = engine_context_tokens(spec)
    if pool.window and context is not None and pool.window >= context:
        r.fail(f"{p}.window", f"must be shorter than the engines' context ({context} tokens): a window at or beyond it "
                              "bounds nothing and only costs the window's bookkeeping")
    kv = torch_pool_kv_bytes(spec)
    if kv is not None:
        room = quantity_bytes(pool.gpu_memory if pool.gpus else pool.memory)
        if kv > 0.9 * room:
            where = f"gpuMemory {pool.gpu_memory}" if pool.gpus else f"memory {pool.memory}"
            r.fail(f"{p}.maxNumSeqs", f"the torch pool preallocates {kv / 2**30:.1f} GiB of KV per pod "
                                      f"({2 * pool_max_num_seqs(spec) + 8} slots), more than 90% of its {where}: "
                                      "lower drafterPool.maxNumSeqs, set a window, or raise the memory")


@dataclass(frozen=True)
class ObjectMeta:
    """The parts of the MineDraft's own metadata that rendering needs (owner references, names, labels)."""

    name: str
    namespace: str
    uid: str
    generation: int = 1

    def validate(self) -> None:
        if not _DNS_1035.match(self.name) or len(self.name) > MAX_NAME_LENGTH:
            raise SpecError([f"metadata.name: must be a DNS-1035 label (lower-case letter first) of at most "
                             f"{MAX_NAME_LENGTH} characters "
                             f"(objects named {self.name}-gateway must fit in 63) (got {self.name!r})"])


def parse_meta(meta: Mapping[str, Any]) -> ObjectMeta:
    result = ObjectMeta(name=str(meta.get("name", "")), namespace=str(meta.get("namespace") or "default"),
                        uid=str(meta.get("uid") or "00000000-0000-0000-0000-000000000000"),
                        generation=int(meta.get("generation") or 1))
    result.validate()
    return result
