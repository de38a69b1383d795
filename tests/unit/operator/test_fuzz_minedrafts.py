"""MineDrafts nobody wrote: a seeded generator of varied specs run through admission and rendering.

Outside users apply resources the team never saw. The generator draws every optional field (boundary values 0, 1
and the maximum, sections left out, drafter pool and gateway on or off, autoscaling with scale to zero, auth and
TLS, extraArgs with JSON values and spaces, env, volumes and claims, long and dotted names), then makes each field
invalid in turn. Properties:

- admitted (the CRD's schema and CEL rules as the API server evaluates them: minedraft.operator.admission) means
  the operator's parser takes it and `minedraft operator render` renders it, into objects that pass Kubernetes'
  schemas (strict), the API server's own name/label/semantic checks (tests/kube_object_rules.py), PodSecurity
  `restricted` with any UID, and the images' contract (each command through the real `minedraft` parser);
- an invalid spec is refused at admission with a message naming the field, the parser (for MineDrafts admitted
  before a rule existed) never crashes on it, and `minedraft operator render` exits 2 naming it: never a traceback.

hypothesis is not installed here, so the generator is a seeded `random.Random`: each run draws the same specs, and
a failure message carries the spec (and its seed index) to reproduce it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from minedraft.operator import render
from minedraft.operator import spec as s
from minedraft.operator.admission import admit
from minedraft.operator.cli import render_documents
from minedraft.operator.crd import defaulted
from minedraft.operator.settings import OperatorSettings
from tests.image_contract import Image, read_image
from tests.image_contract import pod_problems as image_problems
from tests.kube_object_rules import object_problems
from tests.pod_security import fixed_id_violations, restricted_violations
from tests.unit.operator.test_crd import set_path

ROOT = Path(__file__).resolve().parents[3]
K8S_VERSION = "1.34"
SEED = 20261205
VALID_SPECS = 160
REGISTRY = "registry.example.com/minedraft"

# -- generator -------------------------------------------------------------------------------------------------------

NAMES = ["a", "qwen3-8b", "m" + "x" * (s.MAX_NAME_LENGTH - 2) + "1", "llama-3-1-70b-instruct", "z9"]
SECRET_NAMES = ["hf-token", "tok", "a" * 253, "team.example.com", "x-1.y-2"]
SECRET_KEYS = ["token", "t", "token.txt", ".hidden", "a_b-c.D9", "k" * 253]
CLAIMS = ["model-weights", "m", "weights.v2", "c" * 253]
JSON_EXTRA_ARGS = [
    ["--hf-overrides", '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}'],
    ['--compilation-config={"mode": 3, "cudagraph_capture_sizes": [1, 2, 4]}'],
    ['--hf-overrides {"max_position_embeddings": 131072}'],
    ["--kv-cache-dtype fp8"],
    ["--enforce-eager"],
    ["--gpu-memory-utilization=0.85", "--seed", "7"],
    ["--limit-mm-per-prompt", '{"image": 0}', "--enable-prefix-caching"],
]


def maybe(rng: random.Random, p: float = 0.5) -> bool:
    return rng.random() < p


def source(rng: random.Random, token: dict[str, str] | None) -> dict[str, Any]:
    kind = rng.choice(["huggingFace", "persistentVolumeClaim", "image"])
    if kind == "huggingFace":
        hf: dict[str, Any] = {"id": rng.choice(["Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B-Instruct", "x",
                                                "google/gemma_2.b-it", "gpt2", "Qwen/Qwen3-0.6B"])}
        if token is not None:
            hf["tokenSecretRef"] = token
        return {"huggingFace": hf}
    if kind == "persistentVolumeClaim":
        pvc: dict[str, Any] = {"claimName": rng.choice(CLAIMS)}
        if maybe(rng):
            pvc["path"] = rng.choice(["", "Qwen3-8B", "models/qwen/8b", "a..b", "./x"])
        return {"persistentVolumeClaim": pvc}
    return {"image": {"path": rng.choice(["/models/target", "/", "/opt/models/Qwen3 8B"])}}


def secret_ref(rng: random.Random) -> dict[str, str]:
    ref = {"name": rng.choice(SECRET_NAMES)}
    if maybe(rng):
        ref["key"] = rng.choice(SECRET_KEYS)
    return ref


def engine(rng: random.Random, drafter_gpu: bool) -> dict[str, Any]:
    eng: dict[str, Any] = {}
    options: dict[str, Any] = {
        "image": lambda: rng.choice(["registry.example.com/custom/engine:1", "engine"]),
        "imagePullPolicy": lambda: rng.choice(s.PULL_POLICIES),
        "targetGPUs": lambda: rng.choice([1, 2, 4] + ([] if drafter_gpu else [8])),
        "dtype": lambda: rng.choice(s.DTYPES),
        "drafterBackend": lambda: "vllm",
        "drafterGPUs": lambda: 1,
        "cpu": lambda: rng.choice([1, "500m", "16", "0.5", 64]),
        "memory": lambda: rng.choice(["64Gi", "1Gi", 137438953472, "512M", "1.5Ti"]),
        "shmSize": lambda: rng.choice(["16Gi", "1", "64Mi"]),
        "ephemeralStorage": lambda: rng.choice(["50Gi", "1", 1000]),
        "maxNumSeqs": lambda: rng.choice([1, 256, 65536]),
        "maxModelLen": lambda: rng.choice([s.MIN_MODEL_LEN, 4096, s.MAX_MODEL_LEN]),
        # At most the shortest maxModelLen drawn (a request is never longer than the context).
        "maxNumSeqsFromKV": lambda: {"requestTokens": rng.choice([1, s.MIN_MODEL_LEN])},
        "extraArgs": lambda: [w for group in rng.sample(JSON_EXTRA_ARGS, rng.randint(0, 3)) for w in group],
        "env": lambda: rng.sample([
            {"name": "NCCL_DEBUG", "value": "WARN"}, {"name": "EMPTY", "value": ""}, {"name": "UNSET"},
            {"name": "my.var-1", "value": "x y"},
            {"name": "HF_HUB_OFFLINE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "offline"}}},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "SECRET", "valueFrom": {"secretKeyRef": {"name": "s.x", "key": "k", "optional": True}}},
        ], rng.randint(0, 4)),
        "runtimeClassName": lambda: rng.choice(["nvidia", "nvidia.runtime-v2"]),
        "rolloutStrategy": lambda: rng.choice(s.ROLLOUT_STRATEGIES),
        "podDisruptionBudget": lambda: maybe(rng),
        "nodeSelector": lambda: rng.choice([{}, {"nvidia.com/gpu.product": "NVIDIA-H200"}, {"pool": ""}]),
        "tolerations": lambda: rng.choice([[], [{"key": "nvidia.com/gpu", "operator": "Exists",
                                                 "effect": "NoSchedule"}],
                                           [{"operator": "Exists"}],
                                           [{"key": "spot", "value": "true", "effect": "NoExecute",
                                             "tolerationSeconds": 30}]]),
        "affinity": lambda: {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}]}}},
        "priorityClassName": lambda: rng.choice(["inference", "system.high"]),
        "modelCache": lambda: rng.choice([{}, {"sizeLimit": "1"}, {"claimName": rng.choice(CLAIMS)},
                                          {"sizeLimit": 500000000000}]),
        "terminationGracePeriodSeconds": lambda: rng.choice([0, 1, 10, 11, 120, 3600]),
        "startupTimeoutSeconds": lambda: rng.choice([60, 61, 1800, 86400]),
        "httpPort": lambda: rng.choice([0, 1, 8000, 8080, 9401, 65535]),
    }
    for key, draw in options.items():
        if maybe(rng, 0.35):
            eng[key] = draw()
    return eng


def valid_minedraft(rng: random.Random) -> dict[str, Any]:
    """A MineDraft the CRD's rules admit (every constraint between fields respected), with optional fields drawn."""
    token = secret_ref(rng) if maybe(rng, 0.3) else None
    spec: dict[str, Any] = {"target": {"source": source(rng, token)}, "draft": {"source": source(rng, token)}}
    mode = rng.choice(s.MODES)
    pool = mode in (*s.DRAFTER_GPU_MODES, "auto") and maybe(rng, 0.25)
    autoscaled = maybe(rng, 0.4)
    gateway_on = maybe(rng, 0.75)
    bounds: dict[str, Any] = {}
    k_low, k_high = 1, s.MAX_SPECULATIVE_TOKENS
    if autoscaled:
        modes = rng.sample(s.AUTO_MODES, rng.randint(1, len(s.AUTO_MODES)))
        if mode in s.AUTO_MODES and mode not in modes:
            modes.append(mode)
        k_low = rng.randint(1, s.MAX_SPECULATIVE_TOKENS)
        k_high = rng.randint(k_low, s.MAX_SPECULATIVE_TOKENS)
        bounds = {"allowedModes": modes, "minSpeculativeTokens": k_low, "maxSpeculativeTokens": k_high}
    speculation: dict[str, Any] = {"mode": mode}
    k = rng.randint(k_low, k_high) if mode == "auto" else rng.choice([1, 3, s.MAX_SPECULATIVE_TOKENS])
    default_k_fits = k_low <= s.SpeculationSpec().num_speculative_tokens <= k_high
    if maybe(rng, 0.8) or (mode == "auto" and not default_k_fits):
        speculation["numSpeculativeTokens"] = k
    if mode in ("psd", "sd") and maybe(rng, 0.3):
        speculation["numExtraDraftTokens"] = rng.randint(0, s.MAX_SPECULATIVE_TOKENS - speculation.get(
            "numSpeculativeTokens", s.SpeculationSpec().num_speculative_tokens))
    if mode in s.ASYNC_STEP_MODES and maybe(rng, 0.3):
        speculation["asyncSteps"] = maybe(rng, 0.5)
    if (mode == "lookahead" or (mode == "auto" and "lookahead" in bounds.get("allowedModes", s.AUTO_MODES))) and maybe(
            rng, 0.4):
        speculation["lookaheadFanout"] = rng.choice([s.MIN_LOOKAHEAD_FANOUT, 6, s.MAX_LOOKAHEAD_FANOUT])
    if maybe(rng, 0.9) or mode != s.SpeculationSpec().mode or "numSpeculativeTokens" in speculation:
        spec["speculation"] = speculation
    drafter_gpu = not pool and (mode in s.DRAFTER_GPU_MODES or (mode == "auto" and any(
        m in s.DRAFTER_GPU_MODES for m in bounds.get("allowedModes", s.AUTO_MODES))))
    if maybe(rng, 0.8):
        spec["engine"] = engine(rng, drafter_gpu)
    if autoscaled:
        low = rng.choice([0, 1, 2]) if gateway_on else rng.choice([1, 2])
        autoscaling: dict[str, Any] = {"minReplicas": low, "maxReplicas": rng.choice([max(1, low), 4, s.MAX_REPLICAS]),
                                       "speculation": bounds}
        for key, value in (("targetUtilization", rng.choice([0.01, 0.75, 1])),
                           ("intervalSeconds", rng.choice([5, 3600])),
                           ("scaleDownStabilizationSeconds", rng.choice([0, 86400])),
                           ("maxScaleUpStep", rng.choice([1, s.MAX_REPLICAS])),
                           ("replicaCapacityTokensPerSecond", rng.choice([1, 2500.5])),
                           ("prometheus", {"address": "http://prometheus.monitoring:9090"})):
            if maybe(rng, 0.4):
                autoscaling[key] = value
        spec["autoscaling"] = autoscaling
    elif maybe(rng, 0.7):
        spec["replicas"] = rng.choice([0, 1, 3, s.MAX_REPLICAS])
    gateway: dict[str, Any] = {"enabled": gateway_on} if not gateway_on or maybe(rng, 0.2) else {}
    if gateway_on:
        port = rng.choice([1, 443, 50051, 65535])
        scale_to_zero = spec.get("autoscaling", {}).get("minReplicas") == 0
        for key, value in (("replicas", rng.choice([1, 100] if scale_to_zero else [0, 1, 100])),
                           ("image", "registry.example.com/gw:2"),
                           ("serviceType", rng.choice(s.SERVICE_TYPES)), ("port", port),
                           ("httpPort", rng.choice([0, 8080, 65535 if port != 65535 else 1])),
                           ("authTokenSecretRef", secret_ref(rng)),
                           ("tlsSecretRef", {"name": rng.choice(SECRET_NAMES)}),
                           ("maxInFlight", rng.choice([1, 1024, 1_000_000])), ("cpu", rng.choice(["1", 2, "250m"])),
                           ("memory", rng.choice(["1Gi", "64Mi"]))):
            if maybe(rng, 0.35):
                gateway[key] = value
    if gateway:
        spec["gateway"] = gateway
    if pool:
        backend = rng.choice(s.DRAFTER_BACKENDS)
        drafter: dict[str, Any] = {"tokenSecretRef": secret_ref(rng), **({"backend": backend} if maybe(rng) else {})}
        for key, value in (("replicas", rng.choice([0, 1, 64])), ("gpus", rng.choice([0, 1])),
                           ("backend", backend), ("window", rng.choice([0, 1, 4096]) if backend == "torch" else 0),
                           ("cpu", "4"), ("memory", "32Gi"), ("maxQueuedJobs", rng.choice([1, 100000])),
                           ("port", rng.choice([1, 50061, 65535])), ("targetUtilization", rng.choice([0.01, 1])),
                           ("maxNumSeqs", rng.choice([1, 64, 4096])), ("gpuMemory", rng.choice(["24Gi", "141Gi"]))):
            if maybe(rng, 0.4):
                drafter[key] = value
        if drafter.get("window") or drafter.get("gpus") == 0:
            drafter["backend"] = "torch"  # a window is the torch drafter's; so is a CPU pool
        context = spec.get("engine", {}).get("maxModelLen")
        if drafter.get("window") and context is not None and drafter["window"] >= context:
            drafter["window"] = context - 1  # shorter than the engines' context
        if maybe(rng, 0.3):
            drafter.update(minReplicas=1, maxReplicas=rng.choice([1, 64]))
        spec["drafterPool"] = drafter
        _fit_torch_pool(spec)
    if maybe(rng, 0.3):
        spec["imagePullSecrets"] = [{"name": n} for n in rng.sample(["regcred", "ghcr.io-pull", "a"], 2)]
    if maybe(rng, 0.3):
        spec["servedModelNames"] = rng.sample(["qwen3-8b", "Qwen/Qwen3-8B", "gpt-4o", "x" * 256, "a!~"], 3)
    return {"apiVersion": f"{s.API_GROUP}/{s.API_VERSION}", "kind": s.KIND,
            "metadata": {"name": rng.choice(NAMES), "namespace": "serving", "uid": "0f0f0f0f-0000-4000-8000-0000000f"},
            "spec": spec}


def _fit_torch_pool(spec: dict[str, Any]) -> None:
    """A torch pool whose preallocated KV fits its memory (the operator refuses one that does not): fewer requests
    per pod, then a window, as a user would."""
    drafter = spec["drafterPool"]
    for change in ({}, {"maxNumSeqs": 64}, {"maxNumSeqs": 1}, {"window": 8}):
        drafter.update(change)
        try:
            parsed = s.parse_spec(defaulted({"spec": spec})["spec"])
        except s.SpecError:
            continue
        if parsed.drafter_pool is not None:
            return
    raise AssertionError(f"no torch pool fits: {drafter}")


# -- checks ----------------------------------------------------------------------------------------------------------


@functools.cache
def _k8s_validator(kind: str, api_version: str) -> jsonschema.protocols.Validator:
    """kubernetes-validate's strict schema for one kind, built once (its validate() re-reads both files per call)."""
    import re

    from kubernetes_validate.utils import schema_contents
    from referencing import Registry, Resource

    version = [v for v in __import__("kubernetes_validate.utils").utils.all_versions()
               if v.split(".")[:2] <= K8S_VERSION.split(".")[:2]][-1]
    folder = f"kubernetes-json-schema/v{version}-local-strict"
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema = schema_contents(f"{folder}/{kind.lower()}-{group}.json", K8S_VERSION)
    registry = Resource.from_contents(schema) @ Registry()
    registry = Resource.from_contents(schema_contents(f"{folder}/_definitions.json", K8S_VERSION)) @ registry
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


def schema_problems(manifest: dict[str, Any]) -> list[str]:
    if manifest["kind"] == "PodMonitor":
        return []  # not a built-in kind: kubernetes-validate has no schema for it
    validator = _k8s_validator(manifest["kind"], manifest["apiVersion"])
    return [f"{manifest['kind']}/{manifest['metadata']['name']}: {'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(manifest)]


@functools.cache
def images() -> dict[str, Image]:
    return {name: read_image(ROOT / "docker" / f"{name}.Dockerfile") for name in ("engine", "gateway")}


OPTIONS = [
    render.RenderOptions(image_registry=REGISTRY),
    render.RenderOptions(image_registry=REGISTRY, monitoring=True, pod_fs_group=65532,
                         operator_namespace_selector={"kubernetes.io/metadata.name": "minedraft-system"},
                         operator_pod_selector={"app.kubernetes.io/name": "minedraft"}),
    render.RenderOptions(image_registry=REGISTRY, network_policy=False),
]


def rendered_problems(doc: dict[str, Any], options: render.RenderOptions) -> list[str]:
    manifests = render.render_resource(defaulted(doc), options)
    problems: list[str] = []
    for m in manifests:
        problems += schema_problems(m)
        problems += object_problems(m)
        if m["kind"] != "Deployment":
            continue
        pod = m["spec"]["template"]["spec"]
        where = m["metadata"]["name"]
        problems += [f"{where}: {v}" for v in restricted_violations(pod)]
        problems += [f"{where}: {v}" for v in fixed_id_violations(pod)
                     if not (options.pod_fs_group is not None and v.endswith(".fsGroup is fixed"))]
        if all(c["image"].startswith(REGISTRY + "/") for c in pod["containers"]):
            problems += [f"{where}: {p}" for p in image_problems(pod, images(), REGISTRY)]
        problems += [f"{where}: {p}" for p in placement_problems(pod, doc, options)]
        problems += [f"{where}: {p}" for p in least_privilege_problems(pod)]
    return problems


def placement_problems(pod: dict[str, Any], doc: dict[str, Any], options: render.RenderOptions) -> list[str]:
    """A pod that asks for GPUs goes where the engine's own pods go (GPU nodes often need the nvidia runtime class,
    a node selector and a taint toleration); an engine-image pod without GPUs still keeps to the nodes the engine's
    selector and tolerations name (architecture, zone); one that writes a claim gets the fsGroup that makes it
    writable."""
    out: list[str] = []
    engine = defaulted(doc)["spec"]["engine"]
    (container,) = pod["containers"]
    on_gpus = "nvidia.com/gpu" in container["resources"].get("limits", {})
    engine_image = container["name"] in ("engine", "drafter")
    kept = (("runtimeClassName", "runtimeClassName"), ("nodeSelector", "nodeSelector"), ("tolerations", "tolerations"),
            ("affinity", "affinity"), ("priorityClassName", "priorityClassName")) if on_gpus else \
        (("nodeSelector", "nodeSelector"), ("tolerations", "tolerations")) if engine_image else ()
    for field, key in kept:
        if engine.get(key) and pod.get(field) != engine[key]:
            out.append(f"{'asks for GPUs' if on_gpus else 'runs the engine image'} without the engine's {field} "
                       f"{engine[key]!r}")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    writes_claim = any("persistentVolumeClaim" in volumes[m["name"]] and not m.get("readOnly")
                       for m in container.get("volumeMounts", []))
    if writes_claim and options.pod_fs_group is not None and "fsGroup" not in pod.get("securityContext", {}):
        out.append("writes a PersistentVolumeClaim (root-owned when freshly provisioned) without the fsGroup "
                   f"{options.pod_fs_group} that makes it writable")
    return out


def least_privilege_problems(pod: dict[str, Any]) -> list[str]:
    """Every Secret a container mounts is a file its command reads (no credential where nothing uses it)."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    out = []
    for container in pod["containers"]:
        words = " ".join(container.get("command", []) + container.get("args", []))
        for mount in container.get("volumeMounts", []):
            if "secret" in volumes[mount["name"]] and mount["mountPath"] not in words:
                out.append(f"{container['name']} mounts Secret {volumes[mount['name']]['secret']['secretName']} at "
                           f"{mount['mountPath']}, which its command never reads")
    return out


def generated(count: int, seed: int = SEED) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [valid_minedraft(rng) for _ in range(count)]


def test_generated_minedrafts_are_admitted_and_render_into_objects_a_cluster_takes() -> None:
    failures: list[str] = []
    for index, doc in enumerate(generated(VALID_SPECS)):
        refused = admit(doc)
        if refused:
            failures.append(f"#{index} refused at admission: {refused}\n{json.dumps(doc['spec'])}")
            continue
        try:
            problems = rendered_problems(doc, OPTIONS[index % len(OPTIONS)])
        except s.SpecError as exc:
            problems = [f"admitted but the parser refuses it: {exc.errors}"]
        if problems:
            failures.append(f"#{index} {doc['metadata']['name']}: {problems[:4]}\n{json.dumps(doc['spec'])}")
    distinct = sorted({line.split("\n")[0].split(": ", 1)[-1][-300:] for line in failures})
    assert not failures, (f"{len(failures)} of {VALID_SPECS}; distinct problems:\n" + "\n".join(distinct[:20])
                          + "\nfirst:\n" + "\n".join(failures[:2]))


def test_the_generator_covers_what_it_claims() -> None:
    """Guard against a generator that drifted into drawing one kind of spec."""
    docs = generated(VALID_SPECS)
    specs = [d["spec"] for d in docs]
    assert sum("drafterPool" in x for x in specs) >= 10
    assert sum(x.get("gateway", {}).get("enabled") is False for x in specs) >= 10
    assert sum(x.get("autoscaling", {}).get("minReplicas") == 0 for x in specs) >= 5
    assert sum("authTokenSecretRef" in x.get("gateway", {}) for x in specs) >= 5
    assert sum(" " in " ".join(x.get("engine", {}).get("extraArgs", [])) for x in specs) >= 5
    assert sum(len(d["metadata"]["name"]) == s.MAX_NAME_LENGTH for d in docs) >= 10
    assert {m for x in specs for m in [x.get("speculation", {}).get("mode", s.SpeculationSpec().mode)]} == set(s.MODES)


# -- invalid, one field at a time --------------------------------------------------------------------------------------

# Refused by the operator's parser (the MineDraft gets Ready=False, InvalidSpec, naming the field, and
# `minedraft operator render` refuses it) but not at admission: a rule the CRD cannot carry within the API
# server's CEL cost estimate (map keys have no length bound there; a regex over every extraArgs item for mixed
# '-'/'_' spellings), or one needing list indexes CEL lacks.
PARSER_ONLY = "parser only"

# (where, value, field the refusal must name[, PARSER_ONLY]). `where` is a dotted path from the document's root;
# `None` as value deletes the field. Each is applied to several generated MineDrafts.
INVALID: list[tuple[Any, ...]] = [
    ("metadata.name", "Qwen3", "metadata.name"),
    ("metadata.name", "7b", "metadata.name"),
    ("metadata.name", "a.b", "metadata.name"),
    ("metadata.name", "n" * (s.MAX_NAME_LENGTH + 1), "metadata.name"),
    ("metadata.name", None, "metadata.name"),
    ("metadata.name", 5, "metadata.name"),
    ("spec.target", None, "spec.target"),
    ("spec.draft.source", {}, "spec.draft.source"),
    ("spec.target.source", {"image": {"path": "/m"}, "huggingFace": {"id": "x"}}, "spec.target.source"),
    ("spec.target.source", {"huggingFace": {"id": ""}}, "spec.target.source.huggingFace.id"),
    ("spec.target.source", {"huggingFace": {"id": "https://huggingface.co/Qwen/Qwen3-8B"}},
     "spec.target.source.huggingFace.id"),
    ("spec.draft.source", {"huggingFace": {"id": "Qwen/Qwen3 0.6B"}}, "spec.draft.source.huggingFace.id"),
    ("spec.target.source", {"huggingFace": {"id": "x", "tokenSecretRef": {"name": "HF"}}},
     "spec.target.source.huggingFace.tokenSecretRef.name"),
    ("spec.target.source", {"persistentVolumeClaim": {"claimName": "Weights"}},
     "spec.target.source.persistentVolumeClaim.claimName"),
    ("spec.target.source", {"persistentVolumeClaim": {"claimName": "w", "path": "/abs"}},
     "spec.target.source.persistentVolumeClaim.path"),
    ("spec.draft.source", {"persistentVolumeClaim": {"claimName": "w", "path": "a/../../etc"}},
     "spec.draft.source.persistentVolumeClaim.path"),
    ("spec.target.source", {"image": {"path": "models"}}, "spec.target.source.image.path"),
    ("spec.speculation.mode", "eagle", "spec.speculation.mode"),
    ("spec.speculation.numSpeculativeTokens", 0, "spec.speculation.numSpeculativeTokens"),
    ("spec.speculation.numSpeculativeTokens", 17, "spec.speculation.numSpeculativeTokens"),
    ("spec.speculation", {"mode": "ar", "numExtraDraftTokens": 1}, "spec.speculation.numExtraDraftTokens"),
    ("spec.speculation", {"mode": "ar", "asyncSteps": True}, "spec.speculation.asyncSteps"),
    ("spec.speculation", {"mode": "lookahead", "lookaheadFanout": 0}, "spec.speculation.lookaheadFanout"),
    ("spec.speculation", {"mode": "lookahead", "lookaheadFanout": 17}, "spec.speculation.lookaheadFanout"),
    ("spec.speculation", {"mode": "psd", "lookaheadFanout": 4}, "spec.speculation.lookaheadFanout"),
    ("spec.speculation", {"mode": "psd", "numSpeculativeTokens": 9, "numExtraDraftTokens": 8},
     "spec.speculation.numExtraDraftTokens"),
    ("spec.engine.image", "", "spec.engine.image"),
    ("spec.engine.imagePullPolicy", "Sometimes", "spec.engine.imagePullPolicy"),
    ("spec.engine.targetGPUs", 0, "spec.engine.targetGPUs"),
    ("spec.engine.targetGPUs", 9, "spec.engine.targetGPUs"),
    *[("spec.engine.targetGPUs", tp, "spec.engine.targetGPUs") for tp in (3, 5, 6, 7)],
    ("spec.engine.dtype", "int8", "spec.engine.dtype"),
    ("spec.engine.drafterBackend", "torch", "spec.engine.drafterBackend"),
    ("spec.engine.drafterGPUs", 2, "spec.engine.drafterGPUs"),
    ("spec.engine.cpu", "8 cores", "spec.engine.cpu"),
    ("spec.engine.memory", "-1Gi", "spec.engine.memory"),
    ("spec.engine.shmSize", "1.5.5", "spec.engine.shmSize"),
    ("spec.engine.ephemeralStorage", "lots", "spec.engine.ephemeralStorage"),
    ("spec.engine.maxNumSeqs", 0, "spec.engine.maxNumSeqs"),
    ("spec.engine.maxModelLen", 15, "spec.engine.maxModelLen"),
    ("spec.engine.maxNumSeqsFromKV", {"requestTokens": 0}, "spec.engine.maxNumSeqsFromKV.requestTokens"),
    ("spec.engine.maxNumSeqsFromKV", {}, "spec.engine.maxNumSeqsFromKV.requestTokens"),
    ("spec.engine.extraArgs", ["--model=x"], "spec.engine.extraArgs"),
    ("spec.engine.extraArgs", ["--max-model-len 4096"], "spec.engine.extraArgs"),
    ("spec.engine.extraArgs", ["--max_model_len=4096"], "spec.engine.extraArgs"),
    ("spec.engine.extraArgs", ["--tensor_parallel_size", "2"], "spec.engine.extraArgs"),
    ("spec.engine.extraArgs", ["4096"], "spec.engine.extraArgs"),
    ("spec.engine.extraArgs", ["enforce-eager"], "spec.engine.extraArgs"),
    ("spec.engine.extraArgs", ["--enforce-eager=true", "x"], "spec.engine.extraArgs", PARSER_ONLY),
    ("spec.engine.extraArgs", ["--max_model-len=4096"], "spec.engine.extraArgs", PARSER_ONLY),
    ("spec.engine.extraArgs", [""], "spec.engine.extraArgs"),
    ("spec.engine.extraArgs", "--enforce-eager", "spec.engine.extraArgs"),
    ("spec.engine.env", [{"name": "1X", "value": "1"}], "spec.engine.env"),
    ("spec.engine.env", [{"name": "X", "value": 1}], "spec.engine.env"),
    ("spec.engine.env", [{"value": "1"}], "spec.engine.env"),
    ("spec.engine.env", [{"name": "X", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
     "spec.engine.env"),
    ("spec.engine.env", [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s"}}}], "spec.engine.env"),
    ("spec.engine.env", [{"name": "X", "valueFrom": {}}], "spec.engine.env"),
    ("spec.engine.env", [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "S_", "key": "k"}}}],
     "spec.engine.env"),
    ("spec.engine.runtimeClassName", "NVIDIA", "spec.engine.runtimeClassName"),
    ("spec.engine.priorityClassName", "high_prio", "spec.engine.priorityClassName"),
    ("spec.engine.rolloutStrategy", "Recreate", "spec.engine.rolloutStrategy"),
    ("spec.engine.podDisruptionBudget", "yes", "spec.engine.podDisruptionBudget"),
    ("spec.engine.nodeSelector", {"gpu": 1}, "spec.engine.nodeSelector"),
    ("spec.engine.nodeSelector", {"bad key!": "x"}, "spec.engine.nodeSelector", PARSER_ONLY),
    ("spec.engine.nodeSelector", {"gpu": "h200 sxm"}, "spec.engine.nodeSelector"),
    ("spec.engine.tolerations", [{"operator": "Sometimes"}], "spec.engine.tolerations"),
    ("spec.engine.tolerations", [{"key": "gpu", "operator": "Exists", "value": "x"}], "spec.engine.tolerations"),
    ("spec.engine.tolerations", [{"key": "gpu", "effect": "NoRun"}], "spec.engine.tolerations"),
    ("spec.engine.tolerations", [{"key": "gpu", "tolerationSeconds": "30", "effect": "NoExecute"}],
     "spec.engine.tolerations"),
    ("spec.engine.tolerations", [{"key": "gpu", "tolerationSeconds": 30, "effect": "NoSchedule"}],
     "spec.engine.tolerations"),
    ("spec.engine.tolerations", [{"value": "x"}], "spec.engine.tolerations"),
    ("spec.engine.affinity", {"nodeAffinity": "h200"}, "spec.engine.affinity"),
    ("spec.engine.affinity", {"gpuAffinity": {}}, "spec.engine.affinity"),
    ("spec.engine.modelCache", {"claimName": "Cache"}, "spec.engine.modelCache.claimName"),
    ("spec.engine.modelCache", {"sizeLimit": "big"}, "spec.engine.modelCache.sizeLimit"),
    ("spec.engine.terminationGracePeriodSeconds", -1, "spec.engine.terminationGracePeriodSeconds"),
    ("spec.engine.terminationGracePeriodSeconds", 3601, "spec.engine.terminationGracePeriodSeconds"),
    ("spec.engine.startupTimeoutSeconds", 59, "spec.engine.startupTimeoutSeconds"),
    ("spec.engine.httpPort", 50051, "spec.engine.httpPort"),
    ("spec.engine.httpPort", 9400, "spec.engine.httpPort"),
    ("spec.engine.httpPort", 65536, "spec.engine.httpPort"),
    ("spec.replicas", -1, "spec.replicas"),
    ("spec.replicas", s.MAX_REPLICAS + 1, "spec.replicas"),
    ("spec.replicas", "2", "spec.replicas"),
    ("spec.autoscaling", {"minReplicas": 3, "maxReplicas": 2}, "spec.autoscaling.minReplicas"),
    ("spec.autoscaling", {"maxReplicas": 0}, "spec.autoscaling.maxReplicas"),
    ("spec.autoscaling", {"targetUtilization": 0}, "spec.autoscaling.targetUtilization"),
    ("spec.autoscaling", {"targetUtilization": 1.5}, "spec.autoscaling.targetUtilization"),
    ("spec.autoscaling", {"intervalSeconds": 4}, "spec.autoscaling.intervalSeconds"),
    ("spec.autoscaling", {"speculation": {"allowedModes": []}}, "spec.autoscaling.speculation.allowedModes"),
    ("spec.autoscaling", {"speculation": {"allowedModes": ["vllm-sd"]}}, "spec.autoscaling.speculation.allowedModes"),
    ("spec.autoscaling", {"speculation": {"allowedModes": ["ar", "ar"]}},
     "spec.autoscaling.speculation.allowedModes"),
    ("spec.autoscaling", {"speculation": {"minSpeculativeTokens": 5, "maxSpeculativeTokens": 4}},
     "spec.autoscaling.speculation.minSpeculativeTokens"),
    ("spec.autoscaling", {"replicaCapacityTokensPerSecond": 0.5},
     "spec.autoscaling.replicaCapacityTokensPerSecond"),
    ("spec.autoscaling", {"prometheus": {"address": ""}}, "spec.autoscaling.prometheus.address"),
    ("spec.gateway.enabled", "yes", "spec.gateway.enabled"),
    ("spec.gateway.replicas", 101, "spec.gateway.replicas"),
    ("spec.gateway.serviceType", "Ingress", "spec.gateway.serviceType"),
    ("spec.gateway.port", 0, "spec.gateway.port"),
    ("spec.gateway", {"port": 8080, "httpPort": 8080}, "spec.gateway.httpPort"),
    ("spec.gateway.authTokenSecretRef", {}, "spec.gateway.authTokenSecretRef"),
    ("spec.gateway.authTokenSecretRef", {"name": "t", "key": ".."}, "spec.gateway.authTokenSecretRef.key"),
    ("spec.gateway.authTokenSecretRef", {"name": "t", "key": "..data"}, "spec.gateway.authTokenSecretRef.key"),
    ("spec.gateway.authTokenSecretRef", {"name": "t", "key": "."}, "spec.gateway.authTokenSecretRef.key"),
    ("spec.gateway.tlsSecretRef", {"name": ""}, "spec.gateway.tlsSecretRef.name"),
    ("spec.gateway.maxInFlight", 0, "spec.gateway.maxInFlight"),
    ("spec.gateway.maxInFlight", 1_000_001, "spec.gateway.maxInFlight"),
    ("spec.gateway.memory", "lots", "spec.gateway.memory"),
    ("spec.gateway", {"enabled": False, "authTokenSecretRef": {"name": "t"}}, "spec.gateway.authTokenSecretRef"),
    ("spec.gateway", {"enabled": False, "tlsSecretRef": {"name": "t"}}, "spec.gateway.tlsSecretRef"),
    ("spec", {"target": {"source": {"image": {"path": "/m"}}}, "draft": {"source": {"image": {"path": "/d"}}},
              "autoscaling": {"minReplicas": 0}, "gateway": {"replicas": 0}}, "spec.autoscaling.minReplicas"),
    ("spec.imagePullSecrets", [{"name": "Reg"}], "spec.imagePullSecrets"),
    ("spec.imagePullSecrets", ["regcred"], "spec.imagePullSecrets"),
    ("spec.servedModelNames", ["has space"], "spec.servedModelNames"),
    ("spec.servedModelNames", ["a", "a"], "spec.servedModelNames"),
    ("spec.servedModelNames", [f"n{i}" for i in range(17)], "spec.servedModelNames"),
    ("spec.servedModelNames", [""], "spec.servedModelNames"),
    ("spec.drafterPool", {"tokenSecretRef": {}}, "spec.drafterPool.tokenSecretRef"),
    ("spec.drafterPool", {"tokenSecretRef": {"name": "d"}, "replicas": 65}, "spec.drafterPool.replicas"),
    ("spec.drafterPool", {"tokenSecretRef": {"name": "d"}, "gpus": 9}, "spec.drafterPool.gpus"),
    ("spec.drafterPool", {"tokenSecretRef": {"name": "d"}, "gpus": 2}, "spec.drafterPool.gpus"),
    ("spec.drafterPool", {"tokenSecretRef": {"name": "d"}, "gpus": 0}, "spec.drafterPool.backend"),
    ("spec.drafterPool", {"tokenSecretRef": {"name": "d"}, "gpus": 0, "backend": "vllm"}, "spec.drafterPool.backend"),
    ("spec.drafterPool", {"tokenSecretRef": {"name": "d"}, "maxNumSeqs": 0}, "spec.drafterPool.maxNumSeqs"),
    ("spec.drafterPool", {"tokenSecretRef": {"name": "d"}, "backend": "jax"}, "spec.drafterPool.backend"),
    ("spec.drafterPool", {"tokenSecretRef": {"name": "d"}, "window": 8}, "spec.drafterPool.window"),
    ("spec.drafterPool", {"tokenSecretRef": {"name": "d"}, "backend": "torch", "window": 2_000_000},
     "spec.drafterPool.window"),
    ("spec.drafterPool", {"tokenSecretRef": {"name": "d"}, "minReplicas": 1}, "spec.drafterPool.minReplicas"),
    ("spec.drafterPool", {"tokenSecretRef": {"name": "d"}, "minReplicas": 3, "maxReplicas": 2},
     "spec.drafterPool.minReplicas"),
    ("spec.drafterPool", {"tokenSecretRef": {"name": "d"}, "port": 0}, "spec.drafterPool.port"),
    ("spec.drafterPool", {"tokenSecretRef": {"name": "d"}, "port": render.DRAFTER_METRICS_PORT},
     "spec.drafterPool.port"),
    ("spec.drafterPool", {"tokenSecretRef": {"name": "d"}, "maxQueuedJobs": 0}, "spec.drafterPool.maxQueuedJobs"),
    ("spec.drafterPool", {"tokenSecretRef": {"name": "d", "key": "..k"}}, "spec.drafterPool.tokenSecretRef.key"),
    ("spec.unknownField", 1, "spec"),
    ("spec.engine.targetGPU", 2, "spec.engine"),
]


def mutate(doc: dict[str, Any], where: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    set_path(doc, where.split("."), value)
    if where.startswith("spec.drafterPool"):
        doc["spec"].setdefault("speculation", {})["mode"] = "psd"
        doc["spec"]["speculation"].pop("numExtraDraftTokens", None)
    return doc


def _names(message: str, field: str) -> bool:
    """Whether an admission message (`path: text`, path dotted with list indexes as .0) names `field`."""
    path, _, text = message.partition(": ")
    path = path.replace(".0", "")
    return path == field or path.startswith(field + ".") or path.startswith(field + "[") or field in text


BASES = generated(6, seed=SEED + 1)


@pytest.mark.parametrize("case", INVALID, ids=[f"{c[0]}={c[1]!r}"[:60] for c in INVALID])
def test_each_invalid_field_is_refused_naming_it(case: tuple[Any, ...]) -> None:
    where, value, field = case[:3]
    for base in BASES:
        doc = mutate(base, where, value)
        refused = admit(doc)
        if PARSER_ONLY in case:
            assert not refused, refused  # if admission learns to refuse it, drop the PARSER_ONLY mark
            with pytest.raises(s.SpecError) as parsed:
                render.render_resource(defaulted(doc), OPTIONS[0])
            assert any(_names(e, field) for e in parsed.value.errors), parsed.value.errors
        else:
            assert any(_names(m, field) for m in refused), (field, refused, json.dumps(doc["spec"]))
            # The operator's parser (MineDrafts stored before a rule existed): a SpecError or, where only admission
            # refuses (unknown fields), a rendering; never another exception.
            with contextlib.suppress(s.SpecError):
                render.render_resource(defaulted(doc), OPTIONS[0])
        # `minedraft operator render`: admission's answer, naming the field.
        with pytest.raises(s.SpecError) as info:
            render_documents([doc], OperatorSettings(), monitoring_available=False)
        assert any(field in e for e in info.value.errors), info.value.errors


@pytest.mark.parametrize("document", [None, [], "text", 5, {"apiVersion": "minedraft.io/v1alpha1"},
                                      {"apiVersion": "minedraft.io/v1alpha1", "kind": "MineDraft"},
                                      {"apiVersion": "minedraft.io/v1alpha1", "kind": "MineDraft", "metadata": []},
                                      {"apiVersion": "minedraft.io/v1alpha1", "kind": "MineDraft",
                                       "metadata": {"name": "x"}, "spec": []}],
                         ids=["null", "list", "text", "number", "no-kind", "no-metadata", "metadata-list",
                              "spec-list"])
def test_render_refuses_any_yaml_document_without_a_traceback(document: Any, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from minedraft.cli import main

    path = tmp_path / "md.yaml"
    path.write_text(yaml.safe_dump(document) if document is not None else "---\n~\n---\nkind: 1\n")
    assert main(["operator", "render", "-f", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip()


def test_a_claim_without_path_serves_the_volumes_root() -> None:
    """Found by the generator: the CRD defaults persistentVolumeClaim.path to "", which the parser refused as an
    empty string, so every MineDraft with a claim and no path was admitted and then never rendered."""
    doc = valid_minedraft(random.Random(0))
    doc["spec"]["target"] = {"source": {"persistentVolumeClaim": {"claimName": "weights"}}}
    assert admit(doc) == []
    engine = next(m for m in render.render_resource(defaulted(doc), OPTIONS[0])
                  if m["kind"] == "Deployment" and m["metadata"]["name"].endswith("-engine"))
    command = engine["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--model") + 1] == f"{render.MODEL_PVC_ROOT}/weights"


WRONG_TYPES: list[Any] = [[], {}, "x", "", 0, -1, True, 1.5, [{}], ["x"], {"x": 1}]


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            out += _paths(value, (*prefix, index))
    return out


def test_any_field_of_any_type_is_answered_never_crashed_on() -> None:
    """Every field of generated MineDrafts replaced by values of every other JSON type: admission answers (a list,
    no exception) and the operator's parser raises SpecError or renders, never another exception, which would be a
    crash loop of the handler for a MineDraft stored before a rule existed (or edited through a lax client)."""
    rng = random.Random(SEED + 2)
    crashes: list[str] = []
    for doc in generated(12, seed=SEED + 3):
        paths = _paths(doc["spec"], ("spec",))
        for path in rng.sample(paths, min(len(paths), 40)):
            for value in WRONG_TYPES:
                bad = copy.deepcopy(doc)
                node = bad
                for key in path[:-1]:
                    node = node[key]
                node[path[-1]] = value
                where = ".".join(map(str, path))
                try:
                    assert isinstance(admit(bad), list)
                except Exception as exc:  # reported with the case
                    crashes.append(f"admit, {where}={value!r}: {type(exc).__name__}: {exc}")
                try:
                    render.render_resource(defaulted(bad), OPTIONS[0])
                except s.SpecError:
                    pass
                except Exception as exc:  # reported with the case
                    crashes.append(f"parser, {where}={value!r}: {type(exc).__name__}: {exc}")
    assert not crashes, f"{len(crashes)} crashes:\n" + "\n".join(sorted(set(crashes))[:25])
