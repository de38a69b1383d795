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
    assert c["livenessProbe"]["grpc"] == {"port": render.ENGINE_GRPC_PORT, "service": "minedraft.liveness"}
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["grpc"] == {"port": render.ENGINE_GRPC_PORT, "service": ""}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= s.EngineSpec().startup_timeout_seconds
    # The HTTP port is closed behind the gateway (issue 30: no way around its auth).
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50051, "metrics": 9400}
    # Non-root, read-only root, writable paths on emptyDirs, shm in memory.
    assert pod["securityContext"]["runAsNonRoot"] is True and "runAsUser" not in pod["securityContext"]
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
    assert {p["name"]: p["containerPort"] for p in ports} == {"grpc": 50051, "http": render.GATEWAY_HTTP_PORT,
                                                              "metrics": render.GATEWAY_METRICS_PORT}
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
    # A kubelet gRPC probe cannot speak TLS: liveness is a TCP connect, readiness the HTTP API's /ready over HTTPS.
    assert "tcpSocket" in c["livenessProbe"] and "grpc" not in c["readinessProbe"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": render.GATEWAY_HTTP_PORT, "scheme": "HTTPS"}
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
    doc["spec"]["engine"] = {"extraArgs": ["--gpu-memory-utilization", "0.85", "--enforce-eager"],
                             "modelCache": {"claimName": "hf-cache"},
                             "affinity": {"nodeAffinity": {}}, "cpu": "0.5", "terminationGracePeriodSeconds": 5}
    doc["spec"]["gateway"] = {"replicas": 0, "maxInFlight": 7}
    doc["spec"]["target"]["source"] = {"image": {"path": "/models/target"}}
    manifests = render.render_resource(doc)
    c = engine_container(manifests)
    # The engine's own flag stays one (the engine sets vLLM's from it); other vLLM arguments pass through.
    assert c["command"][-2:] == ["--gpu-memory-utilization=0.85", "--vllm-arg=--enforce-eager"]
    assert flag(c["command"], "--model") == "/models/target"
    # Lookahead's switch is the engine's too (vLLM's parser would refuse it and the pod would not start).
    doc["spec"]["engine"]["extraArgs"] = ["--no-lookahead-backups"]
    assert engine_container(render.render_resource(doc))["command"][-1] == "--no-lookahead-backups"
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


@pytest.mark.parametrize(("mode", "target_gpus"), [("psd", 1), ("psd", 2), ("auto", 4), ("sd", 1)])
def test_async_steps_render_the_engines_flag_and_the_engine_takes_it(mode: str, target_gpus: int) -> None:
    """speculation.asyncSteps becomes `--async-psd-steps` (at any targetGPUs), which the real CLI turns into the
    engine's async_psd_steps setting; unset, the flag is absent and the engine runs synchronous steps."""
    from minedraft.cli import build_parser
    from minedraft.engine_options import settings_from_args

    parser = build_parser()
    for async_steps in (True, False, None):
        doc = load("minimal")
        doc["spec"]["speculation"] = {"mode": mode, **({} if async_steps is None else {"asyncSteps": async_steps})}
        doc["spec"]["engine"] = {"targetGPUs": target_gpus}
        command = engine_container(render.render_resource(doc))["command"]
        assert ("--async-psd-steps" in command) is bool(async_steps), command
        settings = settings_from_args(parser.parse_args(command[1:]))
        assert settings.async_psd_steps is bool(async_steps)
        assert settings.tensor_parallel_size == target_gpus


# -- issue 16: what a real cluster enforces, checked on every rendered pod -------------------------------------------

def variants() -> list[tuple[str, dict[str, Any]]]:
    """Every example, plus the options that change pods (TLS, modes, GPUs, pod fields)."""
    out = [(p.stem, load(p.stem)) for p in EXAMPLES]
    doc = load("minimal")
    doc["spec"]["engine"] = {"targetGPUs": 4, "dtype": "bfloat16", "runtimeClassName": "nvidia",
                             "ephemeralStorage": "50Gi", "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
                             "extraArgs": ["--enforce-eager"], "terminationGracePeriodSeconds": 600}
    doc["spec"]["imagePullSecrets"] = [{"name": "registry"}]
    out.append(("tp4-fields", doc))
    for mode in ("ar", "vllm-sd", "sd", "lookahead"):
        doc = load("minimal")
        doc["spec"]["speculation"] = {"mode": mode}
        out.append((mode, doc))
    doc = load("minimal")
    doc["spec"]["speculation"] = {"mode": "lookahead", "numSpeculativeTokens": 2, "lookaheadFanout": 16}
    out.append(("lookahead-fanout", doc))
    return out


VARIANTS = variants()


def pod_templates(manifests: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(m["metadata"]["name"], m["spec"]["template"]["spec"]) for m in manifests if m["kind"] == "Deployment"]


@pytest.mark.parametrize(("name", "doc"), VARIANTS, ids=[v[0] for v in VARIANTS])
def test_every_probe_asks_its_own_question(name: str, doc: dict[str, Any]) -> None:
    """liveness = "the process answers" (never a readiness signal: that restarted the gateway while engines loaded);
    readiness = "route to me"; startup only where loading takes long (the engine), bounded by startupTimeoutSeconds;
    no liveness window shorter than a drain."""
    spec = s.parse_spec(doc["spec"])
    for deployment, pod in pod_templates(render.render_resource(doc)):
        (c,) = pod["containers"]
        live, ready = c["livenessProbe"], c["readinessProbe"]
        if "grpc" in live:
            assert live["grpc"]["service"] == render.LIVENESS_SERVICE, deployment
        else:  # TLS: kubelet gRPC probes cannot handshake
            assert spec.gateway.tls_secret_name is not None and deployment.endswith("-gateway")
            assert live == {**live, "tcpSocket": {"port": render.GATEWAY_GRPC_PORT}}
        if "grpc" in ready:
            assert ready["grpc"]["service"] == render.READINESS_SERVICE, deployment
        else:  # TLS: the HTTP API's /ready (same meaning) over HTTPS, or a TCP connect without the HTTP port
            assert spec.gateway.tls_secret_name is not None
            assert ready.get("httpGet") == {"path": "/ready", "port": render.GATEWAY_HTTP_PORT, "scheme": "HTTPS"} \
                or ("tcpSocket" in ready and not spec.gateway.http_port)
        live_window = live["periodSeconds"] * live["failureThreshold"]
        assert live_window > pod["terminationGracePeriodSeconds"], deployment  # a drain is never cut short
        assert live["timeoutSeconds"] >= 5  # a busy event loop answers late, not never
        if deployment.endswith("-engine"):
            startup = c["startupProbe"]
            assert startup["grpc"]["service"] == render.READINESS_SERVICE
            assert startup["periodSeconds"] * startup["failureThreshold"] >= spec.engine.startup_timeout_seconds
        else:
            assert "startupProbe" not in c  # the gateway binds in seconds: liveness alone


@pytest.mark.parametrize(("name", "doc"), VARIANTS, ids=[v[0] for v in VARIANTS])
def test_pods_meet_pod_security_restricted_with_any_uid(name: str, doc: dict[str, Any]) -> None:
    """The Pod Security Standards' baseline and restricted controls, as the PodSecurity admission checks them,
    plus what OpenShift's restricted-v2 (an arbitrary UID per namespace) needs: no fixed UID/GID/fsGroup."""
    restricted_volume_kinds = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                               "projected", "secret"}
    baseline_capabilities = {"NET_BIND_SERVICE"}  # restricted: at most this one may be added
    for deployment, pod in pod_templates(render.render_resource(doc)):
        psc = pod.get("securityContext", {})
        # Baseline: host namespaces, host ports, hostPath, privileged, proc mount, sysctls, seccomp, SELinux.
        assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), deployment
        assert not psc.get("sysctls") and "seLinuxOptions" not in psc
        for volume in pod.get("volumes", []):
            kinds = set(volume) - {"name"}
            assert kinds <= restricted_volume_kinds, (deployment, volume)
        containers = pod["containers"] + pod.get("initContainers", [])
        for c in containers:
            csc = c.get("securityContext", {})
            assert not csc.get("privileged") and csc.get("procMount", "Default") == "Default"
            assert all(not p.get("hostPort") for p in c.get("ports", []))
            # Restricted.
            assert csc.get("allowPrivilegeEscalation") is False, deployment
            assert csc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True
            assert csc.get("runAsUser", psc.get("runAsUser", 1)) != 0
            seccomp = csc.get("seccompProfile", psc.get("seccompProfile", {}))
            assert seccomp.get("type") in ("RuntimeDefault", "Localhost")
            assert "ALL" in csc.get("capabilities", {}).get("drop", [])
            assert set(csc.get("capabilities", {}).get("add", [])) <= baseline_capabilities
            # Any UID: nothing fixes it.
            assert "runAsUser" not in csc and "runAsGroup" not in csc
            # Read-only root; every path the process writes is a volume.
            assert csc.get("readOnlyRootFilesystem") is True
        assert not {"runAsUser", "runAsGroup", "fsGroup"} & set(psc), deployment


def test_every_writable_path_is_on_a_volume() -> None:
    """HOME, TMPDIR and every cache vLLM, torch, Triton, CUDA and Hugging Face write lie on writable volumes (the
    root filesystem is read-only and an arbitrary UID has no home directory)."""
    for manifests in (render.render_resource(doc) for _, doc in VARIANTS):
        for deployment, pod in pod_templates(manifests):
            (c,) = pod["containers"]
            writable = [m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")]
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["HOME"] == render.TMP_DIR, deployment
            if deployment.endswith("-engine"):
                assert set(render.WRITABLE_ENV) <= set(env)
                for name in render.WRITABLE_ENV:
                    value = env[name]
                    assert any(value == m or value.startswith(m + "/") for m in writable), (name, value)


@pytest.mark.parametrize(("mode", "allowed", "gpus"), [
    ("psd", None, 2), ("sd", None, 2), ("ar", None, 1), ("vllm-sd", None, 1), ("auto", ["ar"], 1),
    ("auto", ["psd", "ar"], 2), ("lookahead", None, 2), ("auto", ["lookahead", "ar"], 2), ("auto", None, 2),
])
def test_drafter_gpu_only_for_modes_that_draft_on_it(mode: str, allowed: list[str] | None, gpus: int) -> None:
    doc = load("minimal")
    doc["spec"]["speculation"] = {"mode": mode, "numSpeculativeTokens": 3}
    if allowed:
        doc["spec"]["autoscaling"] = {"speculation": {"allowedModes": allowed}}
    c = engine_container(render.render_resource(doc))
    assert c["resources"]["requests"]["nvidia.com/gpu"] == str(gpus)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
    assert (flag(c["command"], "--drafter-gpu") == "1") is (gpus == 2)
    if mode == "auto":
        modes = allowed or s.AUTO_MODES
        assert flag(c["command"], "--auto-modes") == ",".join(m for m in s.AUTO_MODES if m in modes)


@pytest.mark.parametrize(("speculation", "autoscaling", "fanout"), [
    ({"mode": "lookahead"}, None, None),
    ({"mode": "lookahead", "lookaheadFanout": 8}, None, "8"),
    ({"mode": "lookahead", "lookaheadFanout": 1}, {"speculation": {"allowedModes": ["lookahead"]}}, "1"),
    ({"mode": "auto", "lookaheadFanout": 16}, None, "16"),
    ({"mode": "auto", "lookaheadFanout": 4}, {"speculation": {"allowedModes": ["sd", "lookahead"]}}, "4"),
    ({"mode": "auto"}, {"speculation": {"allowedModes": ["psd", "ar"]}}, None),
], ids=["lookahead", "lookahead-fanout", "lookahead-fanout-1", "auto-fanout", "auto-allowed-fanout",
        "auto-no-lookahead"])
def test_lookahead_renders_its_mode_and_fanout_and_the_engine_takes_them(
        speculation: dict[str, Any], autoscaling: dict[str, Any] | None, fanout: str | None) -> None:
    """Mode lookahead (or auto that may choose it) with speculation.lookaheadFanout becomes `--lookahead-fanout N`,
    which `minedraft serve`'s parser and the engine's settings take; unset, no flag (the engine's default)."""
    from minedraft.cli import build_parser, settings_from_args
    from minedraft.engine.settings import DEFAULT_LOOKAHEAD_FANOUT, Mode, validate

    doc = load("minimal")
    doc["spec"]["speculation"] = speculation
    if autoscaling is not None:
        doc["spec"]["autoscaling"] = autoscaling
    command = engine_container(render.render_resource(doc))["command"]
    assert flag(command, "--mode") == speculation["mode"]
    assert flag(command, "--lookahead-fanout") == fanout
    assert flag(command, "--drafter-gpu") == "1"
    settings = settings_from_args(build_parser().parse_args(command[1:]))
    validate(settings)
    assert settings.mode is Mode(speculation["mode"])
    assert settings.lookahead_fanout == (DEFAULT_LOOKAHEAD_FANOUT if fanout is None else int(fanout))
    if speculation["mode"] == "auto":
        allowed = (autoscaling or {}).get("speculation", {}).get("allowedModes", list(s.AUTO_MODES))
        assert flag(command, "--auto-modes") == ",".join(m for m in s.AUTO_MODES if m in allowed)
        assert settings.auto["allowed_modes"] == tuple(m for m in s.AUTO_MODES if m in allowed)


def test_auto_passes_lookahead_among_its_modes_by_default() -> None:
    """The operator's auto chooses what `minedraft serve`'s does: psd, sd, lookahead and ar."""
    doc = load("minimal")
    doc["spec"]["speculation"] = {"mode": "auto"}
    assert flag(engine_container(render.render_resource(doc))["command"], "--auto-modes") == "psd,sd,lookahead,ar"
    command = engine_container(render.render_resource(load("autoscaled")))["command"]
    assert flag(command, "--auto-modes") == "psd,sd,ar"  # the example's own allowedModes


def test_lookahead_with_a_drafter_pool_drafts_through_it_on_the_targets_gpus_alone() -> None:
    doc = load("minimal")
    doc["spec"]["speculation"] = {"mode": "lookahead", "lookaheadFanout": 4}
    doc["spec"]["drafterPool"] = {"tokenSecretRef": {"name": "pool-token"}}
    manifests = render.render_resource(doc)
    c = engine_container(manifests)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and "--drafter-gpu" not in c["command"]
    assert flag(c["command"], "--drafter-address") is not None
    assert flag(c["command"], "--lookahead-fanout") == "4"
    assert any(m["kind"] == "Deployment" and m["metadata"]["name"].endswith("-drafter") for m in manifests)


def test_target_gpus_are_tensor_parallel_and_the_drafter_takes_the_next_device() -> None:
    doc = load("minimal")
    doc["spec"]["engine"] = {"targetGPUs": 4, "dtype": "bfloat16"}
    c = engine_container(render.render_resource(doc))
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "5"
    assert flag(c["command"], "--tensor-parallel-size") == "4" and flag(c["command"], "--drafter-gpu") == "4"
    assert flag(c["command"], "--dtype") == "bfloat16"
    assert "--max-model-len" not in c["command"]  # unset: the model's own context length
    doc["spec"]["engine"]["maxModelLen"] = 4096
    assert flag(engine_container(render.render_resource(doc))["command"], "--max-model-len") == "4096"


def test_optional_pod_fields_appear_only_when_set() -> None:
    bare = render.render_resource(load("minimal"))
    _, doc = next(v for v in VARIANTS if v[0] == "tp4-fields")
    full = render.render_resource(doc)
    (_, engine_bare), _ = pod_templates(bare)
    (_, engine_full), (_, gateway_full) = pod_templates(full)
    for key in ("runtimeClassName", "imagePullSecrets", "nodeSelector", "tolerations", "affinity",
                "priorityClassName"):
        assert key not in engine_bare, key
    assert engine_full["runtimeClassName"] == "nvidia"
    assert engine_full["imagePullSecrets"] == gateway_full["imagePullSecrets"] == [{"name": "registry"}]
    c = engine_full["containers"][0]
    assert c["resources"]["requests"]["ephemeral-storage"] == c["resources"]["limits"]["ephemeral-storage"] == "50Gi"
    # Without ephemeralStorage only the emptyDir model cache's size is requested (issue 30), nothing is capped.
    bare_resources = engine_bare["containers"][0]["resources"]
    example_cache = load("minimal")["spec"]["engine"]["modelCache"]
    assert bare_resources["requests"]["ephemeral-storage"] == example_cache["sizeLimit"]
    assert "ephemeral-storage" not in bare_resources["limits"]
    assert c["env"][-1] == {"name": "NCCL_DEBUG", "value": "WARN"}
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"


def label_match(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In"
        ok = ok and labels.get(expr["key"]) in expr["values"]
    return ok


def test_each_component_selects_only_its_own_pods() -> None:
    manifests = render.render_resource(load("minimal"))
    deployments = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "Deployment"}
    templates = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in deployments.items()}
    for name, dep in deployments.items():
        for other, labels in templates.items():
            assert label_match(dep["spec"]["selector"], labels) is (other == name), (name, other)
    for m in manifests:
        if m["kind"] in ("Service", "PodDisruptionBudget"):
            selector = m["spec"]["selector"]
            selector = selector if "matchLabels" in selector else {"matchLabels": selector}
            matched = [n for n, labels in templates.items() if label_match(selector, labels)]
            assert matched == [m["metadata"]["name"]], m["kind"]


def test_unwanted_objects_are_not_rendered_and_every_object_is_prunable() -> None:
    doc = load("minimal")
    doc["spec"]["gateway"] = {"enabled": False}
    doc["spec"]["engine"] = {"podDisruptionBudget": False}
    kinds = {(m["kind"], m["metadata"]["name"]) for m in render.render_resource(doc)}
    assert kinds == {("Service", "qwen3-8b-engine"), ("Deployment", "qwen3-8b-engine"),
                     ("NetworkPolicy", "qwen3-8b-engine")}
    meta = s.parse_meta(doc["metadata"])
    # The fullest spec: auth and TLS, and a drafter pool.
    fullest = {**load("auth-tls")["spec"], "drafterPool": {"tokenSecretRef": {"name": "drafter-token"}}}
    everything = render.render(s.parse_spec(fullest), meta, render.RenderOptions(monitoring=True))
    assert {(m["kind"], m["metadata"]["name"]) for m in everything} == set(render.all_kinds_and_names(meta))


def test_qwen3_on_four_gpus_in_bf16_is_accepted_by_the_engine_parser_and_settings() -> None:
    """Issue 17: targetGPUs 4, dtype bfloat16, a Qwen3 pair. The command the operator renders (not a hand-written
    one) passes `minedraft serve`'s parser, the engine settings validation, vLLM's own EngineArgs (the pass-through
    argument included), and the pod's five GPUs split 4 + 1 as the device plugin numbers them."""
    from minedraft.cli import build_parser, settings_from_args
    from minedraft.engine.core import engine_args
    from minedraft.engine.placement import DeviceInfo, plan_devices
    from minedraft.engine.settings import validate

    doc = load("minimal")
    doc["spec"]["target"] = {"source": {"huggingFace": {"id": "Qwen/Qwen3-32B"}}}
    doc["spec"]["draft"] = {"source": {"huggingFace": {"id": "Qwen/Qwen3-1.7B"}}}
    doc["spec"]["engine"] = {"targetGPUs": 4, "dtype": "bfloat16",
                             "extraArgs": ["--gpu-memory-utilization", "0.9", "--enable-prefix-caching"]}
    c = engine_container(render.render_resource(doc))
    args = build_parser().parse_args(c["command"][1:])
    assert (args.tensor_parallel_size, args.dtype, args.drafter_gpu, args.max_model_len) == (4, "bfloat16", 4, None)
    settings = settings_from_args(args)
    validate(settings)
    vllm = engine_args(settings)
    assert (vllm.tensor_parallel_size, vllm.dtype, vllm.gpu_memory_utilization) == (4, "bfloat16", 0.9)
    assert vllm.enable_prefix_caching is True
    gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
    plan = plan_devices(settings, DeviceInfo(visible_gpus=tuple(str(i) for i in range(gpus))))
    assert (plan.target_visible_devices, plan.drafter_visible_devices) == ("0,1,2,3", "4")


@pytest.mark.parametrize(("name", "doc"), VARIANTS, ids=[v[0] for v in VARIANTS])
def test_every_rendered_engine_flag_passes_the_engine_parser_and_settings(name: str, doc: dict[str, Any]) -> None:
    from minedraft.cli import build_parser, settings_from_args
    from minedraft.engine.settings import validate

    command = engine_container(render.render_resource(doc))["command"]
    validate(settings_from_args(build_parser().parse_args(command[1:])))


def test_cli_render_shows_the_resource_with_the_crds_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """`minedraft operator render --resource` prints the MineDraft as the API server stores it, then its objects,
    rendered from that defaulted MineDraft."""
    from minedraft.cli import main

    assert main(["operator", "render", "--resource", "-f", str(ROOT / "examples" / "minimal.yaml")]) == 0
    first, *objects = list(yaml.safe_load_all(capsys.readouterr().out))
    assert first["kind"] == s.KIND
    assert first["spec"]["engine"]["dtype"] == "auto" and first["spec"]["gateway"]["enabled"] is True
    assert first["spec"]["engine"]["maxNumSeqs"] == s.EngineSpec().max_num_seqs
    assert "maxModelLen" not in first["spec"]["engine"]  # no default: the model's own context length
    assert [o["kind"] for o in objects][:2] == ["Service", "Deployment"]


def test_engine_and_gateway_pods_serve_and_name_the_http_api() -> None:
    """Issue 21: the operator's pods serve the OpenAI API on a named port, and 0 turns it off everywhere (command,
    container port, Service port). Issue 30: the engines' port is open by default only without the gateway."""
    direct = copy.deepcopy(load("minimal"))
    direct["spec"]["gateway"] = {"enabled": False}
    engine = next(m for m in render.render_resource(direct) if m["kind"] == "Deployment")
    ports = engine["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert s.DEFAULT_ENGINE_HTTP_PORT in [p["containerPort"] for p in ports]
    assert "--http-port" not in engine_container(render.render_resource(load("minimal")))["command"]
    opened = copy.deepcopy(load("minimal"))
    opened["spec"]["engine"] = {"httpPort": s.DEFAULT_ENGINE_HTTP_PORT}
    manifests = render.render_resource(opened, render.RenderOptions())
    engine = next(m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"].endswith("-engine"))
    container = engine["spec"]["template"]["spec"]["containers"][0]
    cmd = container["command"] + container.get("args", [])
    port = s.DEFAULT_ENGINE_HTTP_PORT
    assert cmd[cmd.index("--http-port") + 1] == str(port)
    assert {"name": "http", "containerPort": port, "protocol": "TCP"} in container["ports"]
    service = next(m for m in manifests if m["kind"] == "Service" and m["metadata"]["name"].endswith("-engine"))
    assert any(p["name"] == "http" and p["targetPort"] == "http" for p in service["spec"]["ports"])
    gateway = next(m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"].endswith("-gateway"))
    assert "--http-port" in gateway["spec"]["template"]["spec"]["containers"][0]["command"] + \
        gateway["spec"]["template"]["spec"]["containers"][0].get("args", [])

    off = copy.deepcopy(load("minimal"))
    off["spec"].setdefault("engine", {})["httpPort"] = 0
    manifests = render.render_resource(off, render.RenderOptions())
    engine = next(m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"].endswith("-engine"))
    container = engine["spec"]["template"]["spec"]["containers"][0]
    assert "--http-port" not in container["command"] + container.get("args", [])
    assert all(p["name"] != "http" for p in container["ports"])


def test_emptydir_model_cache_requests_its_size_as_ephemeral_storage() -> None:
    """Issue 30: an emptyDir cache lives on the node's disk; without a request the scheduler may place the pod on a
    node without room and the kubelet evicts it once downloads fill the disk."""
    doc = load("minimal")
    doc["spec"]["engine"] = {"modelCache": {"sizeLimit": "200Gi"}}
    c = engine_container(render.render_resource(doc))
    assert c["resources"]["requests"]["ephemeral-storage"] == "200Gi"
    assert "ephemeral-storage" not in c["resources"]["limits"]  # the sizeLimit evicts; no second cap
    doc["spec"]["engine"] = {"modelCache": {"claimName": "hf-cache"}}
    assert "ephemeral-storage" not in engine_container(render.render_resource(doc))["resources"]["requests"]
    doc["spec"]["engine"] = {"ephemeralStorage": "300Gi"}
    resources = engine_container(render.render_resource(doc))["resources"]
    assert resources["requests"]["ephemeral-storage"] == resources["limits"]["ephemeral-storage"] == "300Gi"


def test_rollout_strategy_for_full_gpu_pools() -> None:
    """Issue 30: Surge (the default) needs a spare pod's GPUs; Replace frees an old pod's GPUs first."""
    doc = load("minimal")
    dep = next(m for m in render.render_resource(doc) if m["kind"] == "Deployment")
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    doc["spec"]["engine"] = {"rolloutStrategy": "Replace"}
    dep = next(m for m in render.render_resource(doc) if m["kind"] == "Deployment")
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    kubernetes_validate.validate(dep, "1.34", strict=True)
    doc["spec"]["engine"] = {"rolloutStrategy": "Recreate"}
    with pytest.raises(s.SpecError, match=r"spec\.engine\.rolloutStrategy: must be one of Surge, Replace"):
        render.render_resource(doc)
