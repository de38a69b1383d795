"""A chart upgrade (a new image.tag) rolls the engines of one MineDraft at a time, or only on request, instead of
every GPU pod of the cluster at once; a MineDraft that names its own image is never held back."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from minedraft.operator import render
from minedraft.operator.metrics import OperatorMetrics
from minedraft.operator.reconcile import UPGRADE_ANNOTATION, Reconciler, choose_engine_image

OLD, NEW = "registry.example.com/md/engine:1.0", "registry.example.com/md/engine:2.0"


@pytest.mark.parametrize(("pinned", "running", "policy", "requested", "another", "chosen"), [
    (None, None, "OneAtATime", False, True, NEW),  # a new MineDraft starts on the new image
    (None, NEW, "OneAtATime", False, True, NEW),
    (None, OLD, "OneAtATime", False, False, NEW),  # its turn
    (None, OLD, "OneAtATime", False, True, OLD),  # another is rolling: wait
    (None, OLD, "OneAtATime", True, True, NEW),  # asked for
    (None, OLD, "OnRequest", False, False, OLD),
    (None, OLD, "OnRequest", True, False, NEW),
    (None, OLD, "All", False, True, NEW),
    ("mine:3", OLD, "OnRequest", False, True, "mine:3"),  # its own image: its own spec change
])
def test_choose_engine_image(pinned: str | None, running: str | None, policy: str, requested: bool, another: bool,
                             chosen: str) -> None:
    assert choose_engine_image(pinned, running, NEW, policy, requested, another) == chosen


class FakeCluster:
    """The API calls a reconcile makes, in memory; Deployments roll out only when the test says so."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}

    async def get(self, resource: Any, namespace: str, name: str) -> dict[str, Any] | None:
        found = self.objects.get((resource.kind, namespace, name))
        return copy.deepcopy(found) if found is not None else None

    async def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        key = (manifest["kind"], manifest["metadata"]["namespace"], manifest["metadata"]["name"])
        obj = copy.deepcopy(manifest)
        if manifest["kind"] == "Deployment":
            previous = self.objects.get(key)
            generation = int(previous["metadata"]["generation"]) + 1 if previous else 1
            obj["metadata"]["generation"] = generation
            obj["status"] = {"observedGeneration": generation, "updatedReplicas": 0, "readyReplicas": 0}
        self.objects[key] = obj
        return obj

    async def create_if_absent(self, resource: Any, manifest: dict[str, Any]) -> bool:
        key = (manifest["kind"], manifest["metadata"]["namespace"], manifest["metadata"]["name"])
        if key in self.objects:
            return False
        self.objects[key] = copy.deepcopy(manifest)
        return True

    async def delete(self, resource: Any, namespace: str, name: str, orphan: bool = False) -> None:
        self.objects.pop((resource.kind, namespace, name), None)

    async def list_objects(self, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        return []

    def roll_out(self, namespace: str, name: str, ready: bool = True) -> None:
        deployment = self.objects[("Deployment", namespace, name)]
        replicas = int(deployment["spec"].get("replicas", 1))
        deployment["status"].update(updatedReplicas=replicas, readyReplicas=replicas if ready else 0)

    def engine_image(self, name: str) -> str:
        deployment = self.objects[("Deployment", "ns", f"{name}-engine")]
        return str(deployment["spec"]["template"]["spec"]["containers"][0]["image"])


def minedraft(name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "minedraft.io/v1alpha1", "kind": "MineDraft",
            "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "generation": 1,
                         "annotations": annotations or {}},
            "spec": {"target": {"source": {"image": {"path": "/t"}}}, "draft": {"source": {"image": {"path": "/d"}}},
                     "replicas": 1}}


def operator(cluster: FakeCluster, tag: str, policy: str) -> Reconciler:
    options = render.RenderOptions(image_registry="registry.example.com/md", image_tag=tag)
    return Reconciler(cluster, options, OperatorMetrics(), engine_image_rollout=policy)  # type: ignore[arg-type]


def reconcile(reconciler: Reconciler, doc: dict[str, Any]) -> dict[str, Any]:
    return asyncio.run(reconciler.reconcile(doc)).status


def installed(names: tuple[str, ...]) -> FakeCluster:
    cluster = FakeCluster()
    before = operator(cluster, "1.0", "OneAtATime")
    for name in names:
        reconcile(before, minedraft(name))
        cluster.roll_out("ns", f"{name}-engine")
        assert cluster.engine_image(name) == OLD
    return cluster


def test_a_chart_upgrade_rolls_one_minedraft_at_a_time() -> None:
    cluster = installed(("a", "b", "c"))
    upgraded = operator(cluster, "2.0", "OneAtATime")
    first = reconcile(upgraded, minedraft("a"))
    assert cluster.engine_image("a") == NEW and first["engineImage"] == NEW and first["pendingEngineImage"] is None
    for name in ("b", "c"):
        held = reconcile(upgraded, minedraft(name))
        assert cluster.engine_image(name) == OLD
        assert held["engineImage"] == OLD and held["pendingEngineImage"] == NEW
    cluster.roll_out("ns", "a-engine")
    reconcile(upgraded, minedraft("a"))  # a has rolled out: the next may go
    reconcile(upgraded, minedraft("b"))
    reconcile(upgraded, minedraft("c"))
    assert (cluster.engine_image("b"), cluster.engine_image("c")) == (NEW, OLD)
    cluster.roll_out("ns", "b-engine")
    reconcile(upgraded, minedraft("b"))
    assert reconcile(upgraded, minedraft("c"))["pendingEngineImage"] is None and cluster.engine_image("c") == NEW


def test_on_request_only_annotated_minedrafts_roll_and_all_rolls_everything() -> None:
    cluster = installed(("a", "b"))
    on_request = operator(cluster, "2.0", "OnRequest")
    reconcile(on_request, minedraft("a"))
    reconcile(on_request, minedraft("b", {UPGRADE_ANNOTATION: "true"}))
    assert (cluster.engine_image("a"), cluster.engine_image("b")) == (OLD, NEW)
    everything = operator(installed(("c", "d")), "2.0", "All")
    cluster = everything.client  # type: ignore[assignment]
    reconcile(everything, minedraft("c"))
    reconcile(everything, minedraft("d"))
    assert (cluster.engine_image("c"), cluster.engine_image("d")) == (NEW, NEW)


def test_a_new_minedraft_and_one_with_its_own_image_are_never_held() -> None:
    cluster = installed(("a",))
    upgraded = operator(cluster, "2.0", "OneAtATime")
    reconcile(upgraded, minedraft("a"))  # rolling
    assert reconcile(upgraded, minedraft("fresh"))["engineImage"] == NEW
    own = minedraft("b")
    own["spec"]["engine"] = {"image": "registry.example.com/custom/engine:9"}
    assert reconcile(upgraded, own)["engineImage"] == "registry.example.com/custom/engine:9"
    assert cluster.engine_image("b") == "registry.example.com/custom/engine:9"


def test_the_next_minedraft_waits_until_the_rolled_engines_are_ready() -> None:
    """Updated but not ready (a replacement still Pending or loading a broken image) holds the others back."""
    cluster = installed(("a", "b"))
    upgraded = operator(cluster, "2.0", "OneAtATime")
    reconcile(upgraded, minedraft("a"))
    cluster.roll_out("ns", "a-engine", ready=False)
    reconcile(upgraded, minedraft("a"))
    assert reconcile(upgraded, minedraft("b"))["pendingEngineImage"] == NEW and cluster.engine_image("b") == OLD
    cluster.roll_out("ns", "a-engine")
    reconcile(upgraded, minedraft("a"))
    reconcile(upgraded, minedraft("b"))
    assert cluster.engine_image("b") == NEW
