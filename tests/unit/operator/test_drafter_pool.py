"""A MineDraft with a drafter pool: the pool's Deployment, Service and NetworkPolicy; engines pointed at it with
only the target's GPUs; the token mounted, never in the environment or the command; field-naming errors."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from minedraft.operator import render
from minedraft.operator import spec as s

from .test_crd import admit, set_path
from .test_crd import with_spec as _with_spec
from .test_render import K8S_VERSION, UID, by_kind, engine_container, flag, load

POOL = {"replicas": 1, "gpus": 1, "tokenSecretRef": {"name": "qwen3-8b-drafter-token"}}


def with_spec(_name: str = "pool", **changes: Any) -> dict[str, Any]:
    """The minimal example with four engine replicas sharing a drafter pool, then `changes` (as test_crd's)."""
    doc = _with_spec("minimal", replicas=4, drafterPool=dict(POOL))
    doc["spec"]["drafterPool"] = {**POOL, "tokenSecretRef": dict(POOL["tokenSecretRef"])}
    for dotted, value in changes.items():
        set_path(doc["spec"], dotted.split("__"), value)
    doc["metadata"].update(namespace="serving", uid=UID)
    return doc


def rendered(options: render.RenderOptions | None = None) -> list[dict[str, Any]]:
    return render.render_resource(with_spec(), options)


def test_the_pool_renders_a_deployment_a_service_and_a_policy_admitting_only_engines():
    manifests = rendered()
    for m in manifests:
        kubernetes_validate.validate(m, K8S_VERSION, strict=True)
    objects = by_kind(manifests)
    pool = objects["Deployment/qwen3-8b-drafter"]
    container = pool["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:2] == ["minedraft", "drafter"]
    assert flag(container["command"], "--token-file") == f"{render.DRAFTER_TOKEN_DIR}/token"
    assert flag(container["command"], "--model") == "Qwen/Qwen3-0.6B"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pool["spec"]["replicas"] == 1
    service = objects["Service/qwen3-8b-drafter"]
    assert service["spec"]["selector"] == render.selector_labels(s.parse_meta(with_spec()["metadata"]),
                                                                 "drafter")
    policy = objects["NetworkPolicy/qwen3-8b-drafter"]
    drafting, scraping = policy["spec"]["ingress"]
    assert drafting["from"] == [{"podSelector": {"matchLabels": {"minedraft.io/instance": "qwen3-8b",
                                                                 "minedraft.io/component": "engine"}}}]
    assert drafting["ports"] == [{"protocol": "TCP", "port": 50061}]
    # The pool's metrics: only the metrics scrapers (Prometheus), on the metrics port alone.
    assert scraping["ports"] == [{"protocol": "TCP", "port": render.DRAFTER_METRICS_PORT}]
    assert all("namespaceSelector" in peer for peer in scraping["from"])
    # Every object the pool adds is one the operator knows to delete when the pool is removed.
    known = set(render.all_kinds_and_names(s.parse_meta(with_spec()["metadata"])))
    assert {(m["kind"], m["metadata"]["name"]) for m in manifests if m["kind"] != "PodMonitor"} <= known


def test_engines_request_only_the_targets_gpus_and_point_at_the_pool():
    container = engine_container(rendered())
    command = container["command"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "--drafter-gpu" not in command
    assert flag(command, "--drafter-address") == "qwen3-8b-drafter:50061"
    assert flag(command, "--drafter-token-file") == f"{render.DRAFTER_TOKEN_DIR}/token"


def test_the_token_is_a_mounted_file_never_an_environment_variable():
    for m in rendered():
        if m["kind"] != "Deployment" or m["metadata"]["name"].endswith("-gateway"):
            continue
        pod = m["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert not any(e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == "qwen3-8b-drafter-token"
                       for e in container.get("env", []))
        volume = next(v for v in pod["volumes"] if v["name"] == "drafter-token")
        assert volume["secret"]["secretName"] == "qwen3-8b-drafter-token"
        assert any(mount["mountPath"] == render.DRAFTER_TOKEN_DIR and mount["readOnly"]
                   for mount in container["volumeMounts"])


def test_without_a_network_policy_option_the_pool_has_none():
    kinds = {(m["kind"], m["metadata"]["name"]) for m in rendered(render.RenderOptions(network_policy=False))}
    assert ("NetworkPolicy", "qwen3-8b-drafter") not in kinds
    assert ("Deployment", "qwen3-8b-drafter") in kinds


def test_a_minedraft_without_a_pool_renders_as_before():
    container = engine_container(render.render_resource(load("minimal")))
    assert "--drafter-address" not in container["command"] and "--drafter-gpu" in container["command"]
    assert not any(m["metadata"]["name"].endswith("-drafter") for m in render.render_resource(load("minimal")))


@pytest.mark.parametrize(("changes", "error"), [
    ({"drafterPool__tokenSecretRef": {"key": "token"}}, "spec.drafterPool.tokenSecretRef.name: required"),
    ({"drafterPool__window": 512}, "spec.drafterPool.window: the drafter window is the torch backend's"),
    ({"speculation__mode": "ar"}, "spec.drafterPool: mode ar does not draft with the minedraft drafter"),
    ({"drafterPool__gpus": 9}, "spec.drafterPool.gpus: must be between 0 and 8"),
    ({"drafterPool__gpus": 2}, "spec.drafterPool.gpus: the drafter has no tensor parallelism"),
    ({"drafterPool__gpus": 0}, "spec.drafterPool.backend: a CPU pool (gpus 0) needs backend torch"),
    ({"drafterPool__backend": "torch", "drafterPool__window": 4096, "engine__maxModelLen": 4096},
     "spec.drafterPool.window: must be shorter than the engines' context (4096 tokens)"),
    ({"drafterPool__backend": "torch", "drafterPool__window": 40960},
     "spec.drafterPool.window: must be shorter than the engines' context (40960 tokens)"),
    ({"engine__targetGPUs": 6}, "spec.engine.targetGPUs: must be 1, 2, 4 or 8"),
    ({"drafterPool__backend": "torch", "drafterPool__window": 512},
     "spec.drafterPool.maxNumSeqs: the torch pool preallocates 113.3 GiB of KV per pod (2056 slots)"),
], ids=["no-token", "window-vllm", "mode-ar", "gpus", "gpus-2", "cpu-vllm", "window-at-context",
        "window-at-models-context", "tp-6", "torch-kv"])
def test_bad_pools_are_refused_naming_the_field(changes: dict[str, Any], error: str):
    doc = with_spec("pool", **changes)
    with pytest.raises(s.SpecError) as exc:
        s.parse_spec(doc["spec"])
    assert any(e.startswith(error) for e in exc.value.errors), exc.value.errors


@pytest.mark.parametrize(("changes", "message"), [
    ({"drafterPool__window": 512},
     "spec.drafterPool.window: drafterPool.window needs backend torch"),
    ({"speculation__mode": "vllm-sd"},
     "spec.drafterPool: drafterPool needs speculation.mode psd, sd, lookahead or auto"),
    ({"drafterPool__gpus": 2}, "spec.drafterPool.gpus: 2 is greater than the maximum of 1"),
    ({"drafterPool__gpus": 0}, "spec.drafterPool.backend: a CPU pool (drafterPool.gpus 0) needs backend torch"),
    ({"drafterPool__backend": "torch", "drafterPool__window": 4096, "engine__maxModelLen": 4096},
     "spec.drafterPool.window: drafterPool.window must be shorter than engine.maxModelLen"),
    *[({"engine__targetGPUs": tp}, "spec.engine.targetGPUs: targetGPUs must be 1, 2, 4 or 8") for tp in (3, 5, 6, 7)],
], ids=["window-vllm", "mode-vllm-sd", "gpus-2", "cpu-vllm", "window-at-context", "tp-3", "tp-5", "tp-6", "tp-7"])
def test_the_crd_refuses_bad_pools_at_admission_naming_the_field(changes: dict[str, Any], message: str):
    found = admit(with_spec("pool", **changes))
    assert any(f.startswith(message) for f in found), found


def test_a_windowed_torch_pool_on_a_gpu_is_admitted_and_drafts_on_it():
    doc = with_spec("pool", drafterPool__backend="torch", drafterPool__window=512, drafterPool__maxNumSeqs=256)
    assert admit(doc) == []
    pool = by_kind(render.render_resource(doc))["Deployment/qwen3-8b-drafter"]
    command = pool["spec"]["template"]["spec"]["containers"][0]["command"]
    assert flag(command, "--window") == "512" and flag(command, "--device") == "cuda"


def test_a_cpu_pool_keeps_to_the_engines_nodes_and_asks_for_the_drafts_disk_only():
    doc = with_spec("pool", drafterPool__gpus=0, drafterPool__backend="torch", drafterPool__window=512,
                    drafterPool__maxNumSeqs=16, engine__nodeSelector={"kubernetes.io/arch": "amd64"},
                    engine__tolerations=[{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
                    engine__runtimeClassName="nvidia")
    assert admit(doc) == []
    pod = by_kind(render.render_resource(doc))["Deployment/qwen3-8b-drafter"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"kubernetes.io/arch": "amd64"}
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]
    assert "runtimeClassName" not in pod, "a CPU pool needs no GPU runtime class"
    # The pool caches the draft only: its own size, not the engines' (100Gi by default, sized for the target).
    (container,) = pod["containers"]
    assert container["resources"]["requests"]["ephemeral-storage"] == "20Gi"
    assert "ephemeral-storage" not in container["resources"]["limits"]
    (cache,) = [v for v in pod["volumes"] if v["name"] == "model-cache"]
    assert cache["emptyDir"]["sizeLimit"] == "20Gi"
    sized = with_spec("pool", drafterPool__modelCacheSizeLimit="8Gi", engine__ephemeralStorage="200Gi",
                      drafterPool__backend="torch", drafterPool__window=512, drafterPool__maxNumSeqs=16)
    (container,) = by_kind(render.render_resource(sized))["Deployment/qwen3-8b-drafter"]["spec"]["template"]["spec"][
        "containers"]
    assert container["resources"]["requests"]["ephemeral-storage"] == "8Gi"


def test_the_rendered_commands_parse_with_the_real_cli():
    from minedraft.cli import build_parser

    parser = build_parser()
    objects = by_kind(rendered())
    pool_command = objects["Deployment/qwen3-8b-drafter"]["spec"]["template"]["spec"]["containers"][0]["command"]
    pool = parser.parse_args(pool_command[1:])
    assert pool.port == 50061 and pool.host == "0.0.0.0" and pool.backend == "vllm"
    assert pool.metrics_port == render.DRAFTER_METRICS_PORT
    engine = parser.parse_args(engine_container(rendered())["command"][1:])
    assert engine.drafter_address == "qwen3-8b-drafter:50061" and engine.drafter_gpu is None


def test_a_target_stretched_by_hf_overrides_gets_a_pool_that_reads_positions_the_same_way():
    from minedraft.cli import build_parser

    stretch = '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 8192}'
    for extra in (["--hf-overrides", stretch], [f"--hf-overrides {stretch}"], [f"--hf_overrides={stretch}"]):
        doc = with_spec("pool", drafterPool__backend="torch", drafterPool__window=512, drafterPool__maxNumSeqs=256,
                        engine__extraArgs=extra)
        assert admit(doc) == []
        command = by_kind(render.render_resource(doc))["Deployment/qwen3-8b-drafter"]["spec"]["template"]["spec"][
            "containers"][0]["command"]
        pool = build_parser().parse_args(command[1:])
        assert pool.hf_overrides == {"rope_scaling": {"rope_type": "yarn", "factor": 4.0},
                                     "max_position_embeddings": 8192}, extra
    plain = by_kind(rendered())["Deployment/qwen3-8b-drafter"]["spec"]["template"]["spec"]["containers"][0]
    assert "--hf-overrides" not in plain["command"]


def test_with_monitoring_the_pool_gets_a_pod_monitor_of_its_own():
    monitors = [m for m in rendered(render.RenderOptions(monitoring=True)) if m["kind"] == "PodMonitor"]
    pool = next(m for m in monitors if m["metadata"]["name"] == "qwen3-8b-drafter")
    assert pool["spec"]["selector"]["matchLabels"]["minedraft.io/component"] == "drafter"
    assert pool["spec"]["podMetricsEndpoints"] == [{"port": "metrics", "interval": "15s"}]


def test_the_pool_pod_meets_pod_security_restricted_with_any_uid():
    from tests.pod_security import fixed_id_violations, restricted_violations, writable_path_violations

    pool = by_kind(rendered())["Deployment/qwen3-8b-drafter"]
    pod = pool["spec"]["template"]["spec"]
    assert restricted_violations(pod) == []
    assert fixed_id_violations(pod) == []
    assert writable_path_violations(pod) == []
    assert pod["automountServiceAccountToken"] is False
