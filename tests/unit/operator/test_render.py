"""Pure rendering: every example and the edge cases, and every rendered object against Kubernetes' own schemas."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from minedraft.operator import render
from minedraft.operator import spec as s

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
K8S_VERSION = "1.34"  # pinned: a recent release (kubernetes-validate 1.37 ships 1.25-1.37)
UID = "4f9c2f7e-0000-4000-8000-000000000001"


def load(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    doc["metadata"].update(namespace="serving", uid=UID)
    return doc


def by_kind(manifests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for m in manifests:
        key = m["kind"] if m["kind"] not in out else f"{m['kind']}/{m['metadata']['name']}"
        out[key] = m
    return out


def engine_container(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    dep = next(m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"].endswith("-engine"))
    return dep["spec"]["template"]["spec"]["containers"][0]


def gateway_deployment(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return next(m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"].endswith("-gateway"))


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


@pytest.mark.parametrize("options", [render.RenderOptions(), render.RenderOptions(monitoring=True),
                                     render.RenderOptions(network_policy=False)], ids=["default", "monitor", "no-np"])
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_renders_valid_objects(path: Path, options: render.RenderOptions) -> None:
    manifests = render.render_resource(load(path.stem), options)
    for m in manifests:
        if m["kind"] == "PodMonitor":
            continue  # not a built-in kind: no schema in kubernetes-validate
        kubernetes_validate.validate(m, K8S_VERSION, strict=True)
        assert m["metadata"]["namespace"] == "serving"
        assert m["metadata"]["ownerReferences"] == [render.owner_reference(s.parse_meta(load(path.stem)["metadata"]))]
        assert m["metadata"]["labels"]["app.kubernetes.io/managed-by"] == render.MANAGED_BY
    kinds = [m["kind"] for m in manifests]
    assert ("NetworkPolicy" in kinds) == options.network_policy
    assert ("PodMonitor" in kinds) == options.monitoring


def test_engine_pod_minimal() -> None:
    manifests = render.render_resource(load("minimal"))
    objs = by_kind(manifests)
    dep = objs["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    # 1 target GPU + 1 drafter GPU, and the drafter pinned to the last one.
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert flag(c["command"], "--drafter-gpu") == "1"
    assert c["command"][:2] == ["minedraft", "serve"]
    assert flag(c["command"], "--host") == "0.0.0.0"
    assert flag(c["command"], "--model") == "Qwen/Qwen3-8B" and flag(c["command"], "--draft") == "Qwen/Qwen3-0.6B"
    assert flag(c["command"], "--mode") == "psd" and flag(c["command"], "--num-speculative-tokens") == "3"
    # gRPC probes on the health service, startup long enough for loading the weights.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": render.ENGINE_GRPC_PORT}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= s.EngineSpec().startup_timeout_seconds
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50051, "metrics": 9400}
    # Non-root, read-only root, writable paths on emptyDirs, shm in memory.
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert {"/tmp", "/dev/shm", render.CACHE_DIR, render.MODEL_CACHE_DIR} <= set(mounts)
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HOME"] == "/tmp" and env["HF_HOME"].startswith(render.MODEL_CACHE_DIR)
    assert pod["automountServiceAccountToken"] is False
    assert pod["terminationGracePeriodSeconds"] == s.EngineSpec().termination_grace_period_seconds
    assert int(flag(c["command"], "--grace-seconds") or 0) < pod["terminationGracePeriodSeconds"]
    liveness = c["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > pod["terminationGracePeriodSeconds"]
    # Rollouts never drop capacity.
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert dep["spec"]["replicas"] == 1


def test_services_pdb_and_gateway_rbac() -> None:
    manifests = render.render_resource(load("minimal"))
    objs = {(m["kind"], m["metadata"]["name"]): m for m in manifests}
    engine_svc = objs[("Service", "qwen3-8b-engine")]
    assert engine_svc["spec"]["clusterIP"] == "None"
    assert engine_svc["spec"]["selector"] == render.selector_labels(s.parse_meta(load("minimal")["metadata"]),
                                                                    "engine")
    gw_svc = objs[("Service", "qwen3-8b-gateway")]
    assert gw_svc["spec"]["type"] == "ClusterIP" and gw_svc["spec"]["ports"][0]["port"] == 50051
    assert objs[("PodDisruptionBudget", "qwen3-8b-engine")]["spec"]["maxUnavailable"] == 1
    role = objs[("Role", "qwen3-8b-gateway")]
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    binding = objs[("RoleBinding", "qwen3-8b-gateway")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "qwen3-8b-gateway", "namespace": "serving"}]
    gw = objs[("Deployment", "qwen3-8b-gateway")]
    command = gw["spec"]["template"]["spec"]["containers"][0]["command"]
    assert flag(command, "--kubernetes-service") == "serving/qwen3-8b-engine"
    assert gw["spec"]["template"]["spec"]["serviceAccountName"] == "qwen3-8b-gateway"
    assert "--token-file" not in command and "--tls-cert" not in command
    ports = gw["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert {p["name"]: p["containerPort"] for p in ports} == {"grpc": 50051, "metrics": render.GATEWAY_METRICS_PORT}
    monitor = render.pod_monitor(s.parse_meta(load("minimal")["metadata"]))
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["selector"]["matchExpressions"][0]["values"] == ["engine", "gateway"]


def test_network_policy_admits_only_gateway_and_prometheus() -> None:
    options = render.RenderOptions(prometheus_namespace_selector={"team": "obs"},
                                   prometheus_pod_selector={"app": "prom"})
    policy = next(m for m in render.render_resource(load("minimal"), options) if m["kind"] == "NetworkPolicy")
    ingress = policy["spec"]["ingress"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert ingress[0] == {"from": [{"podSelector": {"matchLabels": {"minedraft.io/instance": "qwen3-8b",
                                                                    "minedraft.io/component": "gateway"}}}],
                          "ports": [{"protocol": "TCP", "port": render.ENGINE_GRPC_PORT}]}
    assert ingress[1]["from"] == [{"namespaceSelector": {"matchLabels": {"team": "obs"}},
                                   "podSelector": {"matchLabels": {"app": "prom"}}}]
    assert ingress[1]["ports"] == [{"protocol": "TCP", "port": render.ENGINE_METRICS_PORT}]


def test_auth_and_tls_reference_secrets_by_name_only() -> None:
    manifests = render.render_resource(load("auth-tls"))
    gw = gateway_deployment(manifests)
    pod = gw["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert flag(c["command"], "--token-file") == f"{render.AUTH_DIR}/token"
    assert flag(c["command"], "--tls-cert") == f"{render.TLS_DIR}/tls.crt"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["auth"]["secret"]["secretName"] == "minedraft-token"
    assert volumes["tls"]["secret"]["secretName"] == "minedraft-tls"
    # A kubelet gRPC probe cannot speak TLS: TCP checks instead.
    assert "tcpSocket" in c["readinessProbe"] and "grpc" not in c["readinessProbe"]
    svc = next(m for m in manifests if m["kind"] == "Service" and m["metadata"]["name"].endswith("-gateway"))
    assert svc["spec"]["type"] == "LoadBalancer" and svc["spec"]["ports"][0]["port"] == 443
    engine = engine_container(manifests)
    token = next(e for e in engine["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}


def test_autoscaled_pvc_models_and_auto_mode() -> None:
    manifests = render.render_resource(load("autoscaled"))
    dep = next(m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"].endswith("-engine"))
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    # Both models on one claim: mounted once, read-only.
    claims = [v for v in pod["volumes"] if "persistentVolumeClaim" in v and v["name"].startswith("models-")]
    assert claims == [{"name": "models-0", "persistentVolumeClaim": {"claimName": "model-weights",
                                                                     "readOnly": True}}]
    assert flag(c["command"], "--model") == f"{render.MODEL_PVC_ROOT}/model-weights/Qwen3-14B"
    assert flag(c["command"], "--draft") == f"{render.MODEL_PVC_ROOT}/model-weights/Qwen3-0.6B"
    # auto mode may lengthen drafts up to the autoscaling bound; replicas start at the floor.
    assert flag(c["command"], "--mode") == "auto"
    assert flag(c["command"], "--max-num-speculative-tokens") == "8"
    assert dep["spec"]["replicas"] == 1
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu" and pod["priorityClassName"] == "inference"
    assert flag(c["command"], "--max-num-seqs") == "128"


def test_edge_cases() -> None:
    doc = load("minimal")
    doc["spec"]["engine"] = {"extraArgs": ["--kv-cache-gib", "40"], "modelCache": {"claimName": "hf-cache"},
                             "affinity": {"nodeAffinity": {}}, "cpu": "0.5", "terminationGracePeriodSeconds": 5}
    doc["spec"]["gateway"] = {"replicas": 0, "maxInFlight": 7}
    doc["spec"]["target"]["source"] = {"image": {"path": "/models/target"}}
    manifests = render.render_resource(doc)
    c = engine_container(manifests)
    assert c["command"][-2:] == ["--kv-cache-gib", "40"]
    assert flag(c["command"], "--model") == "/models/target"
    assert flag(c["command"], "--grace-seconds") == "1"
    pod = next(m for m in manifests if m["metadata"]["name"] == "qwen3-8b-engine"
               and m["kind"] == "Deployment")["spec"]["template"]["spec"]
    cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert cache == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "hf-cache"}}
    assert pod["affinity"] == {"nodeAffinity": {}}
    gw = gateway_deployment(manifests)
    assert gw["spec"]["replicas"] == 0
    assert flag(gw["spec"]["template"]["spec"]["containers"][0]["command"], "--max-in-flight") == "7"
    # /scale sets spec.replicas; it wins over the autoscaling floor.
    doc = load("autoscaled")
    doc["spec"]["replicas"] = 3
    dep = next(m for m in render.render_resource(doc) if m["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 3


def test_render_is_pure_and_deterministic() -> None:
    doc = load("auth-tls")
    before = copy.deepcopy(doc)
    first = render.render_resource(doc)
    assert render.render_resource(doc) == first
    assert doc == before


@pytest.mark.parametrize("name", [p.stem for p in EXAMPLES])
def test_rendered_commands_parse_with_the_real_cli(name: str) -> None:
    """The engine and gateway command lines are accepted by `minedraft serve` and `minedraft gateway` themselves."""
    from minedraft.cli import build_parser

    manifests = render.render_resource(load(name))
    parser = build_parser()
    engine = parser.parse_args(engine_container(manifests)["command"][1:])
    assert engine.grpc_port == render.ENGINE_GRPC_PORT and engine.metrics_port == render.ENGINE_METRICS_PORT
    assert engine.drafter_gpu == 1 and engine.host == "0.0.0.0"
    gateway_pod = gateway_deployment(manifests)["spec"]["template"]["spec"]
    gateway = parser.parse_args(gateway_pod["containers"][0]["command"][1:])
    assert gateway.port == render.GATEWAY_GRPC_PORT and gateway.metrics_port == render.GATEWAY_METRICS_PORT
    assert gateway.kubernetes_service == f"serving/{load(name)['metadata']['name']}-engine"
