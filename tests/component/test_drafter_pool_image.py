"""The drafter pool's pod runs on the engine image: its command parses with the image's `minedraft`, its paths are
writable on the pod's volumes, and it gets the operator's registry (the same contract as every other pod)."""

from __future__ import annotations

from typing import Any

import yaml

from tests.image_contract import pod_problems

from .test_images import REGISTRY, ROOT, VERSION, images, pod_templates, rendered


def test_the_drafter_pool_pod_runs_on_the_engine_image() -> None:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
    doc["spec"]["drafterPool"] = {"tokenSecretRef": {"name": "drafter-token"}}
    pods = dict(pod_templates(rendered(doc)))
    pool = next(pod for where, pod in pods.items() if "drafter" in where)
    assert pod_problems(pool, images(), REGISTRY) == []
    assert pool["containers"][0]["image"] == f"{REGISTRY}/engine:{VERSION}"
