"""The MineDraft CustomResourceDefinition, built here and written to CRD_FILE in the chart (the one source of truth).

`minedraft operator crd` prints it; a test checks that CRD_FILE holds exactly this (the chart ships it from a
template so `helm upgrade` applies it). Defaults and
bounds come from the dataclasses in spec.py so the API server and the offline parser agree.
"""

from __future__ import annotations

from typing import Any

from minedraft.operator import spec as s

CRD_NAME = f"{s.PLURAL}.{s.API_GROUP}"
CRD_FILE = "charts/minedraft/files/crds/minedrafts.minedraft.io.yaml"

Schema = dict[str, Any]


def _str(description: str, **extra: Any) -> Schema:
    return {"type": "string", "description": description, **extra}


def _int(description: str, **extra: Any) -> Schema:
    return {"type": "integer", "format": "int32", "description": description, **extra}


def _num(description: str, **extra: Any) -> Schema:
    return {"type": "number", "description": description, **extra}


def _obj(description: str, properties: dict[str, Schema], **extra: Any) -> Schema:
    return {"type": "object", "description": description, "properties": properties, **extra}


QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"


def _quantity(description: str, default: str | None) -> Schema:
    # int-or-string, as every Kubernetes quantity: users write `cpu: 16` as often as `cpu: "16"`.
    schema: Schema = {"description": description, "x-kubernetes-int-or-string": True,
                      "anyOf": [{"type": "integer"}, {"type": "string"}], "pattern": QUANTITY_PATTERN}
    if default is not None:
        schema["default"] = default
    return schema


def _rule(rule: str, message: str, field_path: str | None = None, reason: str = "FieldValueInvalid",
          **extra: Any) -> dict[str, Any]:
    """A CEL rule whose error names the field it is about (fieldPath, relative to the rule's node) and a reason."""
    out: dict[str, Any] = {"rule": rule, "message": message, "reason": reason}
    if field_path is not None:
        out["fieldPath"] = field_path
    return {**out, **extra}


def _name(description: str) -> Schema:
    """An object's name (Secret, PVC, RuntimeClass, PriorityClass): refused at admission when the API server would
    refuse it later in a derived object (after GPU pods exist)."""
    return _str(description, minLength=1, maxLength=253, pattern=s.DNS_SUBDOMAIN_PATTERN)


def _secret_key_ref(description: str) -> Schema:
    return _obj(description, {
        "name": _name("Name of the Secret, in the MineDraft's namespace."),
        "key": _str("Key within the Secret.", default="token", minLength=1, maxLength=253,
                    pattern=s.SECRET_KEY_PATTERN),
    }, required=["name"])


def _key_ref(kind: str) -> Schema:
    return _obj(f"A key of a {kind} in the MineDraft's namespace.", {
        "name": _name(f"Name of the {kind}."),
        "key": _str("The key.", minLength=1, maxLength=253, pattern=s.SECRET_KEY_PATTERN),
        "optional": {"type": "boolean", "description": f"Whether the {kind} or its key may be missing."},
    }, required=["name", "key"])


def _env_var_source() -> Schema:
    """core/v1 EnvVarSource: exactly one source (the API server refuses the Deployment otherwise, after admission)."""
    return _obj("A core/v1 EnvVarSource: exactly one of fieldRef, resourceFieldRef, configMapKeyRef, secretKeyRef.", {
        "fieldRef": _obj("A field of the pod (core/v1 ObjectFieldSelector).", {
            "apiVersion": _str("Version of the schema the path is written in."),
            "fieldPath": _str("Path of the field, e.g. spec.nodeName.", minLength=1)}, required=["fieldPath"]),
        "resourceFieldRef": _obj("A resource of the container (core/v1 ResourceFieldSelector).", {
            "containerName": _str("Container name."),
            "resource": _str("Resource, e.g. limits.memory.", minLength=1),
            "divisor": _quantity("Output format of the exposed resources.", None)}, required=["resource"]),
        "configMapKeyRef": _key_ref("ConfigMap"),
        "secretKeyRef": _key_ref("Secret"),
    }, **{"x-kubernetes-validations": [_rule(
        "[" + ", ".join(f"has(self.{k})" for k in s.ENV_VALUE_SOURCES) + "].filter(x, x).size() == 1",
        f"valueFrom must set exactly one of {', '.join(s.ENV_VALUE_SOURCES)}", reason="FieldValueRequired")]})


def _toleration() -> Schema:
    """core/v1 Toleration with the API server's own checks (a bad one would fail only in the derived Deployment)."""
    return _obj("A core/v1 Toleration.", {
        "key": _str("Taint key (empty with operator Exists: every taint).", pattern=f"{s.LABEL_KEY_PATTERN}|^$",
                    maxLength=317),
        "operator": _str("Exists or Equal (the default).", enum=list(s.TOLERATION_OPERATORS)),
        "value": _str("Taint value (operator Equal).", maxLength=63),
        "effect": _str("Taint effect (empty: all).", enum=["", *s.TAINT_EFFECTS]),
        "tolerationSeconds": {"type": "integer", "format": "int64",
                              "description": "With effect NoExecute: seconds the pod stays after the taint."},
    }, **{"x-kubernetes-validations": [
        _rule("!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
              "value must be empty when operator is Exists", ".value"),
        _rule("(has(self.key) && self.key != '') || (has(self.operator) && self.operator == 'Exists')",
              "operator must be Exists when key is empty", ".operator"),
        _rule("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
              "tolerationSeconds needs effect NoExecute", ".tolerationSeconds"),
    ]})


def _model(role: str) -> Schema:
    return _obj(f"The {role} model and where its weights come from.", {
        "source": _obj("Where the weights come from: exactly one of huggingFace, persistentVolumeClaim or image.", {
            "huggingFace": _obj("Download from the Hugging Face hub into the model cache at start-up.", {
                "id": _str("Repository id, e.g. Qwen/Qwen3-32B (not a URL).", minLength=1,
                           maxLength=s.MAX_HUB_ID_LENGTH, pattern=s.HUB_ID_PATTERN),
                "tokenSecretRef": _secret_key_ref(
                    "Secret holding a hub token (for gated models); passed to the engine as HF_TOKEN."),
            }, required=["id"]),
            "persistentVolumeClaim": _obj(
                "Weights already on a PersistentVolumeClaim, mounted read-only by every engine pod: with more than "
                "one replica (or a rollout's extra pod) the claim must be ReadOnlyMany or ReadWriteMany, as a "
                "ReadWriteOnce volume attaches to one node and pods on others stay in ContainerCreating "
                "(FailedAttachVolume: Multi-Attach error).", {
                "claimName": _name("Name of the PersistentVolumeClaim in the MineDraft's namespace."),
                "path": _str("Directory of the model relative to the volume's root (no leading '/', no '..').",
                             default="", maxLength=4096, **{"x-kubernetes-validations": [_rule(
                                 "!self.startsWith('/') && !self.matches('(^|/)[.][.](/|$)')",
                                 "path must be relative to the volume's root, without '..'")]}),
            }, required=["claimName"]),
            "image": _obj("Weights baked into the engine image.", {
                "path": _str("Absolute path of the model directory inside the image.", pattern="^/"),
            }, required=["path"]),
        }, **{"x-kubernetes-validations": [_rule(
            "[has(self.huggingFace), has(self.persistentVolumeClaim), has(self.image)]"
            ".filter(x, x).size() == 1",
            "exactly one of huggingFace, persistentVolumeClaim or image must be set", reason="FieldValueRequired")]}),
    }, required=["source"])


def spec_schema() -> Schema:
    eng = s.EngineSpec()
    gw = s.GatewaySpec()
    auto = s.AutoscalingSpec()
    bounds = s.SpeculationBounds()
    k_range = {"minimum": s.MIN_SPECULATIVE_TOKENS, "maximum": s.MAX_SPECULATIVE_TOKENS}
    return _obj("Desired state of a MineDraft deployment: models, speculation, engines, scaling and gateway.", {
        "target": _model("target (large, verifying)"),
        "draft": _model("draft (small, drafting)"),
        "speculation": _obj("How the engines speculate.", {
            "mode": _str("psd: batch-parallel speculative decoding (drafting overlaps verification); sd: standard "
                         "speculative decoding; lookahead: every step verifies the whole batch while the drafter "
                         "pre-drafts the next round for each request's likely outcomes; ar: the target alone; "
                         "vllm-sd: vLLM's built-in draft-model SD; auto: the engine picks among "
                         "autoscaling.speculation.allowedModes (default psd, sd, lookahead and ar) and k from its "
                         "measured costs.",
                         enum=list(s.MODES), default=s.SpeculationSpec().mode),
            "numSpeculativeTokens": _int("Draft length k: tokens drafted per verification step.",
                                         default=s.SpeculationSpec().num_speculative_tokens, **k_range),
            "numExtraDraftTokens": _int("Extra drafted tokens e kept for top-C selection by cumulative draft "
                                        "log-probability (psd and sd only).", default=0, minimum=0,
                                        maximum=s.MAX_EXTRA_DRAFT_TOKENS),
            "asyncSteps": {"type": "boolean", "default": s.SpeculationSpec().async_steps,
                           "description": "psd steps (mode psd, sd or auto, whenever it runs psd) scheduled while "
                           "the target computes the step before: consecutive psd steps verify disjoint sub-batches, "
                           "so nothing is speculative and nothing rolls back (minedraft serve --async-psd-steps). "
                           "Hides the engine's host work per step (scheduling, waiting for drafts, output "
                           "processing) behind the target's; at any targetGPUs."},
            "lookaheadFanout": _int("Lookahead's most branches (accepted length x bonus token) pre-drafted per "
                                    "request per round (minedraft serve --lookahead-fanout); the engine uses fewer "
                                    "when its measured drafter time says more would outlast the verification. Mode "
                                    "lookahead, or auto with lookahead among its allowedModes. Unset: the engine's "
                                    "default.", minimum=s.MIN_LOOKAHEAD_FANOUT, maximum=s.MAX_LOOKAHEAD_FANOUT),
        }, default={}, **{"x-kubernetes-validations": [
            _rule(f"self.mode in {list(s.EXTRA_DRAFT_MODES)} || self.numExtraDraftTokens == 0",
                  "numExtraDraftTokens needs mode psd or sd", ".numExtraDraftTokens"),
            _rule(f"!has(self.asyncSteps) || !self.asyncSteps || self.mode in {list(s.ASYNC_STEP_MODES)}",
                  "asyncSteps needs mode psd, sd or auto (the modes that run psd steps)", ".asyncSteps"),
            _rule(f"self.numSpeculativeTokens + self.numExtraDraftTokens <= {s.MAX_SPECULATIVE_TOKENS}",
                  f"numSpeculativeTokens + numExtraDraftTokens must be at most {s.MAX_SPECULATIVE_TOKENS}",
                  ".numExtraDraftTokens"),
        ]}),
        "engine": _obj("The engine pods (one target plus one drafter per pod).", {
            "image": _str("Engine image (docker/engine.Dockerfile: vLLM 0.32 on CUDA with minedraft). Unset: the "
                          "operator's, REGISTRY/engine:TAG with the chart's image.registry and image.tag.",
                          minLength=1),
            "imagePullPolicy": _str("Image pull policy.", enum=list(s.PULL_POLICIES), default=eng.image_pull_policy),
            "targetGPUs": _int("GPUs for the target model, its tensor-parallel size (1 to 8). Each pod requests "
                               "targetGPUs nvidia.com/gpu, plus drafterGPUs for modes whose drafter runs on a "
                               "device of its own (psd, sd, lookahead, auto choosing among them); the drafter takes "
                               "the next device after the target's.",
                               default=eng.target_gpus, minimum=1, maximum=s.MAX_TARGET_GPUS),
            "dtype": _str("Weights and activations dtype of target and drafter: auto (the model's own), bfloat16, "
                          "float16 or float32.", enum=list(s.DTYPES), default=eng.dtype),
            "drafterBackend": _str("vllm: the draft model in vLLM (any architecture). torch (the plain-torch CPU "
                                   "drafter) is refused: engine pods run on GPUs.", enum=list(s.DRAFTER_BACKENDS),
                                   default=eng.drafter_backend),
            "drafterGPUs": _int("GPUs for the drafter: always 1, a device of its own so drafting overlaps "
                                "verification (not requested for ar and vllm-sd).", default=1, minimum=1,
                                maximum=1),
            "cpu": _quantity("CPU request per engine pod.", eng.cpu),
            "memory": _quantity("Memory request and limit per engine pod: its processes (the servers, the engine "
                                "core, the drafter) and what they keep in /dev/shm, which counts against it.",
                                eng.memory),
            "shmSize": _quantity("Size of /dev/shm (memory-backed, within the memory limit) for NCCL and worker "
                                 "processes.", eng.shm_size),
            "ephemeralStorage": _quantity("Node-local ephemeral storage requested and limited per engine pod "
                                          "(unset: none requested).", None),
            "maxNumSeqs": _int("Most requests batched at once per engine (vLLM max_num_seqs); with "
                               "maxNumSeqsFromKV, the ceiling of the sized batch.",
                               default=eng.max_num_seqs, minimum=1, maximum=65536),
            "maxNumSeqsFromKV": _obj("Size each engine's batch from the KV cache its target GPU holds, instead of "
                                     "maxNumSeqs alone (minedraft serve --max-num-seqs-from-kv): as many requests "
                                     "of requestTokens as the target's KV pool holds, at most maxNumSeqs. A drafter "
                                     "off the target's GPU (psd, sd, lookahead, auto; drafterPool) leaves its memory "
                                     "to that pool; vllm-sd's colocated drafter takes its share. Unset: maxNumSeqs.", {
                "requestTokens": _int("Tokens per request (prompt + output) the batch is sized at; at most "
                                      "maxModelLen.", minimum=1, maximum=s.MAX_MODEL_LEN),
            }, required=["requestTokens"]),
            "maxModelLen": _int("Longest context in tokens (vLLM max_model_len); unset: the model's own context "
                                "length, capped by the KV cache.", minimum=s.MIN_MODEL_LEN,
                                maximum=s.MAX_MODEL_LEN),
            "extraArgs": {"type": "array", "description": "vLLM engine arguments passed through to the target's "
                                                          "vLLM engine, e.g. [--enforce-eager, --kv-cache-dtype, "
                                                          "fp8]; checked by vLLM's own parser at start-up (a typo "
                                                          "shows in the Progressing condition). Flags the operator "
                                                          "sets from other fields are refused.",
                          "items": _str("One argument.", minLength=1, maxLength=1024), "default": [], "maxItems": 64},
            "env": {"type": "array", "description": "Extra environment variables of the engine container "
                                                    "(core/v1 EnvVar: name with value or valueFrom).",
                    "items": _obj("A core/v1 EnvVar.", {
                        "name": _str("Variable name.", minLength=1, pattern=s.ENV_NAME_PATTERN),
                        "value": _str("The value (a string: quote numbers and booleans).",
                                      maxLength=s.MAX_ENV_VALUE_LENGTH),
                        "valueFrom": _env_var_source()}, required=["name"], **{"x-kubernetes-validations": [_rule(
                            "!has(self.valueFrom) || !has(self.value) || self.value == ''",
                            "valueFrom must not be set together with a non-empty value", ".valueFrom")]}),
                    "maxItems": 256},
            "runtimeClassName": _name("RuntimeClass of the engine pods (GPU nodes often need nvidia)."),
            "rolloutStrategy": _str("How a changed MineDraft replaces engine pods. Surge: a new pod starts before an "
                                    "old one stops (no capacity lost, but it needs a spare pod's worth of GPUs: in "
                                    "a full GPU pool the new pod stays Pending and the rollout never finishes). "
                                    "Replace: one old pod stops first, then its replacement loads (one replica's "
                                    "capacity is missing meanwhile; no spare GPUs needed).",
                                    enum=list(s.ROLLOUT_STRATEGIES), default=eng.rollout_strategy),
            "podDisruptionBudget": {"type": "boolean", "description": "Render a PodDisruptionBudget letting one "
                                                                      "engine pod go at a time.", "default": True},
            "nodeSelector": {"type": "object", "description": "Node labels the engine pods must match.",
                             # Keys are checked by the operator (Ready=False, InvalidSpec): a CEL rule over map
                             # keys has no length bound for the API server's cost estimate.
                             "additionalProperties": _str("Label value.", maxLength=63,
                                                          pattern=s.LABEL_VALUE_PATTERN),
                             "maxProperties": 64},
            "tolerations": {"type": "array", "description": "Tolerations of the engine pods (core/v1 Toleration).",
                            "items": _toleration(), "maxItems": 64},
            "affinity": _obj("Affinity of the engine pods (core/v1 Affinity: nodeAffinity, podAffinity, "
                             "podAntiAffinity; their contents are checked by the API server on the Deployment).",
                             {kind: {"type": "object", "description": f"A core/v1 {kind[0].upper()}{kind[1:]}.",
                                     "x-kubernetes-preserve-unknown-fields": True} for kind in s.AFFINITY_KINDS}),
            "priorityClassName": _name("PriorityClass of the engine pods."),
            "modelCache": _obj("Volume for downloaded weights and compile caches.", {
                "claimName": _name("A PersistentVolumeClaim to keep the cache across restarts; an emptyDir when "
                                   "unset. Every engine pod writes it: with more than one replica (or a rollout's "
                                   "extra pod) it must be ReadWriteMany (a ReadWriteOnce volume attaches to one "
                                   "node: Multi-Attach error)."),
                "sizeLimit": _quantity("Size limit of the emptyDir cache; also requested as ephemeral-storage (unless "
                                       "ephemeralStorage is set), so the pod lands on a node with that much local "
                                       "disk instead of being evicted when the cache fills.",
                                       eng.model_cache.size_limit),
            }, default={}),
            "terminationGracePeriodSeconds": _int("Seconds an engine gets to finish streams after SIGTERM.",
                                                  default=eng.termination_grace_period_seconds, minimum=0,
                                                  maximum=3600),
            "startupTimeoutSeconds": _int("Seconds allowed for loading the models before the startup probe fails.",
                                          default=eng.startup_timeout_seconds, minimum=60, maximum=86400),
            "httpPort": _int(f"Container and Service port of each engine's OpenAI-compatible HTTP API; 0: not "
                             f"served. Unset: {s.DEFAULT_ENGINE_HTTP_PORT} with the gateway disabled (clients call "
                             "engines directly), closed behind the gateway (it reaches engines over gRPC). The "
                             "operator's NetworkPolicy admits it from everywhere only without the gateway; behind the "
                             "gateway the engines require the MineDraft's internal credential (Secret "
                             "<name>-internal) on this port and on gRPC (for this release also the clients' token "
                             "of gateway.authTokenSecretRef).",
                             minimum=0, maximum=65535),
        }, default={}, **{"x-kubernetes-validations": [
            _rule(f"self.targetGPUs in {list(s.TARGET_TP_SIZES)}",
                  "targetGPUs must be 1, 2, 4 or 8: the target's tensor-parallel size must divide its KV heads (3, 5, "
                  "6 and 7 divide none of an 8-KV-head model's)", ".targetGPUs", reason="FieldValueNotSupported"),
            _rule("self.drafterBackend != 'torch'", "torch is the CPU drafter; engine pods run on GPUs: use vllm",
                  ".drafterBackend", reason="FieldValueNotSupported"),
            # Written --flag, --flag=value or "--flag value", with '-' or '_' inside the name (vLLM takes both).
            _rule(f"!has(self.extraArgs) || self.extraArgs.all(a, !(a in {list(s.RESERVED_FLAG_SPELLINGS)}) && "
                  f"!{list(s.RESERVED_FLAG_SPELLINGS)}.exists(f, a.startsWith(f + '=') || a.startsWith(f + ' ')))",
                  "extraArgs must not set flags the operator sets from the MineDraft's own fields (--model, "
                  "--dtype, --tensor-parallel-size, --max-model-len, ...): set those fields", ".extraArgs"),
            # A value word belongs to the flag before it: a list cannot start with one.
            _rule("!has(self.extraArgs) || self.extraArgs.size() == 0 || self.extraArgs[0].startsWith('--')",
                  "extraArgs must start with a vLLM engine argument (--flag, --flag=value or \"--flag value\"); "
                  "a word without -- is the value of the flag before it", ".extraArgs"),
            _rule("!has(self.maxNumSeqsFromKV) || !has(self.maxModelLen) || "
                  "self.maxNumSeqsFromKV.requestTokens <= self.maxModelLen",
                  "maxNumSeqsFromKV.requestTokens must not exceed maxModelLen: no request is longer than the context",
                  ".maxNumSeqsFromKV.requestTokens"),
            _rule(f"!has(self.httpPort) || !(self.httpPort in [{s.ENGINE_GRPC_PORT}, {s.ENGINE_METRICS_PORT}])",
                  f"httpPort must differ from the engine's gRPC ({s.ENGINE_GRPC_PORT}) and metrics "
                  f"({s.ENGINE_METRICS_PORT}) ports", ".httpPort"),
        ]}),
        "imagePullSecrets": {"type": "array", "description": "Secrets (in the MineDraft's namespace) for pulling "
                                                             "the engine and gateway images.",
                             "items": _obj("A core/v1 LocalObjectReference.",
                                           {"name": _name("Name of the Secret.")}, required=["name"])},
        "servedModelNames": {"type": "array", "description": "The names clients address the model by (OpenAI's "
                                                             "`model`): the first is what /v1/models and GetModelInfo "
                                                             "answer, requests may name any of them (aliases). Unset: "
                                                             "the target's hub id or path.",
                             "items": _str("A name (no spaces).", pattern=s.SERVED_NAME_PATTERN),
                             "maxItems": s.MAX_SERVED_MODEL_NAMES, "x-kubernetes-list-type": "set"},
        "replicas": _int("Engine replicas. With autoscaling, leave unset: the autoscaler writes it through the "
                         "/scale subresource.", minimum=0, maximum=s.MAX_REPLICAS),
        "autoscaling": _obj("Speculation-aware autoscaling bounds and targets (used by the autoscaler).", {
            "minReplicas": _int("Fewest engine replicas (0 allows scaling to zero).", default=auto.min_replicas,
                                minimum=0, maximum=s.MAX_REPLICAS),
            "maxReplicas": _int("Most engine replicas.", default=auto.max_replicas, minimum=1,
                                maximum=s.MAX_REPLICAS),
            "targetUtilization": _num("Share of the estimated capacity per replica to plan for, in (0, 1].",
                                      default=auto.target_utilization, minimum=0, exclusiveMinimum=True,
                                      maximum=1),
            "intervalSeconds": _int("Seconds between autoscaling decisions.", default=auto.interval_seconds,
                                    minimum=5, maximum=3600),
            "scaleDownStabilizationSeconds": _int("Seconds a lower replica count must persist before scaling down.",
                                                  default=auto.scale_down_stabilization_seconds, minimum=0,
                                                  maximum=86400),
            "maxScaleUpStep": _int("Most replicas added in one decision beyond what the measured arrivals and "
                                   "the requests already in the system need (those are added at once), or the "
                                   "current count if that is more (up to doubling, as the HPA's default).",
                                   default=auto.max_scale_up_step, minimum=1, maximum=s.MAX_REPLICAS),
            "speculation": _obj("What each engine may choose between when it adapts its speculation.", {
                "allowedModes": {"type": "array",
                                 "description": "Modes auto mode switches between (psd, sd, lookahead, ar; all four "
                                 "by default, as minedraft serve's auto). A fixed speculation.mode must be one of "
                                 "them.",
                                 "items": _str("A mode.", enum=list(s.AUTO_MODES)), "minItems": 1,
                                 # Bounded: a rule iterates it, and the API server prices an unbounded string list
                                 # at a million items (over its per-rule cost limit: the CRD would be refused).
                                 "maxItems": len(s.AUTO_MODES),
                                 "default": list(bounds.allowed_modes), "x-kubernetes-list-type": "set"},
                "minSpeculativeTokens": _int("Shortest draft length.", default=bounds.min_speculative_tokens,
                                             **k_range),
                "maxSpeculativeTokens": _int("Longest draft length.", default=bounds.max_speculative_tokens,
                                             **k_range),
            }, default={}, **{"x-kubernetes-validations": [_rule(
                "self.minSpeculativeTokens <= self.maxSpeculativeTokens",
                "minSpeculativeTokens must not exceed maxSpeculativeTokens", ".minSpeculativeTokens")]}),
            "replicaCapacityTokensPerSecond": _num(
                "Output tokens/s one engine replica gives with its batch full (maxNumSeqs requests), at the "
                "acceptance you expect: the autoscaler's capacity per replica until it has measured the engines' "
                "speed (after an operator restart, before the engines have decoded anything, or while they export "
                "no speed). Unset: no prior, nothing scales up on capacity until a speed is measured. "
                "`minedraft autoscale calibrate` prints the figure (docs/autoscaling.md).",
                minimum=s.MIN_REPLICA_CAPACITY_TOKENS_PER_SECOND),
            "prometheus": _obj("Where the autoscaler reads metrics.", {
                "address": _str("Prometheus HTTP API base URL, e.g. http://prometheus.monitoring:9090; when "
                                "unset the engines' metrics endpoints are scraped directly.",
                                pattern=s.PROMETHEUS_ADDRESS_PATTERN),
            }, default={}),
        }, **{"x-kubernetes-validations": [_rule("self.minReplicas <= self.maxReplicas",
                                                 "minReplicas must not exceed maxReplicas", ".minReplicas")]}),
        "gateway": _obj("The gRPC gateway in front of the engines.", {
            "enabled": {"type": "boolean", "description": "Run the gateway (false: clients reach the engines' "
                                                          "headless Service directly; the gateway's objects are "
                                                          "deleted).", "default": True},
            "replicas": _int("Gateway replicas.", default=gw.replicas, minimum=0, maximum=100),
            "image": _str("Gateway image (docker/gateway.Dockerfile). Unset: the operator's, REGISTRY/gateway:TAG "
                          "with the chart's image.registry and image.tag.", minLength=1),
            "imagePullPolicy": _str("Image pull policy.", enum=list(s.PULL_POLICIES), default=gw.image_pull_policy),
            "serviceType": _str("Type of the gateway Service.", enum=list(s.SERVICE_TYPES), default=gw.service_type),
            "port": _int("Port of the gateway Service.", default=gw.port, minimum=1, maximum=65535),
            "httpPort": _int("Port of the gateway Service's OpenAI-compatible HTTP API (/v1/completions, "
                             "/v1/chat/completions, /v1/models); 0: not served.", default=gw.http_port, minimum=0,
                             maximum=65535),
            "authTokenSecretRef": _secret_key_ref("Secret with the bearer token clients must send; no auth when "
                                                  "unset. The gateway authenticates to the engines with the "
                                                  "MineDraft's internal credential (the operator-generated Secret "
                                                  "<name>-internal); for this release only, engines also accept this "
                                                  "token and the gateway offers it to an engine that refuses the "
                                                  "internal one (0.1.0's pods, during an upgrade)."),
            "tlsSecretRef": _obj("A kubernetes.io/tls Secret (tls.crt, tls.key) to serve TLS; plaintext when unset.",
                                 {"name": _name("Name of the Secret.")}, required=["name"]),
            "maxInFlight": _int("Admission bound: streams in flight per gateway replica before RESOURCE_EXHAUSTED.",
                                default=gw.max_in_flight, minimum=1, maximum=s.MAX_GATEWAY_IN_FLIGHT),
            "cpu": _quantity("CPU request per gateway pod.", gw.cpu),
            "memory": _quantity("Memory request and limit per gateway pod.", gw.memory),
        }, default={}, **{"x-kubernetes-validations": [
            _rule("self.httpPort == 0 || self.httpPort != self.port", "httpPort must differ from port", ".httpPort"),
        ]}),
        "drafterPool": _drafter_pool(),
    }, required=["target", "draft"], **{"x-kubernetes-validations": [
        # Creation only (optionalOldSelf: on create oldSelf has no value): afterwards the autoscaler writes
        # spec.replicas through /scale, which the next rule keeps within bounds.
        _rule("oldSelf.hasValue() || !(has(self.replicas) && has(self.autoscaling))",
              "set either replicas or autoscaling, not both (the autoscaler owns replicas)", ".replicas",
              reason="FieldValueForbidden", optionalOldSelf=True),
        # No bound check of replicas against min/maxReplicas: the operator clamps it, so narrowing the bounds after
        # the autoscaler wrote replicas is admitted and takes effect at once.
        _rule("self.speculation.mode != 'auto' || !has(self.autoscaling) || "
              "(self.speculation.numSpeculativeTokens >= self.autoscaling.speculation.minSpeculativeTokens && "
              "self.speculation.numSpeculativeTokens <= self.autoscaling.speculation.maxSpeculativeTokens)",
              "auto mode starts at a numSpeculativeTokens within autoscaling.speculation's min..max",
              ".speculation.numSpeculativeTokens"),
        _rule(f"!(self.speculation.mode in {list(s.AUTO_MODES)}) || !has(self.autoscaling) || "
              "self.speculation.mode in self.autoscaling.speculation.allowedModes",
              "autoscaling.speculation.allowedModes must include the fixed speculation.mode (or use mode auto)",
              ".autoscaling.speculation.allowedModes"),
        # The drafter's GPU is requested next to the target's for the modes that draft on one (needs_drafter_gpu).
        _rule(f"!(self.speculation.mode in {list(s.DRAFTER_GPU_MODES)} || (self.speculation.mode == 'auto' && "
              "(!has(self.autoscaling) || self.autoscaling.speculation.allowedModes.exists(m, m in "
              f"{list(s.DRAFTER_GPU_MODES)}))))"
              " || has(self.drafterPool)"
              f" || self.engine.targetGPUs + self.engine.drafterGPUs <= {s.MAX_GPUS_PER_POD}",
              f"targetGPUs plus the drafter's GPU must fit on one node of at most {s.MAX_GPUS_PER_POD} GPUs (modes "
              "psd, sd and lookahead draft on a GPU of their own)", ".engine.targetGPUs"),
        # What the parser's runs_lookahead says: a fan-out is refused where no engine would run lookahead.
        _rule("!has(self.speculation.lookaheadFanout) || self.speculation.mode == 'lookahead' || "
              "(self.speculation.mode == 'auto' && (!has(self.autoscaling) || "
              "'lookahead' in self.autoscaling.speculation.allowedModes))",
              "lookaheadFanout needs mode lookahead, or auto with lookahead in autoscaling.speculation.allowedModes",
              ".speculation.lookaheadFanout"),
        _rule("self.gateway.enabled || !has(self.autoscaling) || self.autoscaling.minReplicas > 0",
              "minReplicas 0 (scale to zero) needs the gateway: it holds the first request while an engine starts",
              ".autoscaling.minReplicas"),
        _rule("!self.gateway.enabled || self.gateway.replicas > 0 || !has(self.autoscaling) || "
              "self.autoscaling.minReplicas > 0",
              "minReplicas 0 (scale to zero) needs gateway.replicas of at least 1: a gateway pod holds the first "
              "request and is what wakes the engines", ".autoscaling.minReplicas"),
        _rule("self.gateway.enabled || !has(self.gateway.authTokenSecretRef)",
              "authTokenSecretRef needs gateway.enabled: without the gateway nothing checks the token",
              ".gateway.authTokenSecretRef", reason="FieldValueForbidden"),
        _rule("self.gateway.enabled || !has(self.gateway.tlsSecretRef)",
              "tlsSecretRef needs gateway.enabled: without the gateway nothing serves TLS", ".gateway.tlsSecretRef",
              reason="FieldValueForbidden"),
        _rule("!has(self.drafterPool) || !has(self.engine.maxModelLen) || "
              "self.drafterPool.window < self.engine.maxModelLen",
              "drafterPool.window must be shorter than engine.maxModelLen: a window at or beyond the engines' context "
              "bounds nothing", ".drafterPool.window"),
        _rule(f"!has(self.drafterPool) || self.speculation.mode in {[*s.DRAFTER_GPU_MODES, 'auto']}",
              "drafterPool needs speculation.mode psd, sd, lookahead or auto (the modes that draft with the minedraft "
              "drafter)",
              ".drafterPool"),
    ]})


def _drafter_pool() -> Schema:
    pool = s.DrafterPoolSpec(s.SecretKeyRef("", ""))
    return _obj("A drafter service shared by every engine replica (minedraft drafter): engine pods then request only "
                "the target's GPUs and draft through it; only this MineDraft's engine pods may reach it.", {
        "tokenSecretRef": _secret_key_ref("Secret with the tokens engines and drafter pool authenticate each other "
                                          "with (one per line, each at least 16 bytes: the pool accepts any, engines "
                                          "present the first; re-read when it changes); mounted as a file, never an "
                                          "environment variable. Unset: the MineDraft's internal credential (the "
                                          "operator-generated Secret <name>-internal)."),
        "replicas": _int("Drafter pool replicas. With minReplicas/maxReplicas the operator writes it (the pool's "
                         "autoscaling) and runs it clamped into those bounds.", default=pool.replicas, minimum=0,
                         maximum=64),
        "gpus": _int("GPUs per drafter pod: 1, or 0 (the drafter runs on CPUs, backend torch). The drafter has no "
                     "tensor parallelism: more drafting needs more replicas, not more GPUs per pod.",
                     default=pool.gpus, minimum=0, maximum=1),
        "backend": _str("Drafter backend: vllm (any architecture) or torch (Llama/Qwen3, with window support).",
                        enum=list(s.DRAFTER_BACKENDS), default=pool.backend),
        "window": _int("torch backend: each draft step reads at most the last window tokens of a context plus 4 "
                       "attention-sink tokens (0: the whole context).", default=pool.window, minimum=0,
                       maximum=s.MAX_DRAFTER_WINDOW),
        "cpu": _quantity("CPU request per drafter pod.", pool.cpu),
        "memory": _quantity("Memory request and limit per drafter pod.", pool.memory),
        "modelCacheSizeLimit": _quantity("Size of each drafter pod's model cache (the draft's weights) when the "
                                         "engines' cache is an emptyDir; requested as ephemeral storage. With a "
                                         "model-cache claim the pool shares the claim.",
                                         pool.model_cache_size_limit),
        "maxQueuedJobs": _int("Draft jobs queued (all engines) before the pool answers busy and engines decode "
                              "without drafts.", default=pool.max_queued_jobs, minimum=1, maximum=100000),
        "port": _int(f"Port of the drafter pool's Service (not {s.DRAFTER_METRICS_PORT}, its metrics port).",
                     default=pool.port, minimum=1, maximum=65535),
        "minReplicas": _int("With maxReplicas: the operator scales the pool on its own utilisation (apart from the "
                            "engines), never below this.", minimum=1, maximum=64),
        "maxReplicas": _int("With minReplicas: the most pool replicas the operator scales to.", minimum=1,
                            maximum=64),
        "maxNumSeqs": _int("Requests one pool pod holds at once (all the engines it serves; the torch backend "
                           "preallocates KV for 2 x maxNumSeqs + 8 of them). Unset: engine.maxNumSeqs times "
                           "autoscaling.maxReplicas, or times "
                           f"{s.DEFAULT_POOL_ENGINES_PER_POD} with fixed replicas. Never the live replica count: "
                           "the pool's pods do not restart when the engines scale.", minimum=1,
                           maximum=s.MAX_POOL_NUM_SEQS),
        "gpuMemory": _quantity("Memory of each pool GPU: the torch backend's preallocated KV must fit in 90% of it "
                               "(checked by the operator for the drafts it knows).", pool.gpu_memory),
        "targetUtilization": _num("Autoscaled pool: the share of time each pool replica spends drafting to plan for, "
                                  "in (0, 1].", default=pool.target_utilization, minimum=0, exclusiveMinimum=True,
                                  maximum=1),
    }, **{"x-kubernetes-validations": [
        _rule("self.gpus > 0 || self.backend == 'torch'",
              "a CPU pool (drafterPool.gpus 0) needs backend torch: the vLLM drafter needs a GPU", ".backend",
              reason="FieldValueNotSupported"),
        _rule("self.window == 0 || self.backend == 'torch'",
              "drafterPool.window needs backend torch (vLLM's sliding window keeps no sink tokens)", ".window"),
        _rule(f"self.port != {s.DRAFTER_METRICS_PORT}",
              f"drafterPool.port must differ from the drafter's metrics port ({s.DRAFTER_METRICS_PORT})", ".port"),
        _rule("has(self.minReplicas) == has(self.maxReplicas)",
              "drafterPool.minReplicas and drafterPool.maxReplicas go together (both set: the pool is autoscaled)",
              ".minReplicas"),
        _rule("!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
              "drafterPool.minReplicas must not exceed drafterPool.maxReplicas", ".minReplicas"),
    ]})


CONDITION_TYPES = ("Ready", "EngineReady", "GatewayReady", "Progressing", "ScalingReady", "MetricsAvailable",
                   "DrafterPoolReady")


def status_schema() -> Schema:
    condition = _obj("A condition of the MineDraft.", {
        "type": _str(", ".join(CONDITION_TYPES[:-1]) + " or " + CONDITION_TYPES[-1] + "."),
        "status": _str("True, False or Unknown.", enum=["True", "False", "Unknown"]),
        "reason": _str("A CamelCase reason."),
        "message": _str("What a human needs to know."),
        "observedGeneration": {"type": "integer", "format": "int64",
                               "description": "metadata.generation the condition was computed for."},
        "lastTransitionTime": _str("When status last changed.", format="date-time"),
    }, required=["type", "status"])
    return _obj("Observed state, written by the operator.", {
        "phase": _str("Pending, Progressing, Ready, Idle (scaled to zero while idle: the gateway wakes an engine on "
                      "the next request) or Failed.", enum=["Pending", "Progressing", "Ready", "Idle", "Failed"]),
        "observedGeneration": {"type": "integer", "format": "int64",
                               "description": "metadata.generation last reconciled."},
        "conditions": {"type": "array", "description": "Conditions keyed by type.", "items": condition,
                       "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        "replicas": _int("Engine replicas desired (the /scale status)."),
        "readyReplicas": _int("Engine replicas ready."),
        "ready": _str("readyReplicas/replicas, for printing."),
        "selector": _str("Label selector of the engine pods (the /scale selector)."),
        "engineImage": _str("The engine image this MineDraft's pods run (its own, or the operator's)."),
        "internalCredential": _str("The Secret holding the internal credential between gateway, engines and drafter "
                                   "pool, once the operator has created it (<name>-internal)."),
        "pendingEngineImage": _str("The operator's newer engine image this MineDraft waits to roll to (the "
                                   "operator's engineImageRollout: another MineDraft is rolling, or OnRequest and no "
                                   "minedraft.io/upgrade-engine-image annotation); absent once it runs it."),
        "endpoint": _str("host:port of the gateway Service inside the cluster."),
        "speculation": _obj("Live speculation figures, when the metrics are known.", {
            "acceptanceRate": _num("Accepted draft tokens per drafted token."),
            "overlap": _num("Share of drafting time hidden behind verification (1 = fully hidden)."),
            "modes": {"type": "array", "description": "Modes the engines use now.", "items": _str("A mode.")},
            "meanAcceptedLength": _num("Tokens per request per verification (1 + accepted drafts)."),
        }),
        "scaling": _obj("What the autoscaler saw and decided (only with spec.autoscaling).", {
            "metricsAvailable": {"type": "boolean", "description": "Whether the last evaluation had usable metrics."},
            "reason": _str("CamelCase reason of the last evaluation (the MetricsAvailable/ScalingReady reason)."),
            "message": _str("The last evaluation's reason in words."),
            "desiredReplicas": _int("Replicas the last evaluation asked for."),
            "recommendedReplicas": _int("Replicas the last evaluation's figures needed, before step limits and "
                                        "stabilisation."),
            "capacityTokensPerSecondPerReplica": _num("Estimated output tokens/s one replica gives at the batch it "
                                                      "would run."),
            "demandTokensPerSecond": _num("Output tokens/s the requests in the system need."),
            "decisions": {"type": "array", "description": "The last replica changes, oldest first.",
                          "items": _obj("One replica change.", {
                              "time": _str("When.", format="date-time"),
                              "from": _int("Replicas before."),
                              "to": _int("Replicas after."),
                              "reason": _str("Why, with the figures."),
                              "inputs": {"type": "object", "description": "The figures the decision used.",
                                         "x-kubernetes-preserve-unknown-fields": True},
                          })},
        }),
        "drafterPool": _obj("The shared drafter pool's autoscaling (only with drafterPool.minReplicas/maxReplicas).", {
            "desiredReplicas": _int("Pool replicas the last evaluation asked for."),
            "utilization": _num("Busy share per pool replica at the last evaluation (drafting seconds per second)."),
            "metricsAvailable": {"type": "boolean", "description": "Whether the last evaluation had the pool's "
                                                                   "metrics."},
            "message": _str("The last evaluation's reason in words."),
        }),
    })


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    columns = [
        {"name": "Mode", "type": "string", "jsonPath": ".spec.speculation.mode", "description": "Speculation mode."},
        {"name": "Ready", "type": "string", "jsonPath": ".status.ready",
         "description": "Engine replicas ready/desired."},
        {"name": "Acceptance", "type": "number", "jsonPath": ".status.speculation.acceptanceRate",
         "description": "Draft acceptance rate."},
        {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "description": "Gateway endpoint."},
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "priority": 1, "description": "Phase."},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/name": "minedraft",
                                                  "app.kubernetes.io/part-of": "minedraft"}},
        "spec": {
            "group": s.API_GROUP,
            "scope": "Namespaced",
            "names": {"kind": s.KIND, "listKind": f"{s.KIND}List", "plural": s.PLURAL, "singular": "minedraft",
                      "shortNames": ["md"], "categories": ["all"]},
            "versions": [{
                "name": s.API_VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": _obj(
                    "MineDraft serves a target/draft model pair with batch-parallel speculative decoding.", {
                        "apiVersion": _str("APIVersion of this object."),
                        "kind": _str("Kind of this object."),
                        "metadata": {"type": "object", "description": "Standard object metadata."},
                        "spec": spec_schema(),
                        "status": status_schema(),
                    }, required=["spec"], **{"x-kubernetes-validations": [_rule(
                        # Every generated name is the MineDraft's plus a suffix, and Service names are DNS-1035
                        # labels of at most 63 characters.
                        f"self.metadata.name.size() <= {s.MAX_NAME_LENGTH} && "
                        "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
                        f"metadata.name must be a DNS-1035 label (a lower-case letter first) of at most "
                        f"{s.MAX_NAME_LENGTH} characters: the operator names Services <name>-engine and "
                        "<name>-gateway", reason="FieldValueInvalid")]})},
                "subresources": {
                    "status": {},
                    "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                              "labelSelectorPath": ".status.selector"},
                },
                "additionalPrinterColumns": columns,
            }],
        },
    }


def apply_defaults(schema: Schema, value: Any) -> Any:
    """Structural defaulting as the API server does it: absent properties that have a default get it, recursively
    (so `minedraft operator render` shows and renders what the API server would store)."""
    if isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], v) for v in value]
    if not isinstance(value, dict) or schema.get("type") != "object":
        return value
    import copy

    out = dict(value)
    for name, sub in schema.get("properties", {}).items():
        if name not in out and "default" in sub:
            out[name] = copy.deepcopy(sub["default"])
        if name in out:
            out[name] = apply_defaults(sub, out[name])
    return out


def defaulted(resource: dict[str, Any]) -> dict[str, Any]:
    """A MineDraft as the API server stores it: the CRD's defaults applied."""
    return dict(apply_defaults(crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"], resource))


def crd_yaml() -> str:
    import yaml

    header = ("# Generated by `minedraft operator crd` from minedraft/operator/crd.py; do not edit by hand.\n"
              "# A test checks that this file matches the code.\n")
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)
