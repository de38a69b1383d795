"""Images, chart and package agree on versions; values are documented; the CLI renders and reports errors."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

from minedraft.cli import main
from minedraft.operator import spec as s

ROOT = Path(__file__).resolve().parents[3]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
CHART = ROOT / "charts" / "minedraft"


def dockerfile(name: str) -> str:
    return (ROOT / "docker" / f"{name}.Dockerfile").read_text()


@pytest.mark.parametrize("name", ["engine", "operator", "gateway"])
def test_images_share_the_package_version_and_python(name: str) -> None:
    """The version label comes from make's --build-arg VERSION (the package version); the base image's Python is
    the one pyproject.toml requires (tests/component/test_images.py checks the rest against the pods)."""
    text = dockerfile(name)
    assert "ARG VERSION=" + VERSION in text and 'org.opencontainers.image.version="${VERSION}"' in text
    python = re.search(r">=(3\.\d+)", PYPROJECT["project"]["requires-python"])
    assert python is not None
    # The published base is the default of the BASE_IMAGE build argument (make images-smoke swaps in a local one).
    assert re.search(rf"^ARG BASE_IMAGE=python:{re.escape(python.group(1))}-slim-bookworm$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    if name != "engine":
        # the slim images refuse to carry vLLM or torch: the build fails when either can be found
        assert "find_spec(m)" in text and "'vllm'" in text and "'torch'" in text


def test_chart_and_default_images_follow_the_package_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == VERSION == s.IMAGE_TAG
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["registry"] == s.DEFAULT_IMAGE_REGISTRY
    assert values["operator"]["image"]["repository"] == values["operator"]["image"]["tag"] == ""


def test_every_values_key_has_a_comment() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    for index, line in enumerate(lines):
        if re.match(r"^\s*[A-Za-z][\w.-]*:", line):
            above = lines[index - 1].strip() if index else ""
            assert above.startswith("#"), f"values.yaml line {index + 1} ({line.strip()}) has no comment above it"


def test_chart_rbac_template_lists_exactly_the_operator_permissions() -> None:
    from minedraft.operator.kube import PERMISSIONS

    text = (CHART / "templates" / "_helpers.tpl").read_text()
    block = text.split('{{- define "minedraft.rules" -}}')[1].split("{{- end -}}")[0]
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in yaml.safe_load(block):
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    assert granted == {k: set(v) for k, v in PERMISSIONS.items()}


def test_cli_render_prints_a_yaml_stream(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["operator", "render", "-f", str(ROOT / "examples" / "minimal.yaml")]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == ["Service", "Deployment", "PodDisruptionBudget", "ServiceAccount", "Role",
                                         "RoleBinding", "Service", "Deployment", "NetworkPolicy", "NetworkPolicy"]
    assert main(["operator", "render", "--monitoring", "on", "--network-policy", "off", "-f",
                 str(ROOT / "examples" / "minimal.yaml")]) == 0
    kinds = [d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out)]
    assert "PodMonitor" in kinds and "NetworkPolicy" not in kinds


def test_cli_render_reports_errors_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
    bad["spec"]["speculation"]["numSpeculativeTokens"] = 40
    bad["spec"]["engine"] = {"memory": "lots"}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad) + "---\napiVersion: v1\nkind: ConfigMap\n")
    assert main(["operator", "render", "-f", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "MineDraft qwen3-8b: spec.speculation.numSpeculativeTokens: must be between 1 and 16" in captured.err
    assert "spec.engine.memory" in captured.err and "document 1: not a MineDraft" in captured.err
    path.write_text("spec: [unclosed")
    assert main(["operator", "render", "-f", str(path)]) == 2
    assert "invalid YAML" in capsys.readouterr().err


def test_cli_crd_prints_the_chart_crd(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["operator", "crd"]) == 0
    from minedraft.operator.crd import CRD_FILE

    assert capsys.readouterr().out == (ROOT / CRD_FILE).read_text()


def test_operator_cli_runs_without_vllm_or_torch() -> None:
    """The operator image has neither: `minedraft operator render` must not import them (nor grpc or numpy)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'vllm', 'torch', 'transformers', 'numpy', 'grpc', 'zmq'}:\n"
        "            raise ImportError('not in the operator image: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from minedraft.cli import main\n"
        f"sys.exit(main(['operator', 'render', '-f', {str(ROOT / 'examples' / 'autoscaled.yaml')!r}]))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "kind: Deployment" in result.stdout


def test_operator_metrics_are_named_minedraft_operator() -> None:
    from prometheus_client import generate_latest

    from minedraft.operator.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    metrics.reconciles.labels(trigger="create", result="ok").inc()
    metrics.ready.labels("ns", "md").set(1)
    text = generate_latest(metrics.registry).decode()
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    assert names and all(n.startswith("minedraft_operator_") for n in names), names
    metrics.forget("ns", "md")
    assert 'name="md"' not in generate_latest(metrics.registry).decode()
