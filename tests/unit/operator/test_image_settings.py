"""The operator's image settings: one registry (the chart's image.registry, the operator's --image-registry) gives
engine and gateway pods their images unless a MineDraft names its own; the CRD stores no image default that would
win over it."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from minedraft.operator import spec as s
from minedraft.operator.cli import render_documents
from minedraft.operator.settings import OperatorSettings

ROOT = Path(__file__).resolve().parents[3]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
REGISTRY = "registry.example.com/team/minedraft"


def pod_images(doc: dict[str, Any], settings: OperatorSettings) -> set[str]:
    doc = copy.deepcopy(doc)
    doc["metadata"].update(namespace="serving", uid="4f9c2f7e-0000-4000-8000-000000000001")
    return {c["image"] for m in render_documents([doc], settings, monitoring_available=False)
            if m["kind"] == "Deployment" for c in m["spec"]["template"]["spec"]["containers"]}


def test_the_operator_registry_reaches_engine_and_gateway_pods() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
    assert pod_images(doc, OperatorSettings(image_registry=REGISTRY)) == {f"{REGISTRY}/engine:{VERSION}",
                                                                         f"{REGISTRY}/gateway:{VERSION}"}
    assert pod_images(doc, OperatorSettings()) == {f"{s.DEFAULT_IMAGE_REGISTRY}/engine:{VERSION}",
                                                   f"{s.DEFAULT_IMAGE_REGISTRY}/gateway:{VERSION}"}


def test_a_minedraft_naming_its_own_images_keeps_them() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
    doc["spec"]["engine"] = {"image": "mirror.internal/md/engine:patched"}
    doc["spec"]["gateway"] = {"image": "mirror.internal/md/gateway:patched"}
    used = pod_images(doc, OperatorSettings(image_registry=REGISTRY))
    assert used == {"mirror.internal/md/engine:patched", "mirror.internal/md/gateway:patched"}


def test_the_operator_registry_setting_reaches_every_pod() -> None:
    """Flag and environment variable (the chart sets the flag) both set it; a malformed one is refused by name."""
    from minedraft.cli import build_parser
    from minedraft.operator.cli import settings_from_args

    args = build_parser().parse_args(["operator", "render", "-f", "x", "--image-registry", "localhost:5000/md",
                                      "--image-tag", "dev"])
    options = settings_from_args(args).render_options(monitoring_available=False)
    assert (options.image("engine"), options.image("gateway")) == ("localhost:5000/md/engine:dev",
                                                                   "localhost:5000/md/gateway:dev")
    defaults = settings_from_args(build_parser().parse_args(["operator"]))
    assert (defaults.image_registry, defaults.image_tag) == (s.DEFAULT_IMAGE_REGISTRY, VERSION)
    for bad in ("https://registry.example.com/md", "registry.example.com/md:1.0", "Registry/MD", ""):
        with pytest.raises(ValueError, match="image_registry"):
            OperatorSettings(image_registry=bad)
    with pytest.raises(ValueError, match="image_tag"):
        OperatorSettings(image_tag="a b")


def test_the_operator_takes_the_registry_from_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from minedraft.cli import build_parser
    from minedraft.operator.cli import settings_from_args

    monkeypatch.setenv("MINEDRAFT_OPERATOR_IMAGE_REGISTRY", "registry.example.com/env")
    monkeypatch.setenv("MINEDRAFT_OPERATOR_IMAGE_TAG", "1.2.3")
    settings = settings_from_args(build_parser().parse_args(["operator"]))
    assert settings.render_options(False).image("engine") == "registry.example.com/env/engine:1.2.3"


def test_the_crd_no_longer_defaults_the_images() -> None:
    """An image default in the CRD would be stored into every MineDraft and win over the operator's registry."""
    from minedraft.operator.crd import crd

    props = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert "default" not in props["engine"]["properties"]["image"]
    assert "default" not in props["gateway"]["properties"]["image"]


def test_a_malformed_registry_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from minedraft.cli import build_parser

    for flag, value in (("--image-registry", "https://registry.example.com/md"), ("--image-tag", "a b")):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(["operator", flag, value])
        assert exit_info.value.code == 2
        assert f"argument {flag}: {value!r} is not" in capsys.readouterr().err
